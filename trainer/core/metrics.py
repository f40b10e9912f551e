"""Per-step metrics: JSONL, then every tracker REPORT_TO names (trainer.core.trackers: TensorBoard by default).

TRL already logs reward, reward_std, rewards/<EnvClass>/mean, tools/call_frequency,
tools/failure_frequency and completions/* into the `logs` dict; we keep those and add what it does
not: reward / episode length / tool failures per env name (recorded by the env binding) and the
step time split into generation / env / scoring / training (+ weight sync on GPU), and at every EVAL_EVERY-th step
the held-out evaluation's eval/<env>/... and time/eval_s (trainer.run.evaluation).

Records in metrics.jsonl: {"kind": "step", "step": N, ...} one per logging step, and
{"kind": "summary", ...} at the end of a training session. On resume from checkpoint-N, step
records after N are dropped (they are re-run), so every step appears exactly once.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from contract import sampling_health, stages
from contract.config import CpuMode, SyncRollouts, TrainModeVariant
from trainer.core.trackers import RunInfo, Trackers

METRICS_FILE = "metrics.jsonl"


class RolloutStats:
    """Thread-safe accumulator shared by the env binding (episodes, env time) and the trainer (timers)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.timers: dict[str, float] = defaultdict(float)
            self.episodes: dict[str, list[dict[str, float]]] = defaultdict(list)
            self.infra_failures: dict[str, int] = defaultdict(int)
            self.figures: dict[str, float] = {}  # added to the next step record as they are (the evaluation's)

    @contextmanager
    def set_apart(self):
        """Episodes, timers and infra failures recorded inside go to the account this yields, not to the step's record
        (the evaluation during training plays between two steps); the step's own records stay where they were."""
        apart = RolloutStats()
        with self._lock:
            saved = self.timers, self.episodes, self.infra_failures
            self.timers, self.episodes, self.infra_failures = apart.timers, apart.episodes, apart.infra_failures
        try:
            yield apart
        finally:
            with self._lock:
                self.timers, self.episodes, self.infra_failures = saved

    def add_figures(self, figures: dict[str, float]) -> None:
        with self._lock:
            self.figures.update(figures)

    def drain_figures(self) -> dict[str, float]:
        with self._lock:
            figures, self.figures = self.figures, {}
        return figures

    def add_time(self, name: str, seconds: float) -> None:
        with self._lock:
            self.timers[name] += seconds

    @contextmanager
    def timer(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add_time(name, time.perf_counter() - start)

    def add_episode(self, env: str, reward: float, tool_calls: int, tool_failures: int) -> None:
        with self._lock:
            self.episodes[env].append(
                {"reward": float(reward), "tool_calls": tool_calls, "tool_failures": tool_failures}
            )

    def add_infra_failure(self, env: str) -> None:
        """An episode the env side ended (trainer.rollouts.infra_failures): counted apart, not in the env's reward."""
        with self._lock:
            self.infra_failures[env] += 1

    def drain(self) -> tuple[dict[str, float], dict[str, list[dict[str, float]]]]:
        with self._lock:
            timers, episodes = dict(self.timers), {k: list(v) for k, v in self.episodes.items()}
            self.timers = defaultdict(float)
            self.episodes = defaultdict(list)
        return timers, episodes

    def drain_infra_failures(self) -> dict[str, int]:
        with self._lock:
            counts, self.infra_failures = dict(self.infra_failures), defaultdict(int)
        return counts


# One per process: the binding's bound classes and the trainer subclass both write here.
STATS = RolloutStats()


def summarize_episodes(episodes: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for env, eps in sorted(episodes.items()):
        if not eps:
            continue
        n = len(eps)
        calls = sum(e["tool_calls"] for e in eps)
        out[f"env/{env}/episodes"] = n
        out[f"env/{env}/reward_mean"] = sum(e["reward"] for e in eps) / n
        out[f"env/{env}/episode_length"] = calls / n  # tool calls (turns) per episode
        out[f"env/{env}/tool_failure_frequency"] = (sum(e["tool_failures"] for e in eps) / calls) if calls else 0.0
    return out


def _clean(value: Any) -> Any:
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def read_metrics(run_dir: str | os.PathLike, kind: str = "step") -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill mid-write
            continue
        if kind is None or row.get("kind") == kind:
            rows.append(row)
    return rows


def truncate_metrics(run_dir: str | os.PathLike, last_step: int) -> int:
    """Keep step records with step <= last_step (the checkpoint we resume from); return how many were dropped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return 0
    rows = read_metrics(run_dir, kind=None)
    keep, seen, dropped = [], set(), 0
    for row in rows:
        if row.get("kind") != "step":
            continue  # summaries of earlier sessions are rewritten at the end of this one
        step = row.get("step", 0)
        if step > last_step or step in seen:
            dropped += 1
            continue
        seen.add(step)
        keep.append(row)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
    os.replace(tmp, path)
    return dropped


class MetricsCallback(TrainerCallback):
    """Writes one JSONL record per logging step, hands it to the trackers, and prints a one-line progress."""

    def __init__(self, run_dir: str, stats: RolloutStats = STATS, resume_step: int = 0,
                 mode: TrainModeVariant = CpuMode(), print_fn=print, trackers: Trackers | None = None,
                 rollouts=SyncRollouts(), figures: Callable[[], dict[str, float]] | None = None) -> None:
        self.run_dir = Path(run_dir)
        # more figures a step record takes from this process (the judge's costs: trainer.judge.costs.COSTS.drain)
        self.figures = figures
        self.stats = stats
        self.resume_step = resume_step
        self.mode = mode
        # async: TRL's AsyncGRPOTrainer logs, mapped to these keys by trainer.core.async_metrics
        self.rollouts = rollouts  # contract.config's SyncRollouts | AsyncRollouts
        self.print = print_fn
        # Opened lazily, at the first logged step: only the main process writes.
        self.trackers = trackers or Trackers(["tensorboard"], RunInfo(run_dir, self.run_dir.name,
                                                                      str(self.run_dir.parent),
                                                                      resume_step=resume_step))
        self._step_start: float | None = None
        self._step_times: list[float] = []
        # vLLM's vs the trainer's log-probs: the smoke's stage after step 3, one warning when a step leaves bounds.
        # vLLM modes, both ROLLOUTS: judged on the off-policy figures alike (trainer.core.off_policy)
        self.sampling = sampling_health.Watch(stages.mark, lambda line: self.print(f"[train] {line}"),
                                              ratio_key=sampling_health.OFF_POLICY_RATIO if mode.uses_vllm
                                              else sampling_health.RATIO_MEAN)
        self.staleness = sampling_health.StalenessWatch(stages.mark)  # async: the smoke's staleness stage

    def on_train_begin(self, args, state, control, **kwargs):
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.stats.drain()  # discard probe-instance noise from trainer init
        self.stats.drain_infra_failures()

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self._step_times.append(time.perf_counter() - self._step_start)
            self._step_start = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        timers, episodes = self.stats.drain()
        infra = self.stats.drain_infra_failures()
        if "train_runtime" in logs:  # end-of-session summary from Trainer.train
            self._append({"kind": "summary", "step": state.global_step, "time": time.time(),
                          **{k: _clean(v) for k, v in logs.items()}})
            return
        steps = max(1, len(self._step_times))
        step_s = sum(self._step_times) / steps if self._step_times else None
        self._step_times = []
        if self.rollouts.is_async:
            self._log_record(self._async_record(logs, episodes, step_s, state.global_step, steps), args, state)
            return
        sync = timers.get("weight_sync", 0.0) / steps
        # TRL syncs weights inside its generation call (vLLM modes): report the two apart.
        gen = max(0.0, timers.get("generation", 0.0) / steps - sync)
        env = timers.get("env", 0.0) / steps
        score_total = max(0.0, timers.get("generate_and_score", 0.0) / steps - sync)
        record: dict[str, Any] = {"kind": "step", "step": state.global_step, "time": time.time(), "mode": self.mode.name}
        record.update({k: _clean(v) for k, v in logs.items()})
        record.update(summarize_episodes(episodes))
        record.update({f"env/{env}/infra_failures": n for env, n in sorted(infra.items())})  # trainer.rollouts.infra_failures
        record.update(self.stats.drain_figures())  # eval/<env>/... at an EVAL_EVERY step (trainer.run.evaluation)
        record.update(self.figures() if self.figures else {})  # judge/* (trainer.judge.costs)
        if step_s is not None:
            record["time/step_s"] = step_s
            record["time/generation_s"] = gen
            record["time/env_s"] = env
            record["time/scoring_s"] = max(0.0, score_total - gen - env)  # logprobs, parsing, rewards
            record["time/training_s"] = max(0.0, step_s - score_total - sync)  # fwd/bwd/optimizer
            if self.mode.uses_vllm:
                record["time/weight_sync_s"] = sync
        self._log_record(record, args, state)

    def _async_record(self, logs, episodes, step_s, step, steps=1) -> dict[str, Any]:
        from trainer.core import async_metrics

        record: dict[str, Any] = {"kind": "step", "step": step, "time": time.time(), "mode": self.mode.name,
                                  "rollouts": "async"}
        record.update({k: _clean(v) for k, v in async_metrics.record(logs).items()})
        record.update(summarize_episodes(episodes))  # none here unless the env binding ran in this process
        record.update(self.stats.drain_figures())  # eval/<env>/... at an EVAL_EVERY step (trainer.async_grpo.async_eval)
        record.update(async_metrics.time_split(logs, step_s, steps))
        stages.mark("first_generation", record.get("time/generation_s"),
                    "first scored rollouts reached the trainer (async rollout worker)")
        return record

    def _log_record(self, record: dict[str, Any], args, state) -> None:
        self._append(record)
        stages.mark("first_optimizer_step", record.get("time/step_s"), f"step {state.global_step}: loss "
                    f"{record.get('loss')}, reward {record.get('reward')}")
        self.trackers.log_record(record)
        self.print(self._progress_line(record, args))
        self.sampling.observe(record)
        if self.rollouts.is_async:
            self.staleness.observe(record)

    def on_train_end(self, args, state, control, **kwargs):
        self.trackers.close()

    def _append(self, record: dict[str, Any]) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / METRICS_FILE, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())  # a kill right after must not lose a logged step

    @staticmethod
    def _progress_line(r: dict[str, Any], args) -> str:
        def f(key, fmt="{:.3f}"):
            v = r.get(key)
            return "-" if v is None else fmt.format(v)

        return (f"[train] step {r['step']}/{args.max_steps} reward {f('reward')} "
                f"tool_calls/ep {f('tools/call_frequency', '{:.2f}')} tool_fail {f('tools/failure_frequency', '{:.2f}')} "
                f"loss {f('loss', '{:.4f}')} step {f('time/step_s', '{:.2f}')}s "
                f"(gen {f('time/generation_s', '{:.2f}')} env {f('time/env_s', '{:.2f}')} "
                f"train {f('time/training_s', '{:.2f}')})"
                # async: how far behind the trainer the trained samples were generated (trainer.core.async_metrics)
                + (f" lag p50 {f('async/staleness_p50', '{:.0f}')} max {f('async/staleness_max', '{:.0f}')}"
                   f" queue {f('async/queue_depth', '{:.0f}')}" if r.get("rollouts") == "async" else "")
                # vLLM modes: how far vLLM's sampling is from the trainer's policy (contract.sampling_health)
                + (f" is_ratio {f(sampling_health.RATIO_MEAN)} masked {f(sampling_health.MASKED_FRACTION, '{:.0%}')}"
                   if sampling_health.has_figures(r) else "")
                # a judge on: what it cost this step (trainer.judge.costs), beside the step's other timings
                + (f" judge {f('judge/seconds', '{:.2f}')}s {f('judge/calls', '{:.0f}')} calls "
                   f"{f('judge/tokens', '{:.0f}')} tok {f('judge/cache_hits', '{:.0f}')} cached "
                   f"{f('judge/failures', '{:.0f}')} failed" if "judge/calls" in r else ""))
