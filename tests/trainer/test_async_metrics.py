"""ROLLOUTS=async after the run (trainer.core.async_metrics, the async path of trainer.core.metrics.MetricsCallback, the
smoke's async stages): an async step record carries every tracker key a sync step record does, plus the staleness
figures, and TRL's own reduction of what the rollout worker sends gives the sync trainer's per-env figures."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from contract.config import AsyncRollouts, CpuMode, GpuMode, rollouts_variant
from tools.commands import smoke
from trainer.core import async_metrics, trackers
from contract import sampling_health, stages
from trainer.core.metrics import MetricsCallback, RolloutStats, read_metrics, summarize_episodes

EPISODES = {"echo": [{"reward": 1.0, "tool_calls": 1, "tool_failures": 0},
                     {"reward": 0.2, "tool_calls": 2, "tool_failures": 1},
                     {"reward": 0.0, "tool_calls": 0, "tool_failures": 0}],
            "wordle": [{"reward": 0.5, "tool_calls": 0, "tool_failures": 0}]}


def reduce_like_trl(pushes: list[dict]) -> dict[str, float]:
    """TRL's AsyncGRPOTrainer.log: every pushed item appended to the sink, then each key reduced (_reduce_metric)."""
    sink = defaultdict(list)
    for item in pushes:
        for key, value in item.items():
            sink[key].append(value)
    return {key: _reduce_metric(key, values) for key, values in sink.items()}


def collate_like_trl(micro_batches: list[list[dict]]) -> list[dict]:
    """TRL's collator (async_grpo_trainer.py, 1.16): per micro-batch, each per-sample key's mean over the samples
    that carry it, appended to the step's metrics; returned here as one push per micro-batch."""
    pushes = []
    for batch in micro_batches:
        keys = dict.fromkeys(k for metrics in batch for k in metrics)
        pushes.append({k: sum(m[k] for m in batch if k in m) / sum(1 for m in batch if k in m) for k in keys})
    return pushes


def test_per_env_figures_ride_with_the_samples_and_give_the_sync_figures_of_the_trained_episodes():
    """The figures travel on each sample (with_episode_figures), so a step's record has them whenever it trained an
    episode of that env, whatever the worker's metrics queue delivered by then (a clean-clone run's resumed step
    logged reward but no reward/echo when they were sent apart); the counts stay the worker's (episode_counts)."""
    completions = [[{"role": "assistant", "content": str(i)}] for i in range(5)]
    figures = [("echo", e["reward"], e["tool_calls"], e["tool_failures"]) for e in EPISODES["echo"]]
    figures += [("wordle", EPISODES["wordle"][0]["reward"], 0, 0), None]  # the last: the env side ended it
    samples = [SimpleNamespace(completion=c, metrics={"reward": 0.0}) for c in completions]
    async_metrics.with_episode_figures(samples, completions, figures)
    assert samples[-1].metrics == {"reward": 0.0}
    pushes = collate_like_trl([[s.metrics for s in samples]])
    pushes.append(async_metrics.episode_counts(EPISODES))  # the worker's, on TRL's metrics queue
    record = async_metrics.record(reduce_like_trl(pushes))
    assert {k: v for k, v in record.items() if k.startswith("env/")} == pytest.approx(summarize_episodes(EPISODES))


def test_staleness_percentiles_and_histogram_of_the_trained_samples():
    lags = [0.0] * 6 + [1.0] * 3 + [3.0]
    figures = async_metrics.staleness_figures(lags, max_staleness=4)
    assert figures["async/staleness_p50"] == 0 and figures["async/staleness_p90"] == 1
    assert figures["async/staleness_max"] == 3
    assert [figures[f"async/samples_at_lag/{k}"] for k in range(5)] == [6, 3, 0, 1, 0]
    assert async_metrics.staleness_figures([], 4) == {}


