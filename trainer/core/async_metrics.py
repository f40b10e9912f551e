"""What an async run logs, in a sync run's words (ROLLOUTS=async; standard library only).

TRL's `AsyncGRPOTrainer` (trl 1.16) logs its own key set. Most keys mean what the sync `GRPOTrainer`'s keys of the
same name mean (reward, reward_std, tools/*, completions/*, kl, entropy, clip_ratio/*, loss); a few say the same
thing under another name, and the step-time split is measured by other clocks. `record(logs)` turns one async `logs`
dict into the metrics.jsonl record a sync run writes, so metrics.jsonl, every tracker (trainer.core.trackers) and
`make report` read both modes the same way, plus what only an async run has:

    async/staleness_p50, _p90, _max     lag of the samples the trainer took from the queue to train in the logging
                                        window (TRL's dataloader fetches one batch ahead: step 1 counts two): how
                                        many weight updates (policy versions) behind the trainer they were generated
    async/samples_at_lag/<k>            how many trained samples had lag k (k = 0 .. MAX_STALENESS): the histogram
    async/dropped_stale                 samples dropped because they lagged more than MAX_STALENESS
    async/queue_depth                   scored samples waiting in the rollout queue when the trainer took one
    async/vllm_paused_s                 seconds vLLM stood paused per weight sync (pause returned -> resume returned)
    async/rollout_wait_s                seconds the trainer waited on the rollout queue in the step
    frac_reward_zero_std                as in a sync run (TRL's key there): the share of groups whose completions all
                                        scored alike, here of those the worker scored in the logging window
    rollout/infra_failures              episodes the env side ended (trainer.rollouts.infra_failures) among those the
                                        worker scored in the logging window; their samples are never trained

Time split: the same time/* keys as a sync step (sync: generation / env / scoring / training / weight_sync, one
after another, parts of time/step_s). In an async run generation, env calls and scoring overlap training in the
rollout worker, so only what the trainer waited for is on its clock: time/generation_s = the wait on the rollout
queue (0 when generation keeps up), time/training_s = forward + backward + optimizer, time/weight_sync_s = the push
to vLLM, time/step_s = wall time between step ends. time/env_s and time/scoring_s are the worker's seconds, per
trainer step: env calls (resets, each rollout's rounds of tool calls, env rewards; the sync binding's clock) and
reward scoring of the episodes the worker finished in the logging window, summed over episodes, divided by the
window's steps. Episodes run side by side and beside training, so they are not parts of time/step_s and may exceed
it: read them against each other and against time/generation_s (the worker behind: the larger one is why).

Per env: env/<env>/reward_mean, episode_length and tool_failure_frequency describe the episodes the step trained, as
reward does and as a sync step's do: the worker stamps each sample with its episode's figures (`with_episode_figures`),
so they reach the trainer with the sample and TRL averages them over the trained samples. (Sent apart, on TRL's
metrics queue, they described the episodes the worker finished in the logging window: a step whose window had none,
or whose window's push was still in the queue's feeder thread as the trainer logged, wrote no reward/<env>.)
env/<env>/episodes counts the episodes of that env the worker finished in the window (`episode_counts`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

# TRL async keys the stack shows under its async/ names (the rest keep TRL's name, as a sync run's do).
RENAMED = {
    "perf/rollout_wait_s": "async/rollout_wait_s",
    "sample/dropped_stale_total": "async/dropped_stale",
    "sample/rollout_queue_size": "async/queue_depth",
}
STALENESS_RAW = "sample/staleness_mean"  # TRL appends one value per trained sample to its sink under this key
STALENESS_KEYS = ("async/staleness_p50", "async/staleness_p90", "async/staleness_max")
LAG_PREFIX = "async/samples_at_lag/"
EPISODES_SUFFIX = "/episodes_total"  # TRL sums a key whose last word is `total` (trl _reduce_metric)
FAILURES_SUFFIX = "/tool_failures_per_episode"  # per sample (with_episode_figures); record() makes the rate
INFRA_TOTAL = "rollout/infra_failures_total"  # episodes the env side ended (trainer.rollouts.infra_failures), summed
INFRA_SUFFIX = "/infra_failures_total"  # env/<env>/infra_failures_total: the same, per env
ENV_SECONDS = "rollout/env_s_total"  # the worker's env seconds since its last push (summed: -> time/env_s)
SCORING_SECONDS = "rollout/scoring_s_total"  # its reward-scoring seconds likewise (-> time/scoring_s)


TOOL_KEYS = ("tools/call_frequency", "tools/failure_frequency")  # TRL stamps them per sample, per group


def with_tool_metrics(samples: list) -> list:
    """TRL's rollout worker stamps tools/call_frequency and tools/failure_frequency on a group's samples only when
    the group made at least one tool call; a group that made none carries neither key. TRL averages each key over
    the samples that carry it, so those groups were left out of the step's tool-call figures (a step of such groups
    alone logged none: with a fixed sample count per step, steps of the untrained model lost the keys; packed by
    token budget, the figure overstated calls per episode). Their true values are 0 calls and 0 failures: stamped
    here, on the samples of `_score_group`, so every trained sample counts."""
    for sample in samples:
        for key in TOOL_KEYS:
            sample.metrics.setdefault(key, 0.0)
    return samples


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list: a lag that some trained sample really had."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def staleness_figures(lags: Iterable[float], max_staleness: int) -> dict[str, float]:
    """Percentiles and histogram of the lags of one logging window's trained samples (empty window: {})."""
    lags = [v for v in (_number(x) for x in lags) if v is not None]
    if not lags:
        return {}
    out = {"async/staleness_p50": percentile(lags, 50), "async/staleness_p90": percentile(lags, 90),
           "async/staleness_max": max(lags)}
    for k in range(max_staleness + 1):  # a fixed set of keys: every chart has every bar, 0 included
        out[f"{LAG_PREFIX}{k}"] = float(sum(1 for v in lags if round(v) == k))
    return out


