"""Held-out episodes: tasks no training row of the run used, and playing them the way a training step plays its batch.

Both `make eval` (trainer.after.evaluate: a finished checkpoint vs its base model, pass@k) and the evaluation during
training (EVAL_EVERY: trainer.run.evaluation, greedy) take their tasks and play them here.

A task is row 0 of the env's make_dataset(1, seed), for seeds 1,000,000,000 upward that training never uses: a
built-in env's training rows come from make_dataset(DATASET_SIZE, SEED + i) (i: the env's place in ENV_NAME), an env
learned from its server resets with seeds SEED + i .. SEED + i + DATASET_SIZE - 1; those are skipped. An env whose rows
come from ENV_PROMPTS_FILE trains on every row of it: it is scored on the rows of another file of the same format
(`make eval --prompts-file`), and has no held-out rows during training. An env that serves its own tasks (OpenEnv's
Task API, envs.generic.tasks) trains on one split and is evaluated on the first tasks of its test split (else its
validation split): their indices stand for the seeds. A small task space repeats across seeds (echo has six words):
held out means a seed, not necessarily a task, training never saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contract.config import RunConfig

EVAL_SEED_BASE = 1_000_000_000  # far above SEED + DATASET_SIZE of any sensible run; collisions are skipped anyway
DEFAULT_THRESHOLD = 0.5  # success: reward above it (echo: 1.0 for the right word, 0.2 for a wrong one; catch: +1 / -1)


class NoHeldOutRows(ValueError):
    """One line: an env with no held-out rows, and what to do."""


def training_seeds(cfg: RunConfig, index: int, builtin: bool) -> set[int]:
    """What training seeded env number `index` of ENV_NAME with (trainer.run.dataset.build_dataset): the seed of its
    make_dataset for a built-in env, the reset seeds of its instruction rows for an env learned from its server."""
    first = cfg.seed + index
    return {first} if builtin else set(range(first, first + cfg.dataset_size))


def held_out(cfg: RunConfig, specs: dict[str, Any], tasks: int,
             prompts_file: str | None = None) -> dict[str, tuple[list[int], list[dict]]]:
    """{env: (seeds or row indices, rows)}: `tasks` tasks per env that no training row of this run used."""
    from envs import registry

    out = {}
    for index, name in enumerate(cfg.env_names):
        spec = specs[name]
        if getattr(spec, "prompts_file", None):  # training uses every row of ENV_PROMPTS_FILE
            if not prompts_file:
                raise NoHeldOutRows(
                    f"env {name}: its rows come from ENV_PROMPTS_FILE and training uses every one of them, so none is "
                    "held out; `make eval` takes held-out rows in a file of the same format (make eval ARGS=\""
                    "--prompts-file /prompts/<file>.jsonl\"); during training leave EVAL_EVERY empty (edit .env)")
            from envs.generic.task import prompts_file_rows

            rows = prompts_file_rows(prompts_file, name)[:tasks]
            out[name] = (list(range(len(rows))), rows)
            continue
        if getattr(spec, "tasks", None) is not None:  # an env serving its own tasks: its test (or validation) split
            found = spec.held_out_rows(tasks)
            if found is None:
                raise NoHeldOutRows(
                    f"env {name}: it serves its own tasks ({spec.tasks.line()}) and trains on "
                    f"{spec.tasks.train_split(spec.split).name!r}; no test or validation split is left to evaluate on: "
                    "leave EVAL_EVERY empty (edit .env), or train on another split (ENV_<NAME>_SPLIT)")
            _, rows = found
            out[name] = ([row["reset_kwargs"]["index"] for row in rows], rows)
            continue
        used = training_seeds(cfg, index, registry.is_builtin(name))
        seeds, seed = [], EVAL_SEED_BASE
        while len(seeds) < tasks:
            if seed not in used:
                seeds.append(seed)
            seed += 1
        out[name] = (seeds, [spec.make_dataset(1, s)[0] for s in seeds])
    return out


@dataclass
class Episode:
    task: int
    reward: float
    calls: int
    failures: int
    tokens: int
    infra_failure: str | None = None  # why the env side ended it (trainer.rollouts.infra_failures): then it is not scored


def encoded(cfg: RunConfig, name: str, row: dict) -> dict:
    """A dataset row as training encodes it (trainer.run.dataset): multi-env rows carry their `environment`."""
    from trainer.rollouts.envs_binding import encode_row

    enc = encode_row(dict(row))
    if len(cfg.env_names) > 1:
        enc["environment"] = name
    return enc


def batch_rows(cfg: RunConfig, name: str, rows: int, generations: int) -> int:
    """Tasks per batch: as many episodes at once as training opens sessions on this env (RunConfig.sessions_needed,
    per process), so the batches play on the sessions TRL's pool already holds and need no more env capacity."""
    return max(1, cfg.sessions_needed(name, env_rows=rows) // generations)


def play(trainer, cfg: RunConfig, name: str, rows: list[dict], generations: int, on_batch=None) -> list[Episode]:
    """Each row played `generations` times, a batch of batch_rows() rows at a time, exactly as a training step plays
    its batch (the trainer's `_generate_and_score_completions`: reset, generation, tool rounds, the env's get_reward)
    with the trainer in eval mode; the caller picks how it samples. `on_batch(episodes so far)`: progress."""
    import torch

    from envs.core.tool import infra_failure_of, trace_of

    per_batch = batch_rows(cfg, name, len(rows), generations)
    episodes: list[Episode] = []
    for first in range(0, len(rows), per_batch):
        inputs = [encoded(cfg, name, row) for row in rows[first:first + per_batch] for _ in range(generations)]
        with torch.no_grad():
            trainer._generate_and_score_completions(inputs)
        counts = trainer.last_tool_counts or [(0, 0)] * len(inputs)
        tokens = trainer.last_tokens or [0] * len(inputs)
        for i, env in enumerate(trainer.environments):
            reward = getattr(trace_of(env), "env_reward", None)
            episodes.append(Episode(first + i // generations, float(reward or 0.0), counts[i][0], counts[i][1],
                                    tokens[i], infra_failure_of(env)))
        if on_batch is not None:
            on_batch(episodes)
    return episodes