ASYNC_LOGS = {  # the keys TRL 1.16's AsyncGRPOTrainer logs for one step of a tool-using env, reduced
    "loss": 0.01, "grad_norm": 0.3, "learning_rate": 1e-5, "reward": 0.5, "reward_std": 0.2,
    "rewards/EchoTool": 0.5, "tools/call_frequency": 1.5, "tools/failure_frequency": 0.25,
    "completions/mean_length": 30.0, "completions/max_length": 40.0, "completions/min_length": 20.0,
    "completions/clipped_ratio": 0.0, "kl": 0.001, "entropy": 1.2, "ratio": 1.01, "clip_ratio/region_mean": 0.0,
    "sample/staleness_mean": 0.4, "sample/staleness_max": 1.0, "sample/dropped_stale_total": 2.0,
    "sample/rollout_queue_size": 5.0, "perf/rollout_wait_s": 0.7, "perf/fwd_bwd_s": 1.1, "perf/optimizer_s": 0.1,
    "perf/step_s": 2.5, "perf/weight_sync_s": 0.6, "perf/weight_sync_pause_s": 0.1,
    "env/echo/episodes_total": 3.0, "env/echo/reward_mean": 0.4, "env/echo/episode_length": 1.0,
    "env/echo/tool_failures_per_episode": 0.0,
    "async/staleness_p50": 0.0, "async/staleness_p90": 1.0, "async/staleness_max": 1.0,
    "async/samples_at_lag/0": 5.0, "async/samples_at_lag/1": 3.0,
    "frac_reward_zero_std": 0.25,  # pushed by the stack's worker mixin (trainer.rollouts.zero_variance), as sync logs it
    "rollout/env_s_total": 3.0, "rollout/scoring_s_total": 0.4,  # the worker's env and scoring seconds (async_run)
}
SYNC_LOGS = {  # what the sync GRPOTrainer logs for the same run (trl 1.16 grpo_trainer.py)
    "loss": 0.01, "grad_norm": 0.3, "learning_rate": 1e-5, "reward": 0.5, "reward_std": 0.2,
    "rewards/EchoTool/mean": 0.5, "rewards/EchoTool/std": 0.4, "tools/call_frequency": 1.5,
    "tools/failure_frequency": 0.25, "completions/mean_length": 30.0, "completions/max_length": 40.0,
    "completions/min_length": 20.0, "completions/clipped_ratio": 0.0, "kl": 0.001, "entropy": 1.2,
    "clip_ratio/region_mean": 0.0, "num_tokens": 900.0, "frac_reward_zero_std": 0.0,
}


def state(step):
    return SimpleNamespace(global_step=step, is_world_process_zero=True)


def log_one(tmp_path, logs, rollouts, episodes=None, gpu=True):
    stats, lines = RolloutStats(), []
    cb = MetricsCallback(str(tmp_path), stats, mode=GpuMode() if gpu else CpuMode(), print_fn=lines.append,
                         trackers=trackers.Trackers([], trackers.RunInfo(str(tmp_path), "r", str(tmp_path))),
                         rollouts=rollouts_variant(rollouts))
    cb.on_train_begin(None, state(0), None)
    cb.on_step_begin(None, state(1), None)
    for env, eps in (episodes or {}).items():
        for e in eps:
            stats.add_episode(env, e["reward"], e["tool_calls"], e["tool_failures"])
    stats.add_time("generation", 1.0)
    stats.add_time("generate_and_score", 1.5)
    cb.on_step_end(None, state(1), None)
    cb.on_log(SimpleNamespace(max_steps=10), state(1), None, logs=dict(logs))
    [row] = read_metrics(tmp_path)
    return row, lines