def episode_counts(episodes: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    """The env binding's episodes (trainer.core.metrics.RolloutStats.drain) as TRL counters: env/<env>/episodes_total,
    summed by TRL over a logging window."""
    return {f"env/{env}{EPISODES_SUFFIX}": float(len(eps)) for env, eps in sorted(episodes.items()) if eps}


def with_episode_figures(samples: list, completions: list, figures: list) -> list:
    """Stamp each sample with its episode's per-env figures: `figures[i]` is (env, env reward, tool calls, failed
    calls) of `completions[i]`'s episode, or None (no env reward: an episode the env side ended, a reward-less env).
    TRL averages a per-sample key over the samples that carry it, so the step gets the mean reward and calls of the
    episodes it trained; failures per episode over calls per episode is their pooled failure rate (`record`)."""
    index = {id(completion): i for i, completion in enumerate(completions)}
    for sample in samples:
        i = index.get(id(sample.completion))
        figure = figures[i] if i is not None else None
        if figure is None:
            continue
        env, reward, calls, failures = figure
        sample.metrics[f"env/{env}/reward_mean"] = float(reward)
        sample.metrics[f"env/{env}/episode_length"] = float(calls)
        sample.metrics[f"env/{env}{FAILURES_SUFFIX}"] = float(failures)
    return samples


def time_split(logs: dict[str, Any], measured_step_s: float | None, steps: int = 1) -> dict[str, float]:
    """The step-time keys of an async step (see the module docstring). `measured_step_s`: the callback's own clock
    (on_step_begin -> on_step_end, which starts after the batch was taken), used for the first step, which TRL gives
    no wall time. `steps`: the trainer steps in the logging window (the worker's seconds are per step)."""
    wait = _number(logs.get("perf/rollout_wait_s"))
    fwd_bwd, optimizer = _number(logs.get("perf/fwd_bwd_s")), _number(logs.get("perf/optimizer_s"))
    step = _number(logs.get("perf/step_s"))
    if step is None and measured_step_s is not None:
        step = measured_step_s + (wait or 0.0)
    out: dict[str, float] = {}
    if step is not None:
        out["time/step_s"] = step
    if wait is not None:
        out["time/generation_s"] = wait
    if fwd_bwd is not None:
        out["time/training_s"] = fwd_bwd + (optimizer or 0.0)
    for raw, key in ((ENV_SECONDS, "time/env_s"), (SCORING_SECONDS, "time/scoring_s")):
        out[key] = (_number(logs.get(raw)) or 0.0) / max(1, steps)  # no push in the window: none spent
    sync = _number(logs.get("perf/weight_sync_s"))
    if sync is not None:
        out["time/weight_sync_s"] = sync
    return out


def record(logs: dict[str, Any]) -> dict[str, Any]:
    """One async `logs` dict as the sync trainer's keys (+ async/...); everything else TRL logs is kept as it is."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if key in (ENV_SECONDS, SCORING_SECONDS):
            continue  # time_split's, as time/env_s and time/scoring_s
        if key in RENAMED:
            out[RENAMED[key]] = value
        elif key.startswith("rewards/") and key.count("/") == 1:
            out[f"{key}/mean"] = value  # async: rewards/<func>, per sample; sync: rewards/<func>/mean
        elif key.startswith("env/") and key.endswith(EPISODES_SUFFIX):
            out[key[: -len(EPISODES_SUFFIX)] + "/episodes"] = value
        elif key.endswith(INFRA_SUFFIX):  # rollout/ and env/<env>/: the sync trainer's names
            out[key[: -len(INFRA_SUFFIX)] + "/infra_failures"] = value
        elif key.startswith("judge/") and key.endswith("_total"):  # the judge's figures (trainer.judge.costs)
            out[key[: -len("_total")]] = value
        else:
            out[key] = value
    for key in [k for k in out if k.startswith("env/") and k.endswith(FAILURES_SUFFIX)]:
        env = key[: -len(FAILURES_SUFFIX)]
        failures, calls = _number(out.pop(key)), _number(out.get(f"{env}/episode_length"))
        if failures is not None and calls is not None:  # pooled, as the sync trainer's; no call: 0, as it writes
            out[f"{env}/tool_failure_frequency"] = failures / calls if calls else 0.0
    sync, pause = _number(logs.get("perf/weight_sync_s")), _number(logs.get("perf/weight_sync_pause_s"))
    if sync is not None and pause is not None:
        # TRL's sync: t0, pause() returns (pause_s), barrier, transfer, barrier, resume() returns (weight_sync_s):
        # vLLM holds its requests from pause's return to resume's. Both are means over the window's syncs.
        out["async/vllm_paused_s"] = max(0.0, sync - pause)
    return out
