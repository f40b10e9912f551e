"""Bind an env's tool class to its server(s) as the no-arg factory TRL's `environment_factory` wants.

TRL calls the factory once per rollout slot (a pool that grows to the generation batch) and keeps
every instance (one env-server session each) for the whole run. We:
  * give each instance the env service's URL: its session client spreads the sessions over the
    service's replicas or fleet tasks, least-loaded first, and re-resolves them as they change
    (envs.core.replicas; `replica_set` is that process-wide set, for the run's log);
  * count tool calls / failures per episode and the seconds spent in reset/reward calls (trainer.core.metrics;
    tool calls run concurrently, so trainer.rollouts.rollout_loop times each round's wall clock instead);
  * close the session when the rollout loop gives up on a call (TOOL_TIMEOUT_S): the rest of that
    episode's calls fail at once, and a late reply cannot reach the next episode;
  * decode the dataset's `env_row` column (the env's own row fields, JSON, so rows of different envs
    share one Arrow schema) back into `reset(**row)` kwargs;
  * treat what comes back as an untrusted env's (envs.core.untrusted): every text a tool or reset returns, and every
    error message, reaches the model with control characters escaped and trimmed to ENV_OBSERVATION_CHARS (plus
    room for the tool class's own words), and a reward that is not finite or out of range makes a failed episode
    (FAILED_EPISODE_REWARD, as an episode whose env never scored it) with one log line;
  * close every session an instance of this process opened when the run ends, whatever ends it (`sessions_closed`:
    an error, EnvDown, a stop signal's graceful stop, the last step; async: the rollout worker's loop): upstream
    servers free a slot when its socket closes, and openenv 0.10 reaps no idle session when `max_concurrent_envs` is
    set, so a session left open would hold its slot for as long as the process lives;
  * mark an episode the env side ended (a failed reset, a lost session, a reply that never came: trainer.rollouts.infra_failures)
    with its reason: its later calls fail at once, its trace says why, `get_reward` gives None (TRL: not scored) and
    the trainer leaves it out of the loss; a failed reset is such an episode, not the end of the run, unless the env
    looks dead (infra_failures.WINDOWS).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import threading
from collections import Counter
from typing import Any

from envs.core.replicas import ReplicaSet, ResolveError, resolve
from envs.core.tool import close_session, infra_failure_of, session_of, trace_of
from envs.core.untrusted import BadReward, check_reward, safe_text, strip_credentials
from trainer.rollouts import infra_failures
from trainer.core.metrics import STATS, RolloutStats
from trainer.rollouts.traces import Trace

ENV_ROW_COLUMN = "env_row"
FAILED_EPISODE_REWARD = 0.0  # what every tool class scores an episode that failed before its env rewarded it
TEXT_ALLOWANCE = 200  # room past ENV_OBSERVATION_CHARS for a tool class's own words ("The episode is over ...")
REPLY_GRACE_S = 5.0  # the session client's step bound past TOOL_TIMEOUT_S (see bind)
LOGGED_BAD_REWARDS = 10  # per env, then every 100th: a hostile env cannot flood the log
LOGGED_INFRA = 10  # infra-ended episodes logged per env, then every 100th

log = logging.getLogger("trainer.envs")
_bad_rewards: Counter[str] = Counter()
_bad_rewards_lock = threading.Lock()
_infra_logged: Counter[str] = Counter()
_live: list[Any] = []  # every bound instance this process made (TRL keeps them all for the run): closed at its end
_live_lock = threading.Lock()


class BindingError(RuntimeError):
    pass


CLOSE_THREADS = 64  # sessions closed at once at the end of a run


def close_all_sessions() -> int:
    """Close the env session of every bound instance this process made (a closed one is a no-op); how many.
    All at once: each close may wait out its bound on a slow or half-open link (SessionClient.close: 5 s for the
    close handshake), and one after the other that was the bound times the sessions (an async run's 32+ sessions
    behind a slow link outlasted TRL's 15 s for its rollout worker to exit, which then was killed)."""
    from concurrent.futures import ThreadPoolExecutor

    with _live_lock:
        instances, _live[:] = list(_live), []
    if instances:
        with ThreadPoolExecutor(min(CLOSE_THREADS, len(instances)), thread_name_prefix="env-close") as pool:
            list(pool.map(close_session, instances))  # SessionClient.close: bounded, never raises
    return len(instances)


@contextlib.contextmanager
def sessions_closed(where: str):
    """Run the block, then close every session this process opened, on any way out (an exception included)."""
    try:
        yield
    finally:
        closed = close_all_sessions()
        if closed:
            log.info("%s: closed %d env session(s)", where, closed)


def resolve_replicas(url: str) -> list[str]:
    """All replica base URLs behind `url`'s host name (IPv4, sorted). IP literals come back unchanged."""
    try:
        return resolve(url)
    except ResolveError as exc:
        raise BindingError(str(exc)) from None


def tool_method_names(cls: type) -> list[str]:
    """Exactly what TRL exposes as tools: public functions of the class except reset/get_reward."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    ]


def encode_row(row: dict[str, Any]) -> dict[str, Any]:
    """Dataset row for TRL: `prompt` stays a column, everything else goes into one JSON column."""
    extras = {k: v for k, v in row.items() if k != "prompt"}
    out = {ENV_ROW_COLUMN: json.dumps(extras)}
    if "prompt" in row:
        out["prompt"] = row["prompt"]
    return out


def bind(env_name: str, tool_class: type, url: str, stats: RolloutStats = STATS, text_chars: int = 2000,
         step_timeout_s: float | None = None, reset_timeout_s: float | None = 120.0) -> type:
    """A no-arg subclass of `tool_class` whose instances each open one session on the env at `url`.
    `text_chars`: ENV_OBSERVATION_CHARS, the most of an env's text the model sees per tool result.
    `step_timeout_s` / `reset_timeout_s`: TOOL_TIMEOUT_S and RESET_TIMEOUT_S (None: no bound), the session client's
    bound on one reply: the only ones, so a tool allowed 3 minutes gets 3 minutes. A step's reply gets
    REPLY_GRACE_S more than TOOL_TIMEOUT_S: the rollout loop's bound (trainer.rollouts.rollout_loop) is the one that acts and
    speaks to the model; the client's stops the socket waiting for ever outside the loop."""
    limit = text_chars + TEXT_ALLOWANCE

    def __init__(self) -> None:
        self._episode_calls = 0
        self._episode_failures = 0
        self._episode = 0  # which episode a (possibly late) tool call belongs to
        self._abandoned = False
        self._infra_failure: str | None = None  # why the env side ended this episode (trainer.rollouts.infra_failures)
        self._call_failure_counted = False  # the current call's failure: counted once, by it or by the loop's timeout
        self._count_lock = threading.Lock()  # the call runs in a worker thread, the loop's timeout in another
        with stats.timer("env"):
            tool_class.__init__(self, url)
        client = session_of(self)  # every tool class in envs/ has one (envs.core.tool.EnvTool)
        if client is not None:
            client.message_timeout_s = None if step_timeout_s is None else step_timeout_s + REPLY_GRACE_S
            client.reset_timeout_s = reset_timeout_s
        with _live_lock:
            _live.append(self)

    def reset(self, **row: Any):
        encoded = row.pop(ENV_ROW_COLUMN, None)
        if encoded:
            row.update(json.loads(encoded))
        self._episode_calls = 0
        self._episode_failures = 0
        self._episode += 1
        self._abandoned = False
        self._infra_failure = None
        self._trace = Trace(env_name, {k: v for k, v in row.items() if k != "prompt"})  # trainer.rollouts.traces
        guard = _safe_errors(limit)
        try:
            with stats.timer("env"), guard:
                text = tool_class.reset(self, **row)
        except Exception:
            if guard.infra is None:
                raise  # a setup error (a redirect, a bad row): it stops the run as before
            why = f"reset failed: {guard.infra}"
            _mark_infra(self, self._episode, why)
            infra_failures.WINDOWS.check(env_name, why)  # a dead env stops the run (EnvDown)
            return None  # the prompt as the dataset wrote it; the episode runs on without its env
        return safe_text(text, limit) if isinstance(text, str) else text

    def _abandon_session(self) -> None:
        """A call outran TOOL_TIMEOUT_S (trainer.rollouts.rollout_loop): it failed, and the session closes."""
        with self._count_lock:
            self._abandoned = True
            if self._infra_failure is None:
                bound = "" if step_timeout_s is None else f" ({step_timeout_s:g} s)"
                self._infra_failure = f"no reply within TOOL_TIMEOUT_S{bound}; the session was closed"
                trace = trace_of(self)
                if trace is not None:
                    trace.infra_failure = self._infra_failure
            if not self._call_failure_counted:  # it may have failed by itself as the loop gave up on it
                self._call_failure_counted = True
                self._episode_failures += 1
        session = session_of(self)
        where = getattr(session, "shown_url", url)
        conn = getattr(session, "connection", None)  # which of the replica's sessions (envs.core.client.stalled)
        where += f" (from {conn})" if conn else ""
        _log_infra(env_name, f"{self._infra_failure} ({where})")  # the stall's one-line diagnosis
        close_session(self)

    def get_reward(self) -> float | None:
        if self._infra_failure is not None:  # not the model's: no reward (TRL leaves a NaN row out)
            stats.add_infra_failure(env_name)
            infra_failures.WINDOWS.record(env_name, self._infra_failure)
            return None
        infra_failures.WINDOWS.record(env_name, None)
        with stats.timer("env"):
            reward = tool_class.get_reward(self)
        try:
            reward = check_reward(reward)
        except BadReward as exc:
            _log_bad_reward(env_name, exc)
            reward = FAILED_EPISODE_REWARD
        stats.add_episode(env_name, reward, self._episode_calls, self._episode_failures)
        trace = trace_of(self)
        if trace is not None:
            trace.scored(reward, self._episode_calls, self._episode_failures)
        return reward

    namespace: dict[str, Any] = {
        "__init__": __init__, "reset": reset, "get_reward": get_reward, "_abandon_session": _abandon_session,
        "__module__": tool_class.__module__, "__doc__": tool_class.__doc__,
        "env_name": env_name, "replica_set": ReplicaSet.for_url(url),
    }
    for name in tool_method_names(tool_class):
        namespace[name] = _instrumented(getattr(tool_class, name), limit)
    # Same class name as the env's tool class: TRL logs its reward as rewards/<ClassName>/mean.
    return type(tool_class.__name__, (tool_class,), namespace)


def _log_bad_reward(env_name: str, exc: BadReward) -> None:
    with _bad_rewards_lock:
        _bad_rewards[env_name] += 1
        n = _bad_rewards[env_name]
    if n <= LOGGED_BAD_REWARDS or n % 100 == 0:
        log.warning("env %s: %s; the episode counts as failed (reward %g) [%d such reward(s) so far]",
                    env_name, exc, FAILED_EPISODE_REWARD, n)


def _log_infra(env_name: str, why: str) -> None:
    """One line per episode the env side ended where the trainer saw it first (a failed reset, a call given up on)."""
    with _bad_rewards_lock:
        _infra_logged[env_name] += 1
        n = _infra_logged[env_name]
    if n <= LOGGED_INFRA or n % 100 == 0:
        log.warning("env %s: %s; this episode is left out of training [%d so far]", env_name, why, n)


class _safe_errors:
    """An exception whose message the model (TRL shows `str(e)`), a trace or a log would see, escaped and trimmed
    (raised again as RuntimeError only when that changes it: an honest env's errors pass untouched). `infra`: why the
    original exception says the env side failed (trainer.rollouts.infra_failures), else None."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.infra: str | None = None

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, Exception):
            self.infra = infra_failures.reason(exc)
            message = str(exc)
            shown = strip_credentials(safe_text(message, self.limit))
            if shown != message:
                raise RuntimeError(shown) from None
        return False


def _instrumented(method, limit: int):
    # functools.wraps keeps __name__, __doc__, annotations and __wrapped__, so TRL builds the same tool schema.
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def async_wrapper(self, *args, **kwargs):
            episode = _start_call(self)
            guard = _safe_errors(limit)
            try:
                with guard:
                    result = await method(self, *args, **kwargs)
            except Exception as exc:
                _count_failure(self, episode)
                if guard.infra is not None:
                    _mark_infra(self, episode, f"{method.__name__}: {guard.infra}")
                _traced(self, episode, method.__name__, kwargs, f"{type(exc).__name__}: {exc}", failed=True)
                raise
            result = safe_text(result, limit) if isinstance(result, str) else result
            _traced(self, episode, method.__name__, kwargs, result, failed=False)
            return result
        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        episode = _start_call(self)
        guard = _safe_errors(limit)
        try:
            with guard:
                result = method(self, *args, **kwargs)
        except Exception as exc:
            _count_failure(self, episode)
            if guard.infra is not None:
                _mark_infra(self, episode, f"{method.__name__}: {guard.infra}")
            _traced(self, episode, method.__name__, kwargs, f"{type(exc).__name__}: {exc}", failed=True)
            raise
        result = safe_text(result, limit) if isinstance(result, str) else result
        _traced(self, episode, method.__name__, kwargs, result, failed=False)
        return result
    return wrapper


def _traced(env, episode: int, tool: str, arguments: dict, result: Any, failed: bool) -> None:
    """Into the episode's trace (trainer.rollouts.traces), unless the call outlived its episode (a late timed-out one)."""
    trace = trace_of(env)
    if trace is not None and episode == env._episode and not env._abandoned:
        trace.call(tool, arguments, result, failed)


SESSION_CLOSED = ("The env session was closed after a tool call timed out; this episode cannot continue. "
                  "Stop calling tools and give your final answer.")


ENV_UNAVAILABLE = ("The env is unavailable ({why}); this episode cannot continue and does not count. "
                   "Stop calling tools and give your final answer.")


def _start_call(env) -> int:
    with env._count_lock:
        env._episode_calls += 1
        if env._abandoned:
            env._episode_failures += 1
            raise RuntimeError(SESSION_CLOSED)
        if infra_failure_of(env) is not None:  # its reset failed, or an earlier call lost the session
            env._episode_failures += 1
            raise RuntimeError(ENV_UNAVAILABLE.format(why=infra_failure_of(env)))
        env._call_failure_counted = False
        return env._episode


def _mark_infra(env, episode: int, why: str) -> None:
    """The env side ended `episode` (its first reason is kept); a late failure of an earlier episode is not this one's."""
    with env._count_lock:
        if env._episode != episode or infra_failure_of(env) is not None:
            return
        env._infra_failure = why
    _log_infra(env.env_name, why)
    trace = trace_of(env)
    if trace is not None:
        trace.infra_failure = why


def _count_failure(env, episode: int) -> None:
    # A call the loop gave up on was counted then; one that fails after the next reset is not that episode's.
    with env._count_lock:
        if env._episode == episode and not env._abandoned and not env._call_failure_counted:
            env._call_failure_counted = True
            env._episode_failures += 1


class EnvFactory:
    """The no-arg factory TRL calls per rollout slot: `bind`'s class, built on first use in each process.

    Picklable, because ROLLOUTS=async hands it to TRL's rollout worker, a spawned process (sync mode calls it in
    place): it carries how to get the tool class (`tool_class_source`: a class importable by name, or a picklable
    no-arg callable that builds one, e.g. a learned env's `functools.partial(make_tool_class, ...)`), never the
    built class, whose per-process state (its ReplicaSet, the stats it reports to, instances' locks) stays where it
    was made. The run-wide STATS is not pickled: each process reports to its own."""

    def __init__(self, env_name: str, tool_class_source: Any, url: str, stats: RolloutStats = STATS,
                 text_chars: int = 2000, step_timeout_s: float | None = None,
                 reset_timeout_s: float | None = 120.0) -> None:
        self.env_name, self.tool_class_source, self.url = env_name, tool_class_source, url
        self.stats, self.text_chars = stats, text_chars
        self.step_timeout_s, self.reset_timeout_s = step_timeout_s, reset_timeout_s
        self._bound: type | None = None
        self._bind_lock = threading.Lock()

    @property
    def bound(self) -> type:
        """`bind`'s subclass, once per process: every instance is of one class (TRL keys env rewards by the class)."""
        with self._bind_lock:
            if self._bound is None:
                source = self.tool_class_source
                tool_class = source if isinstance(source, type) else source()
                self._bound = bind(self.env_name, tool_class, self.url, self.stats, self.text_chars,
                                   self.step_timeout_s, self.reset_timeout_s)
            return self._bound

    @property
    def replica_set(self) -> ReplicaSet | None:
        return self.bound.replica_set

    def __call__(self) -> Any:
        return self.bound()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__, _bound=None, _bind_lock=None)
        if state["stats"] is STATS:
            state["stats"] = None  # the unpickling process reports to its own STATS
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _bind_lock=threading.Lock())
        if self.stats is None:
            self.stats = STATS


def tool_class_source(spec: Any) -> Any:
    """What EnvFactory rebuilds `spec.tool_class` from in another process: the class itself when it is importable
    by name (built-in envs), else how it was made (an env learned from its server: `make_tool_class` of its
    interface). Anything else is the class itself: fine in place (sync), refused with TRL's message when pickled."""
    from envs.generic import GenericSpec
    from envs.generic.tool import make_tool_class

    if isinstance(spec, GenericSpec):
        return functools.partial(make_tool_class, spec.name, spec.interface, spec.reward, spec.observation_chars,
                                 spec.answer)
    return spec.tool_class


def build_factories(cfg, specs: dict[str, Any], stats: RolloutStats = STATS):
    """Single env: its EnvFactory. Several: {name: EnvFactory} (rows routed by their `environment` column).
    `specs`: name -> EnvSpec or GenericSpec, as preflight resolved them."""
    bound = {name: EnvFactory(name, tool_class_source(specs[name]), cfg.env_url(name), stats,
                              cfg.env_observation_chars, cfg.tool_timeout_s, cfg.reset_timeout_s)
             for name in cfg.env_names}
    return bound[cfg.env_names[0]] if len(bound) == 1 else bound
