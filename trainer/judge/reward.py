"""TRL's reward function `judge` (TRL logs `rewards/judge/mean`), weighed beside the env's reward (trainer.judge.leave_out).

`judge_reward(setup)` is a functools.partial of the module-level coroutine `judge`: ROLLOUTS=async pickles reward
functions into its spawned rollout worker (as trainer.rollouts.rewards' penalty), and TRL runs a coroutine reward
function after the synchronous ones (sync: the env's `get_reward` column has set the episode's env reward the rubric
sees) on its event loop. A batch's calls (sync: the process's batch; async: the group just finished) run at once,
at most JUDGE_CONCURRENCY in flight per process (a thread pool of that size), each bounded by JUDGE_TIMEOUT_S: a step
waits for the slowest call, not their sum.

Per row: the score in [0, 1]; None for an episode not judged (its env's ENV_<NAME>_JUDGE=0, or the env side ended it)
and for one whose judge call failed. Each judged episode's trace gets `judge` = {score, verdict, rationale, failure,
flagged, cached} (rollouts.jsonl); a failure also marks the row for trainer.judge.leave_out, which takes it out of the
loss and its group's baseline (a None alone would only drop this column: the env's reward would still score the row)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from envs.core.tool import infra_failure_of, trace_of
from trainer.judge import methods, transcript
from trainer.judge.cache import LruCache, key_of
from trainer.judge.client import JudgeFailure, client_for
from trainer.judge.costs import COSTS, DownWatch
from trainer.judge.methods import Verdict
from trainer.judge.setup import JudgeSetup


def judge_reward(setup: JudgeSetup) -> Callable[..., Any]:
    return functools.partial(judge, setup=setup)


class Runtime:
    """This process's state for one setup: client, cache, thread pool, down watch, the served model's id."""

    def __init__(self, setup: JudgeSetup) -> None:
        self.setup = setup
        self.client = client_for(setup.base_url, setup.root_url, setup.timeout_s, setup.api_key_file,
                                 setup.concurrency)
        self.cache = LruCache(setup.cache_size)
        self.pool = ThreadPoolExecutor(max_workers=setup.concurrency, thread_name_prefix="judge")
        self.down = DownWatch(setup.down_after_s)
        self.model = setup.model
        self._model_lock = threading.Lock()
        self.flights: dict[str, threading.Event] = {}  # requests in flight: an identical one waits for its reply
        self.flights_lock = threading.Lock()

    def model_id(self) -> str:
        with self._model_lock:
            if self.model is None:
                self.model = self.client.served_model()[0]
            return self.model


_RUNTIMES: dict[JudgeSetup, Runtime] = {}
_LOCK = threading.Lock()


def runtime_for(setup: JudgeSetup) -> Runtime:
    with _LOCK:
        if setup not in _RUNTIMES:
            _RUNTIMES[setup] = Runtime(setup)
        return _RUNTIMES[setup]


def env_of(environment: Any) -> str | None:
    trace = trace_of(environment)
    return trace.env if trace is not None else getattr(environment, "env_name", None)


def judge_failure_of(environment: Any) -> str | None:
    """Why this episode's judge call failed (its row is left out), or None."""
    trace = trace_of(environment)
    record = getattr(trace, "judge", None) if trace is not None else None
    return record.get("failure") if isinstance(record, dict) else None


async def judge(prompts: list, completions: list, completion_ids: list | None = None, environments: list | None = None,
                *, setup: JudgeSetup, **_: object) -> list[float | None]:
    runtime = runtime_for(setup)
    envs = list(environments) if environments else [None] * len(completions)
    rows = [i for i, env in enumerate(envs) if infra_failure_of(env) is None and setup.judges(env_of(env))]
    if not rows:
        return [None] * len(completions)
    jobs = _jobs(setup, rows, prompts, completions, envs)
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    outcomes = await asyncio.gather(*(_bounded(loop, runtime, job) for job in jobs))
    scores: list[float | None] = [None] * len(completions)
    failures = hits = calls = tokens = 0
    for job, (result, cached) in zip(jobs, outcomes):
        calls += 0 if cached else 1
        hits += 1 if cached else 0
        runtime.down.record(result.reason if isinstance(result, JudgeFailure) else None)
        for k, i in enumerate(job.rows):
            record: dict[str, Any] = {"flagged": job.flagged[k], "cached": cached}
            if isinstance(result, JudgeFailure):
                failures += 1
                record.update(score=None, verdict=None, rationale=None, failure=result.reason)
            else:
                verdict = result[k]
                tokens += 0 if cached else verdict.tokens
                scores[i] = verdict.score
                record.update(score=verdict.score, verdict=verdict.verdict, rationale=verdict.rationale, failure=None)
            trace = trace_of(envs[i])
            if trace is not None:
                trace.judge = record
    COSTS.add(calls=calls, seconds=time.perf_counter() - start, tokens=tokens, cache_hits=hits, failures=failures)
    runtime.down.check()  # JudgeDown: the run stops in one line (trainer.run.training)
    return scores


