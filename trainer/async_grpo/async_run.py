"""What an async run (ROLLOUTS=async) keeps for after the run, plugged into TRL's AsyncGRPOTrainer.

Two pieces, one per process of TRL's async design:
  * `AfterRun`, a mixin for the trainer subclass (`class X(AfterRun, AsyncGRPOTrainer)`), in the trainer process:
    the lag percentiles and histogram of the samples a step trained (from TRL's per-sample values before it
    averages them: trainer.core.async_metrics), the traces the rollout worker wrote handed to the trackers' tables, and
    the smoke's stages (rendezvous, first weight sync). `configure_traces(run_dir, every, samples, trackers)` has the
    sync trainer's signature, so trainer.train calls it the same way for both.
  * `TracedRollouts`, a mixin for TRL's rollout loop class in the spawned worker process (where the env sessions
    live; `TracedRolloutLoop` is TRL's loop with it, `use_traced_loop` puts it in the worker): every
    scored group's samples carry their episodes' env reward, calls and failures (env/<env>/..., averaged by TRL over
    the samples a step trains) and the group sends the env binding's episode counts (trainer.core.metrics.STATS of
    that process) to the trainer as TRL counters (env/<env>/episodes_total), an episode the env side ended is counted
    (rollout/infra_failures) and its samples are dropped before the queue (trainer.rollouts.infra_failures), a group whose completions all scored alike is
    counted (frac_reward_zero_std) and, with ZERO_STD_GROUPS=drop, dropped the same way (trainer.rollouts.zero_variance),
    and every TRACE_EVERY policy versions TRACE_SAMPLES rollouts go to rollouts.jsonl (trainer.rollouts.traces' schema, plus
    `policy_version`; `step` is policy_version + 1, the step a sync run would have traced these rollouts at).

PINNED to trl 1.16.0 (trl/experimental/async_grpo; trainer/core/trl_privates.py lists each); re-check on a TRL upgrade:
  * async_grpo_trainer.py: `AsyncGRPOTrainer.log` reduces `self._metrics["train"]`, where `RolloutQueueDataset`
    appends one `sample/staleness_mean` value per trained sample; `_sync_weight` is the method the weight-sync
    callback calls (through `self`); `_TrainBeginCallback` calls `self.weight_transfer.init_weight_transfer()`.
  * async_rollout_worker.py: `AsyncRolloutWorker._loop_cls` and `._loop_kwargs` (the child's loop class and its
    kwargs, read by `start()`); `_AsyncRolloutLoop._generate_one(prompt, tool_dict=, tools=, group_id=)` returns the
    completion list first; `_score_group(group)` returns `RolloutSample`s whose `completion` is the group's list
    object; `_push_metrics(values)` sends floats and (numerator, denominator) rates to the trainer's `log()`.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # as trainer.async_grpo.async_trainer: ROLLOUTS=async is chosen on purpose
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop  # noqa: E402

from contract import stages
from envs.core import untrusted
from envs.core.tool import detached, trace_of
from trainer.gpu import trl_hooks
from trainer.rollouts import infra_failures, traces, zero_variance
from trainer.core import async_metrics


class AfterRun:
    """Mixin for the async trainer subclass; see the module docstring."""

    _trace_dir: Path | None = None
    _trace_trackers = None
    _trace_offset = 0

    def configure_traces(self, run_dir, every: int, samples: int, trackers=None) -> None:
        """Traces by the rollout worker (rank 0 owns it), read back here for the trackers' tables."""
        self._trace_dir, self._trace_trackers = Path(run_dir), trackers
        trace_file = self._trace_dir / traces.ROLLOUTS_FILE
        self._trace_offset = trace_file.stat().st_size if trace_file.exists() else 0  # earlier sessions' rows
        worker = getattr(self, "rollout_worker", None)
        if isinstance(worker, AsyncRolloutWorker):  # TRL's worker (a custom one traces itself, or not at all)
            use_traced_loop(worker, trace_dir=str(run_dir), trace_every=every, trace_samples=samples)
        transfer = getattr(self, "weight_transfer", None)
        if transfer is not None and not getattr(transfer.init_weight_transfer, "_stage_timed", False):
            transfer.init_weight_transfer = _timed_init(transfer)

    def configure_weights(self, passed: list[str], judge_weight: float, env_weight: float) -> None:
        """A judge is on (trainer.judge): the rollout worker weighs the reward columns and leaves failed judge calls
        out (TracedRollouts._score_group)."""
        worker = getattr(self, "rollout_worker", None)
        if isinstance(worker, AsyncRolloutWorker):
            use_traced_loop(worker, reward_weights=(tuple(passed), float(judge_weight), float(env_weight)))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.accelerator.is_main_process and self.model.training:
            # One value per trained sample, until TRL reduces them to a mean and a max below.
            lags = self._metrics["train"].get(async_metrics.STALENESS_RAW) or []
            logs.update(async_metrics.staleness_figures(lags, self.args.max_staleness))
            self._forward_traces()
        super().log(logs, start_time)

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.accelerator.is_main_process:  # this batch came from the vLLM the last push went into (a restarted one
            trl_hooks.check_served_weights()  # serves the weights it loaded at start): else exit 77 before it trains
        return super().training_step(model, inputs, num_items_in_batch)

    def _sync_weight(self) -> None:
        start = time.perf_counter()
        main = self.accelerator.is_main_process
        if main:  # samples since the last push came from the process it went into, or the run stops (exit 77)
            trl_hooks.check_served_weights()
        super()._sync_weight()
        if main:
            trl_hooks.record_push(self.args.vllm_server_base_url)
        # TRL also syncs once before the first step (unchanged weights); the smoke's stage is the first trained push.
        if self.state.global_step >= 1:
            stages.mark("first_weight_sync", time.perf_counter() - start,
                        "async: trained adapter loaded by /v1/load_lora_adapter" if getattr(self, "_lora_sync", False)
                        else f"async: trained weights pushed by {type(self.weight_transfer).__name__}")

    def _forward_traces(self) -> None:
        """The complete rows the rollout worker appended since the last call, to the trackers' tables."""
        if self._trace_trackers is None or self._trace_dir is None:
            return
        path = self._trace_dir / traces.ROLLOUTS_FILE
        if not path.exists():
            return
        with path.open("rb") as fh:
            fh.seek(self._trace_offset)
            chunk = fh.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # the worker may be half-way through a row
        self._trace_offset += len(complete)
        rows = [r for r in traces.read_lines(complete.decode("utf-8", "replace"))]
        for step in sorted({r["step"] for r in rows}):
            self._trace_trackers.log_rollouts(step, [r for r in rows if r["step"] == step])


