"""How the judge's score joins the reward, and how a failed judge call leaves its row out, in both ROLLOUTS modes.

Weights: the judge's column (`judge`) weighs JUDGE_WEIGHT, the env's own reward columns (TRL adds one per env class
with `get_reward`, named after the class, weight 1) ENV_REWARD_WEIGHT, the stack's other terms (`unfinished`) 1.
Sync: TRL's `reward_weights` (GRPOConfig's covers only the functions passed in; the env columns TRL appends after are
set here, once the trainer is built). Async: TRL's rollout worker sums its columns unweighted; `reweigh` sums them again
with the weights (the per-column figures TRL logs stay unweighted in both modes).

A failed call (trainer.judge.reward marks the episode's trace) is an infra failure of the row, as an env's
(trainer.rollouts.infra_failures): sync, every column of the row becomes NaN, so TRL's nan-aware aggregation leaves it
out of its group's mean and std with advantage 0 (`unscorable_mask`), and its tokens leave the loss mask; async, the
row is left out of the group's baseline here and its samples never reach the queue. A row that is simply not judged
(ENV_<NAME>_JUDGE=0) keeps its other columns: `judge` is NaN there, which TRL's nansum skips."""

from __future__ import annotations

import math
from typing import Sequence

from trainer.judge.reward import judge_failure_of

JUDGE_COLUMN = "judge"


def weights_for(names: Sequence[str], passed: Sequence[str], judge_weight: float, env_weight: float) -> list[float]:
    """The weight of each reward column: `names` (TRL's reward_func_names), `passed` (the functions the stack passed
    in; the rest are the env classes' `get_reward` columns)."""
    return [judge_weight if name == JUDGE_COLUMN else 1.0 if name in passed else env_weight for name in names]


def apply_weights(trainer, passed: Sequence[str], judge_weight: float, env_weight: float) -> None:
    """Sync: the built trainer's reward_weights set for every column (the env columns included)."""
    import torch

    weights = weights_for(trainer.reward_func_names, passed, judge_weight, env_weight)
    trainer.reward_weights = torch.tensor(weights, dtype=torch.float32)
    trainer.judge_on = True  # its _calculate_rewards leaves failed judge calls out (leave_out_failed)


def failed_rows(environments) -> list[bool]:
    return [judge_failure_of(env) is not None for env in environments or []]


def leave_out_failed(trainer, rewards_per_func):
    """Sync, after infra_failures.leave_out_rewards: the rows of failed judge calls (every process's) NaN in every
    column, and this process's marked for infra_failures.leave_out_of_loss. Every process calls this together."""
    import torch

    from trainer.rollouts import infra_failures

    processes = trainer.accelerator.num_processes
    local_n = rewards_per_func.shape[0] // processes
    marks = failed_rows(trainer.environments) or [False] * local_n
    local = torch.tensor(marks, dtype=torch.long, device=rewards_per_func.device)
    rows = (trainer.accelerator.gather(local) if processes > 1 else local).bool()
    if not bool(rows.any()):
        return rewards_per_func
    out = rewards_per_func.clone()
    out[rows] = float("nan")
    infra_failures.also_leave_out(trainer, [bool(m) for m in marks])
    return out


def reweigh(samples: list, completions: list, names: Sequence[str], weights: Sequence[float],
            left_out: Sequence[bool]) -> None:
    """Async: each sample's reward, reward_std and advantage recomputed from its per-column values (TRL's
    `rewards/<name>` metrics) with `weights`, the `left_out` completions (failed judge calls) out of the group's
    baseline: TRL's worker formula (advantage = (r - mean) / (std + 1e-8) over the scored rows, 0 for the others)."""
    index = {id(c): i for i, c in enumerate(completions)}
    rewards = [math.nan] * len(completions)
    for sample in samples:
        i = index.get(id(sample.completion))
        if i is None or left_out[i] or not math.isnan(rewards[i]):
            continue
        values = [sample.metrics.get(f"rewards/{name}", math.nan) for name in names]
        present = [(w, v) for w, v in zip(weights, values) if not math.isnan(v)]
        rewards[i] = sum(w * v for w, v in present) if present else math.nan
    scored = [r for r in rewards if not math.isnan(r)]
    mean = sum(scored) / len(scored) if scored else math.nan
    std = math.sqrt(sum((r - mean) ** 2 for r in scored) / len(scored)) if scored else math.nan
    for sample in samples:
        i = index.get(id(sample.completion))
        if i is None:
            continue
        reward = rewards[i]
        sample.advantage = 0.0 if math.isnan(reward) else (reward - mean) / (std + 1e-8)
        sample.metrics["reward"] = reward
        sample.metrics["reward_std"] = std