class _Job:
    """One judge request: a row (rubric, reward_model) or a group's judged rows (ranking)."""

    def __init__(self, rows: list[int], build: Callable[[str], dict[str, Any]],
                 read: Callable[[dict[str, Any]], list[Verdict]], route: str, root: bool, flagged: list[bool]) -> None:
        self.rows, self.build, self.read, self.route, self.root, self.flagged = rows, build, read, route, root, flagged


def _jobs(setup: JudgeSetup, rows: list[int], prompts: list, completions: list, envs: list) -> list[_Job]:
    tasks = {i: transcript.task_of(prompts[i]) for i in rows}
    texts = {i: transcript.render(completions[i]) for i in rows}
    flags = {i: transcript.flagged(texts[i]) or transcript.flagged(tasks[i]) for i in rows}
    chat = "/chat/completions"
    if setup.method == "ranking":
        out = []
        for group in _groups(rows, prompts, envs, setup.num_generations):
            task = tasks[group[0]]
            items = [texts[i] for i in group]
            out.append(_Job(group, lambda model, t=task, x=items: methods.ranking_request(_m(setup, model), t, x),
                            lambda reply, n=len(group): methods.ranking_verdicts(reply, n), chat, False,
                            [flags[i] for i in group]))
        return out
    if setup.method == "reward_model":
        return [_Job([i], lambda model, i=i: methods.reward_model_request(_m(setup, model), tasks[i], texts[i]),
                     lambda reply: [methods.reward_model_verdict(reply)], "/classify", True, [flags[i]])
                for i in rows]
    return [_Job([i], lambda model, i=i: methods.rubric_request(_m(setup, model), tasks[i], texts[i],
                                                                _env_reward(envs[i])),
                 lambda reply: [methods.rubric_verdict(setup, reply)], chat, False, [flags[i]]) for i in rows]


def _m(setup: JudgeSetup, model: str) -> JudgeSetup:
    return setup.with_model(model)


def _env_reward(env: Any) -> float | None:
    trace = trace_of(env)
    return getattr(trace, "env_reward", None) if trace is not None else None


def _groups(rows: list[int], prompts: list, envs: list, size: int) -> list[list[int]]:
    """The judged rows in GRPO groups: runs of one prompt and reset (TRL lays a group out together; a left-out
    episode between two rows does not split it), at most NUM_GENERATIONS a group."""
    groups: list[list[int]] = []
    last_key = None
    for i in rows:
        trace = trace_of(envs[i])
        key = (repr(prompts[i]), repr(getattr(trace, "reset", None)))
        if groups and key == last_key and len(groups[-1]) < size:
            groups[-1].append(i)
        else:
            groups.append([i])
        last_key = key
    return groups


async def _bounded(loop, runtime: Runtime, job: _Job) -> tuple[list[Verdict] | JudgeFailure, bool]:
    """One job's verdicts (from the cache, or a call bounded by JUDGE_TIMEOUT_S), or its JudgeFailure; and whether the
    cache answered."""
    try:
        return await asyncio.wait_for(loop.run_in_executor(runtime.pool, _call, runtime, job), runtime.setup.timeout_s)
    except asyncio.TimeoutError:
        return JudgeFailure(f"judge timeout: no verdict within JUDGE_TIMEOUT_S={runtime.setup.timeout_s:g} s"), False


def _call(runtime: Runtime, job: _Job) -> tuple[list[Verdict] | JudgeFailure, bool]:
    try:
        payload = job.build(runtime.model_id())
        key = key_of({"route": job.route, **payload})
        with runtime.flights_lock:
            cached = runtime.cache.get(key)
            flight = runtime.flights.get(key) if cached is None else None
            if cached is None and flight is None and runtime.cache.size > 0:
                runtime.flights[key] = threading.Event()  # this thread asks; identical requests wait for it
        if cached is not None:
            return cached, True
        if flight is not None:
            flight.wait(runtime.setup.timeout_s)
            cached = runtime.cache.get(key)
            return (cached, True) if cached is not None else \
                (JudgeFailure("judge call failed: an identical request in flight got no verdict"), False)
        try:
            verdicts = job.read(runtime.client.post(job.route, payload, root=job.root))
            runtime.cache.put(key, verdicts)
        finally:
            with runtime.flights_lock:
                done = runtime.flights.pop(key, None)
            if done is not None:
                done.set()
        return verdicts, False
    except JudgeFailure as exc:
        return exc, False
    except Exception as exc:  # noqa: BLE001 - a judge bug or an odd reply is a failed call, never a reward
        return JudgeFailure(f"judge call failed: {type(exc).__name__}: {exc}"), False