def _timed_init(transfer):
    original = transfer.init_weight_transfer

    def init_weight_transfer() -> None:
        start = time.perf_counter()
        original()
        stages.mark("rendezvous", time.perf_counter() - start,
                    f"async: weight transfer set up ({type(transfer).__name__}, trainer = rank 0)")

    init_weight_transfer._stage_timed = True  # type: ignore[attr-defined]
    return init_weight_transfer


class TracedRollouts:
    """Mixin for TRL's rollout loop class (it runs in the spawned worker): the env episode counts and the traces; see
    the module docstring. The worker pickles its loop class by name, so a stack loop class that changes other parts
    of TRL's loop inherits this first, at module level: `class StackRolloutLoop(TracedRollouts, _AsyncRolloutLoop)`."""

    def __init__(self, *, trace_dir: str | None = None, trace_every: int = 0, trace_samples: int = 0,
                 zero_std_groups: str = "keep", zero_std_resample_max: float = 1.0, step_samples: int = 0,
                 reward_weights: tuple | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._reward_weights = reward_weights  # (passed names, JUDGE_WEIGHT, ENV_REWARD_WEIGHT): a judge is on
        # #63: this spawned process starts with none of the tokenizer's own tokens registered (`<eos>` passed)
        untrusted.register_tokenizer(self.tokenizer)
        self.zero_std_groups = zero_std_groups  # ZERO_STD_GROUPS (trainer.rollouts.zero_variance)
        self.step_samples = step_samples or self.num_generations  # samples one optimizer step trains (all ranks)
        self._zero_std = zero_variance.WorkerResample(zero_std_groups, zero_std_resample_max,
                                                      max(1, self.step_samples // self.num_generations))
        self._trace_dir = Path(trace_dir) if trace_dir else None
        self._trace_every, self._trace_samples = trace_every, trace_samples
        self._traced_rows: dict[int, int] = {}  # step -> rollouts traced of its policy version
        self._episode_of: dict[int, SimpleNamespace] = {}  # id(completion list) -> its env episode, until scored

    def run(self) -> None:
        """TRL's worker loop, then every env session this process opened closed, however the loop ended (a stop, an
        error; in-flight rollouts' envs included, which TRL's pool never gets back)."""
        from trainer.core import hang_dump
        from trainer.rollouts.envs_binding import sessions_closed

        hang_dump.install()  # this is the worker's own (spawned) process
        with sessions_closed("rollout worker"):
            super().run()

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        result = await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)
        env = next((m.__self__ for m in tool_dict.values() if hasattr(m, "__self__")), None)
        if env is not None:  # the env goes back to the pool after its reward; its Trace object stays this episode's
            self._episode_of[id(result[0])] = detached(env)
        return result

    async def _score_group(self, group):
        episodes = [self._episode_of.pop(id(c), None) for c in group.completions]
        ended = infra_failures.ended_by_env(episodes)
        # the stack's reward functions say None for them, as in sync mode (they read `environments`); the judge reads
        # every episode's env, task and trace
        if any(ended) or self._reward_weights is not None:
            group.reward_kwargs["environments"] = episodes
        start = time.perf_counter()
        samples = async_metrics.with_tool_metrics(await super()._score_group(group))
        if self._reward_weights is not None:  # weighed, failed judge calls out of the baseline (trainer.judge.leave_out)
            from trainer.judge import leave_out

            judge_failed = leave_out.failed_rows(episodes)
            passed, judge_weight, env_weight = self._reward_weights
            leave_out.reweigh(samples, group.completions, self.reward_func_names,
                              leave_out.weights_for(self.reward_func_names, passed, judge_weight, env_weight),
                              judge_failed)
            ended = [e or j for e, j in zip(ended, judge_failed)]
        async_metrics.with_episode_figures(samples, group.completions, [episode_figures(e) for e in episodes])
        scoring_s = time.perf_counter() - start
        rewards = zero_variance.group_rewards(group.completions, samples)
        if hasattr(self, "scored_rewards"):  # AdmittedRollouts' generated figures (trainer.async_grpo.admission)
            self.scored_rewards[group.group_id] = rewards
        flat = zero_variance.is_flat(rewards)
        self._push_episode_counts(sum(infra_failures.ended_by_env(episodes)), flat, scoring_s)
        try:
            self._trace(group, samples, episodes)
        except OSError as exc:  # a full disk must not stop generation; the trainer's checkpoints will say so
            print(f"[train] rollout traces not written: {exc}", flush=True)
        left_out = self._zero_std.leave_out(flat)
        if left_out:  # never trained: out of the normaliser, as an env-ended episode
            ended = [True] * len(group.completions)
        kept = infra_failures.leave_out_samples(group.completions, samples, ended)
        if self.zero_std_groups != "keep":  # extra groups generated per group trained (a rate over the window)
            self._rates[zero_variance.EXTRA_GENERATION][0] += float(left_out)
            self._rates[zero_variance.EXTRA_GENERATION][1] += float(bool(kept))
            self._zero_std.trained += bool(kept)
        return kept

    async def _execute_tool_calls(self, tool_calls, tool_dict):
        """A rollout's round of tool calls, its wall time added to the env seconds (as the sync loop adds a round's)."""
        from trainer.core.metrics import STATS

        start = time.perf_counter()
        try:
            return await super()._execute_tool_calls(tool_calls, tool_dict)
        finally:
            STATS.add_time("env", time.perf_counter() - start)

    def _push_episode_counts(self, infra: int = 0, flat: bool = False, scoring_s: float = 0.0) -> None:
        from trainer.core.metrics import STATS  # this process's: the env binding records into it here

        timers, episodes = STATS.drain()
        rates: dict[str, Any] = async_metrics.episode_counts(episodes)
        # the step record's time/env_s and time/scoring_s (trainer.core.async_metrics.time_split): summed by TRL
        rates[async_metrics.ENV_SECONDS] = timers.get("env", 0.0)
        rates[async_metrics.SCORING_SECONDS] = scoring_s
        # every group pushes the count, 0 included: each step record has rollout/infra_failures, as a sync one does
        rates[async_metrics.INFRA_TOTAL] = float(infra)
        rates[zero_variance.METRIC] = (float(flat), 1.0)  # a rate: the share of the groups scored in the window
        rates.update({f"env/{env}{async_metrics.INFRA_SUFFIX}": float(n)
                      for env, n in sorted(STATS.drain_infra_failures().items())})
        from trainer.judge import costs

        rates.update(costs.as_counters(costs.COSTS.drain()))  # judge/<figure>_total: the step record's judge/<figure>
        self._push_metrics(rates)

    def _trace(self, group, samples, episodes) -> None:
        """Whole groups of the first and every TRACE_EVERY-th policy version until TRACE_SAMPLES rollouts of it are traced (the
        default, one group's worth: one group), as a sync step traces TRACE_SAMPLES rollouts of its batch."""
        step = group.model_version + 1
        if not self._trace_dir or not traces.traced(step, self._trace_every):
            return
        wanted = self._trace_samples or len(group.completions)
        left = wanted - self._traced_rows.get(step, 0)
        if left <= 0:
            return
        first = {}
        for sample in samples:  # a conversation may fork into several training rows: one trace per conversation
            first.setdefault(id(sample.completion), sample)
        per_func, total = [], []
        for completion in group.completions:
            metrics = getattr(first.get(id(completion)), "metrics", {})
            per_func.append({k[len("rewards/"):]: v for k, v in metrics.items() if k.startswith("rewards/")})
            total.append(metrics.get("reward", math.nan))
        rows = traces.rows(step, group.prompts, group.completions, episodes, per_func, total)[:left]
        for row in rows:
            row["policy_version"] = group.model_version
        self._traced_rows[step] = self._traced_rows.get(step, 0) + len(rows)
        traces.append(self._trace_dir, rows)


def episode_figures(episode: Any) -> tuple[str, float, int, int] | None:
    """(env, env reward, tool calls, failed calls) of a scored episode (`detached`'s snapshot: its trace is the
    episode's), or None where it has no env reward (the env side ended it; a tool class with no trace)."""
    trace = trace_of(episode)
    if trace is None or trace.env_reward is None or trace.infra_failure is not None:
        return None
    return trace.env, trace.env_reward, trace.call_count, trace.failure_count


class TracedRolloutLoop(TracedRollouts, _AsyncRolloutLoop):
    """TRL's own rollout loop with the traces: what the worker runs when the trainer leaves TRL's loop in place."""


def use_traced_loop(worker: AsyncRolloutWorker, **trace_kwargs: Any) -> None:
    """Have TRL's rollout worker run a loop class with TracedRollouts and pass it its settings."""
    loop_cls = worker._loop_cls
    if not issubclass(loop_cls, TracedRollouts):
        if loop_cls is not _AsyncRolloutLoop:
            raise TypeError(f"the rollout worker runs {loop_cls.__qualname__}, which does not inherit "
                            "trainer.async_grpo.async_run.TracedRollouts: declare it as `class "
                            f"{loop_cls.__name__}(TracedRollouts, ...)` (the worker pickles the class by name, so it "
                            "cannot be composed at run time)")
        worker._loop_cls = TracedRolloutLoop
    worker._loop_kwargs.update(trace_kwargs)


def drain_on_stop(worker: AsyncRolloutWorker) -> None:
    """TRL's `stop()` sets the stop event, joins the worker process for 15 s, then terminates it. A worker that has
    put samples or metrics the trainer will not read cannot exit before its queues' feeder threads have written them
    into their pipes (multiprocessing joins those threads at exit), and no one reads the pipes once training is over:
    every async run ended 15 s late, with "Child did not exit within 15s; terminating". Reading both queues while the
    worker stops lets it exit at once, by itself; what is read is dropped (the run is over; a resume starts the worker
    from TRL's rollout_state.json)."""
    import queue
    import threading

    original = worker.stop

    def drain(stopped: threading.Event) -> None:
        # Each queue read until empty before a short wait: a timed wait on an empty queue between two reads of the
        # other held the reads to ~20 samples/s, slower than a worker's backlog (hundreds) drains in 15 s.
        while not stopped.is_set():
            read = False
            for q in (worker.rollout_buffer, worker.metrics_queue):
                try:
                    while True:
                        q.get_nowait()
                        read = True
                except queue.Empty:
                    continue
                except (OSError, ValueError, EOFError):  # closed: nothing more will come
                    return
            if not read:
                stopped.wait(0.02)

    def stop() -> None:
        stopped = threading.Event()
        reader = threading.Thread(target=drain, args=(stopped,), name="grpo-stop-drain", daemon=True)
        reader.start()
        try:
            original()
        finally:
            stopped.set()
            reader.join(timeout=5)

    worker.stop = stop


def stop_on_env_or_vllm_down(worker: AsyncRolloutWorker, vllm_url: str | None = None,
                             no_sample_s: float | None = None) -> None:
    """TRL's health check of its rollout worker (called by the trainer every 5 s while its sample queue is empty), made
    to say what stopped the worker in one line: a dead env (trainer.rollouts.infra_failures.EnvDown, raised by the env
    binding in the worker) stops the run as in sync mode (trainer.train: exit 6), a worker process that died without a
    word (killed, out of memory) is noticed at once, not after `heartbeat_stale_after_s` (300 s), and a vLLM that is
    gone or restarted stops it at once (trainer.gpu.trl_hooks.check_vllm_there: exit 77, `make train` restarts vLLM
    and resumes), where TRL's worker would retry its generations for minutes and the run print nothing.

    With `no_sample_s` (GENERATION_TIMEOUT_S), a wait that long for one sample is not waited out: TRL's worker retries a
    generation that times out up to 90 times, so a vLLM that takes requests and answers none (left paused, its engine
    stuck) held the run silent for hours. vLLM at `vllm_url` paused, or holding requests with no token made during the
    wait: VLLMGone (exit 77: restarted, resumed). vLLM idle: the worker is stuck, RuntimeError saying so. vLLM still
    making tokens (very long episodes): the wait goes on."""
    import queue

    from trainer.gpu.server import VLLMGone, activity

    original = worker.check_health
    wait: dict[str, Any] = {}  # this wait for a sample: when it began, vLLM's token count then

    buffer = getattr(worker, "rollout_buffer", None)
    if no_sample_s and vllm_url and buffer is not None:
        take = buffer.get

        def get_sample(*args: Any, **kwargs: Any) -> Any:
            sample = take(*args, **kwargs)
            wait.clear()  # a sample came: the next empty poll starts a new wait
            return sample

        buffer.get = get_sample  # the instance's own (multiprocessing pickles a Queue without it)

    def check_waited() -> None:
        now = time.monotonic()
        if not wait:
            wait.update(since=now, tokens=activity(vllm_url, paused=False).get("tokens"))  # each wait: one request
            return
        waited = now - wait["since"]
        if waited < no_sample_s:
            return
        seen = activity(vllm_url)
        held = seen.get("running", 0.0) + seen.get("waiting", 0.0)
        tokens = seen.get("tokens")
        if not seen:
            raise VLLMGone(f"it answered neither /is_paused nor /metrics while the trainer waited {waited:.0f} s for a "
                           "sample")
        if seen.get("paused"):
            raise VLLMGone(f"it stayed paused while the trainer waited {waited:.0f} s for a sample (a weight sync left "
                           "unfinished?)")
        if tokens is not None and tokens != wait["tokens"]:
            print(f"[async] no sample for {waited:.0f} s, but vLLM is generating ({tokens - (wait['tokens'] or 0):.0f} "
                  "tokens meanwhile): waiting on (long episodes?)", flush=True)
            wait.update(since=now, tokens=tokens)
            return
        if held:
            raise VLLMGone(f"it holds {held:.0f} request(s) and made no token while the trainer waited {waited:.0f} s "
                           "for a sample (its engine stuck)")
        raise RuntimeError(f"no sample reached the trainer in {waited:.0f} s (GENERATION_TIMEOUT_S) and vLLM at "
                           f"{vllm_url} holds no request: the rollout worker is stuck (its stacks: trainer.core."
                           "hang_dump); resume with `make train`")

    def check_health(stale_after_s: float) -> None:
        if worker._failed_event.is_set():
            try:
                info = worker._exception_info_queue.get_nowait()
            except queue.Empty:
                info = None
            if info is not None and info[0] == infra_failures.EnvDown.__name__:
                raise infra_failures.EnvDown(info[1])
            from trainer.judge.costs import JudgeDown

            if info is not None and info[0] == JudgeDown.__name__:  # the judge's down watch (trainer.judge.costs)
                raise JudgeDown(info[1])
            if info is not None:
                worker._exception_info_queue.put_nowait(info)  # TRL's check below reads and chains it
        else:
            process = worker._process
            if process is not None and not process.is_alive():
                raise RuntimeError(f"the rollout worker process (pid {process.pid}) exited with code "
                                   f"{process.exitcode} without a reason (killed? out of memory?); its env sessions "
                                   "and queued samples are gone: check memory, then resume")
        trl_hooks.check_vllm_there()
        if no_sample_s and vllm_url:
            check_waited()
        original(stale_after_s)

    worker.check_health = check_health
