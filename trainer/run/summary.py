"""What a run prints when it ends: each env's sessions, and the last steps' reward and tool use."""

from __future__ import annotations

from pathlib import Path

from contract.config import RunConfig
from envs.core.untrusted import log_text
from trainer.run import checkpoints
from trainer.core.dist import log


def print_env_sessions(cfg: RunConfig, factories) -> None:
    """One line per env: the sessions this process opened on its replicas (TRL's pool: one per rollout slot)."""
    from trainer.core import dist

    bound = factories if isinstance(factories, dict) else {cfg.env_names[0]: factories}
    who = f"rank {dist.rank()}: " if dist.world_size() > 1 else ""  # every process opens its own sessions
    for name, cls in bound.items() if not cfg.rollouts.is_async else ():  # async: the sessions were the worker's
        if cls.replica_set is not None:  # TRL's pool: one instance (= one env session) per rollout slot
            print(f"[train] {who}env {name}: {log_text(cls.replica_set.describe())}", flush=True)


def print_summary(cfg: RunConfig, step: int) -> None:
    from trainer.core.metrics import read_metrics

    rows = read_metrics(cfg.run_dir)
    tail = rows[-5:]

    def mean(key):
        vals = [r[key] for r in tail if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    calls = [r["tools/call_frequency"] for r in rows if isinstance(r.get("tools/call_frequency"), (int, float))]
    if calls:
        from contract import stages

        per_episode = sum(calls) / len(calls)
        stages.mark("tool_calls", None, f"{per_episode:.2f} tool calls per episode over {len(calls)} steps",
                    value=round(per_episode, 3))
    ckpts = sorted(p.name for p in Path(cfg.run_dir).glob(f"{checkpoints.PREFIX}*"))
    log(f"done: step {step}/{cfg.max_steps}; last {len(tail)} steps: reward {mean('reward'):.3f}, "
        f"tool calls/episode {mean('tools/call_frequency'):.2f}, tool failures {mean('tools/failure_frequency'):.2f}")
    log(f"checkpoints: {', '.join(ckpts) or 'none'}; metrics: {cfg.run_dir}/metrics.jsonl; "
        f"plot: make report RUN={cfg.resolved_run_name}")
