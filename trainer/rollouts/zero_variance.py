"""Zero-variance groups (#43 item 2): GRPO groups whose completions all scored the same.

Their advantage is 0 (every reward minus the group's mean), so they teach nothing, but TRL keeps their tokens in the
loss's normaliser (`num_items_in_batch`, async: the batch's trained-token count), which shrinks the weight of every
other token: with half the groups flat, the rest learn at about half the rate.

  * Logged, both modes, as METRIC (TRL's sync key, per step: the share of the batch's groups). Sync: TRL's own value
    is replaced by this module's count (`log_share`): TRL 1.16 takes the std in float32, where eight equal rewards
    of 0.2 (echo's partial reward) already have a std of 1.6e-8 > its 1e-8 tolerance, so its share misses flat groups
    of 8. Async: the worker pushes one (flat, 1) rate per scored group, so TRL's window reduction gives the share of
    the groups scored.
  * ZERO_STD_GROUPS=drop takes them out of the loss the way trainer.rollouts.infra_failures takes episodes the env
    side ended out: sync, their tokens leave the loss mask and the normaliser is counted again; async, their samples
    never reach the queue. The default is `keep` (TRL's behaviour): `drop` makes every step larger when many groups
    are flat (the normaliser shrinks while the learning rate stays), which a run tuned with TRL's normaliser did not
    expect, and the measured curves show no gain (`make bench-learning ARGS=--compare-zero-std`, docs/profiles.md:
    on echo 0.57-0.78 of groups are flat and drop's reward curve and final check match keep's). Async runs log their reward figures over trained
    samples only (env/<env>/reward_mean included), so with `drop` those figures leave the flat groups out.

  * ZERO_STD_GROUPS=resample (issue 65 item 4, DAPO's dynamic sampling): flat groups are replaced by informative ones
    from extra generation, at most ZERO_STD_RESAMPLE_MAX x the groups a step trains; past the bound they are trained as
    with keep. Sync: trainer.rollouts.resample (whole extra batches, informative groups swapped into the flat ones'
    rows). Async: `WorkerResample`, in the rollout worker, which never stops generating: a flat group left out of the
    queue is replaced by the next to finish (with `drop` as well, without a bound). Both log EXTRA_GENERATION.

A group is flat when at least two of its completions were scored (an episode the env side ended is not) and the
sample standard deviation of their rewards is at most TOLERANCE: the test TRL applies to its own metric
(`torch.isclose(std, 0)`, Bessel-corrected `nanstd`). Light at import: torch only inside the sync hook.
"""

from __future__ import annotations

import math
from typing import Sequence

METRIC = "frac_reward_zero_std"  # TRL 1.16's sync key; the async worker logs the same share under it
EXTRA_GENERATION = "zero_std/extra_generation"  # groups generated to replace flat ones, per group trained
TOLERANCE = 1e-8  # torch.isclose's atol: TRL's test for frac_reward_zero_std
MODES = ("keep", "drop", "resample")


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether one group's rewards (NaN: not scored) leave every scored completion advantage 0."""
    scored = [float(r) for r in rewards if r is not None and not math.isnan(r)]
    if len(scored) < 2:
        return False
    mean = sum(scored) / len(scored)
    return math.sqrt(sum((r - mean) ** 2 for r in scored) / (len(scored) - 1)) <= TOLERANCE


def flat_rows(rewards: Sequence[float], group_size: int) -> list[bool]:
    """For each row of a batch laid out in groups of `group_size` consecutive rows (as TRL groups them): whether its
    group is flat."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not split into groups of {group_size}")
    out: list[bool] = []
    for start in range(0, len(rewards), group_size):
        out += [is_flat(rewards[start:start + group_size])] * group_size
    return out


# ---------------------------------------------------------------------------- the sync trainer's side (trainer.train)
def leave_out_of_normaliser(trainer, rewards_per_func) -> None:
    """Sync: note the batch's share of flat groups for `log_share`, and with ZERO_STD_GROUPS=drop mark this process's
    rows of them for infra_failures.leave_out_of_loss (which takes them out of the loss mask and recounts the
    normaliser). `rewards_per_func`: every process's rows, as `_calculate_rewards` returns them after
    infra_failures.leave_out_rewards (its NaN rows are not scored). The rows are summed with TRL's reward weights, as
    TRL's `sum_then_normalize` does; under `normalize_then_sum` a flat group's advantage is not 0 (TRL normalises over
    the batch), so nothing is dropped. Every process reaches this together and computes the same rows from the same
    gathered rewards: no collective is needed."""
    import torch

    group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
    weights = trainer.reward_weights.to(rewards_per_func.device)
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    if group < 2 or not len(rewards) or len(rewards) % group:
        return  # no groups to judge (one completion per prompt in eval): TRL's own value stands
    rows = flat_rows(rewards.double().tolist(), group)
    trainer._flat_share = sum(rows) / len(rows)
    trainer._flat_rows = rows  # every process's rows: ZERO_STD_GROUPS=resample refills them (trainer.rollouts.resample)
    if getattr(trainer, "zero_std_groups", "keep") != "drop" or not trainer.model.training or not any(rows):
        return
    if getattr(trainer, "multi_objective_aggregation", "sum_then_normalize") != "sum_then_normalize":
        return
    from trainer.rollouts import infra_failures

    local_n = rewards_per_func.shape[0] // trainer.accelerator.num_processes
    start = trainer.accelerator.process_index * local_n
    infra_failures.also_leave_out(trainer, rows[start:start + local_n])


def log_share(trainer) -> None:
    """After TRL's `_generate_and_score_completions` appended its METRIC value for the batch: this module's share
    instead (see the module docstring), so the key counts what ZERO_STD_GROUPS=drop drops, as in an async run."""
    share = getattr(trainer, "_flat_share", None)
    values = trainer._metrics["train" if trainer.model.training else "eval"].get(METRIC)
    if share is not None and values:
        values[-1] = share
    trainer._flat_share = None


# ---------------------------------------------------------------------------- the async worker's side (ROLLOUTS=async)
def group_rewards(completions: list, samples: list) -> list[float]:
    """The reward TRL's `_score_group` gave each completion of a group (NaN: not scored, or no trained row)."""
    reward = {}
    for sample in samples:
        reward.setdefault(id(sample.completion), sample.metrics.get("reward", math.nan))
    return [reward.get(id(completion), math.nan) for completion in completions]


class WorkerResample:
    """Async: which flat groups the worker leaves out of the queue. The worker never stops generating, so a group left
    out is replaced by the next one to finish: `drop` leaves every flat group out (no bound on the extra generation);
    `resample` leaves one out only while the groups left out stay within ZERO_STD_RESAMPLE_MAX x (the groups sent to
    train + one step's groups), and past it sends it to train as `keep` does (advantage 0), so a run whose groups are
    nearly all flat still trains."""

    def __init__(self, mode: str, bound: float, step_groups: int) -> None:
        if mode not in MODES:
            raise ValueError(f"ZERO_STD_GROUPS={mode!r}: choose from {', '.join(MODES)}")
        self.mode, self.bound, self.step_groups = mode, bound, step_groups
        self.left_out = 0  # flat groups left out so far
        self.trained = 0  # groups sent to train so far (the worker counts them)

    def leave_out(self, flat: bool) -> bool:
        if not flat or self.mode == "keep":
            return False
        if self.mode == "resample" and self.left_out + 1 > self.bound * (self.trained + self.step_groups):
            return False
        self.left_out += 1
        return True