def test_an_async_step_has_every_tracker_key_of_a_sync_step_plus_staleness(tmp_path):
    sync_row, _ = log_one(tmp_path / "sync", SYNC_LOGS, "sync", {"echo": EPISODES["echo"]})
    async_row, lines = log_one(tmp_path / "async", ASYNC_LOGS, "async")
    sync_keys, async_keys = set(trackers.view(sync_row)), set(trackers.view(async_row))
    # TRL's sync-only bookkeeping (token count, a per-function std) is the only difference; the zero-std share (#43)
    # and every time/* key (#47) are in both.
    sync_only = {"trl/num_tokens", "trl/rewards/EchoTool/std"}
    assert sync_keys - async_keys == sync_only
    assert {"reward/echo", "rollout/tool_calls_per_episode/echo", "rollout/episodes/echo", "time/generation_s",
            "time/training_s", "time/weight_sync_s", "time/step_s", "trl/rewards/EchoTool/mean"} <= async_keys
    assert {"async/staleness_p50", "async/staleness_p90", "async/staleness_max", "async/samples_at_lag/0",
            "async/dropped_stale", "async/queue_depth", "async/vllm_paused_s", "async/rollout_wait_s"} <= async_keys
    assert async_row["rollouts"] == "async"
    assert async_row["time/generation_s"] == 0.7 and async_row["time/training_s"] == pytest.approx(1.2)
    assert async_row["time/step_s"] == 2.5 and async_row["time/weight_sync_s"] == 0.6
    assert async_row["async/vllm_paused_s"] == pytest.approx(0.5)  # pause returned -> resume returned
    assert async_row["env/echo/episodes"] == 3 and async_row["env/echo/tool_failure_frequency"] == 0.0
    assert "lag p50 0 max 1 queue 5" in lines[0]


def test_both_modes_step_records_carry_the_same_time_keys(tmp_path):
    sync_row, _ = log_one(tmp_path / "sync", SYNC_LOGS, "sync", {"echo": EPISODES["echo"]})
    async_row, lines = log_one(tmp_path / "async", ASYNC_LOGS, "async")
    quiet = {k: v for k, v in ASYNC_LOGS.items() if k not in (async_metrics.ENV_SECONDS, async_metrics.SCORING_SECONDS)}
    idle_row, _ = log_one(tmp_path / "idle", quiet, "async")  # the worker pushed nothing in the window

    def time_keys(row):
        return {k for k in row if k.startswith("time/")}

    assert time_keys(sync_row) == time_keys(async_row) == time_keys(idle_row) == {
        "time/step_s", "time/generation_s", "time/env_s", "time/scoring_s", "time/training_s", "time/weight_sync_s"}
    # the worker's seconds per trainer step (one step in this window); the raw sums are not kept beside them
    assert async_row["time/env_s"] == 3.0 and async_row["time/scoring_s"] == pytest.approx(0.4)
    assert idle_row["time/env_s"] == 0.0 and idle_row["time/scoring_s"] == 0.0
    assert not {async_metrics.ENV_SECONDS, async_metrics.SCORING_SECONDS} & set(async_row)
    assert " env 3.00 " in lines[0]  # the progress line reads it as in sync mode
    split = async_metrics.time_split(ASYNC_LOGS, None, steps=2)  # logging_steps=2: per step, as sync divides
    assert split["time/env_s"] == 1.5 and split["time/scoring_s"] == pytest.approx(0.2)


def test_the_report_says_an_async_runs_env_and_scoring_seconds_are_beside_the_step(tmp_path):
    from trainer.after.report import summarize

    async_row, _ = log_one(tmp_path / "async", ASYNC_LOGS, "async")
    sync_row, _ = log_one(tmp_path / "sync", SYNC_LOGS, "sync", {"echo": EPISODES["echo"]})
    [async_line] = [ln for ln in summarize([async_row]) if ln.startswith("step time")]
    assert "env 3.00s (rollout worker, overlapped)" in async_line and "training 1.20s," in async_line
    assert "overlapped" not in " ".join(summarize([sync_row]))


def test_the_first_async_step_takes_its_wall_time_from_the_callback_and_the_queue_wait():
    logs = {k: v for k, v in ASYNC_LOGS.items() if k != "perf/step_s"}  # TRL has no previous step end to measure from
    split = async_metrics.time_split(logs, measured_step_s=1.3)
    assert split["time/step_s"] == pytest.approx(2.0)  # the callback's clock starts after the batch was taken


def test_the_smoke_judges_staleness_and_the_async_ratio(capsys):
    stages._seen.clear()
    rows = [dict(ASYNC_LOGS, step=s, **{"async/dropped_stale": 1.0}) for s in (1, 2, 3)]
    staleness = sampling_health.StalenessWatch(stages.mark)
    ratio = sampling_health.Watch(stages.mark, print, ratio_key=sampling_health.ASYNC_RATIO)
    for row in rows:
        staleness.observe(row)
        ratio.observe(row)
    found = stages.parse(capsys.readouterr().out)
    assert found["staleness"]["ok"] is True and "16 samples trained" in found["staleness"]["detail"]
    assert found["importance_sampling"]["ok"] is True and "ratio mean 1.010" in found["importance_sampling"]["detail"]
    assert smoke.smoke_stages(GpuMode(), AsyncRollouts()).index("staleness") == smoke.smoke_stages(GpuMode()).index(
        "first_weight_sync") + 1
    assert "staleness" not in smoke.smoke_stages(GpuMode()) and smoke.smoke_stages(CpuMode(), AsyncRollouts()) == \
        smoke.smoke_stages(CpuMode())


def test_more_dropped_than_trained_fails_the_staleness_stage():
    rows = [{"step": 2, "async/samples_at_lag/0": 2.0, "async/staleness_max": 0.0, "async/dropped_stale": 9.0}]
    ok, detail = sampling_health.staleness_verdict(rows)
    assert ok is False and "MAX_STALENESS" in detail
    assert sampling_health.staleness_verdict([{"step": 2}])[0] is False  # nothing trained: never a pass


def test_the_trainer_mixin_logs_lag_percentiles_of_what_trls_queue_dataset_recorded(tmp_path):
    """trainer.async_grpo.async_run.AfterRun over TRL's real RolloutQueueDataset (which records each trained sample's lag and
    drops the stale ones) and TRL's real AsyncGRPOTrainer.log (which averages them): the lags reach the callbacks as
    percentiles and a histogram, next to TRL's mean. The trainer object is built without its __init__ (no model,
    no vLLM): only what log() reads is set."""
    import queue as queue_module

    import numpy as np
    from transformers.trainer_callback import TrainerState
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer, RolloutQueueDataset
    from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

    from accelerate.state import PartialState

    from trainer.async_grpo.async_run import AfterRun

    PartialState()  # TRL's dataset logs its drops through accelerate's logger

    class Trainer(AfterRun, AsyncGRPOTrainer):
        pass

    sink, seen = defaultdict(list), []
    trainer = object.__new__(Trainer)
    trainer.__dict__.update(
        _metrics={"train": sink, "eval": defaultdict(list)}, model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(is_main_process=True), rollout_worker=None, state=TrainerState(global_step=5),
        args=SimpleNamespace(max_staleness=2, include_num_input_tokens_seen="no"), control=None,
        callback_handler=SimpleNamespace(on_log=lambda args, state, control, logs: seen.append(dict(logs))))
    versions = [5, 5, 4, 5, 3, 1, 4]  # trainer at version 5, MAX_STALENESS 2: the version-1 sample is dropped
    q = queue_module.Queue()
    for i, v in enumerate(versions):
        q.put(RolloutSample(prompt=[], completion=[], input_ids=np.zeros(3, dtype=np.int64),
                            completion_mask=np.ones(3, dtype=np.int64), old_log_probs=np.zeros(3, dtype=np.float32),
                            advantage=0.0, model_version=v, group_id=i, metrics={}))
    dataset = RolloutQueueDataset(q, lambda: 5, lambda s: None, 60, sink, max_staleness=2)
    taken = iter(dataset)
    for _ in range(len(versions) - 1):
        next(taken)
    trainer.log({"loss": 0.1})
    [logs] = seen
    assert logs["sample/staleness_mean"] == pytest.approx(4 / 6) and logs["sample/dropped_stale_total"] == 1
    assert logs["async/staleness_p50"] == 0 and logs["async/staleness_max"] == 2
    assert [logs[f"async/samples_at_lag/{k}"] for k in range(3)] == [3, 2, 1]
