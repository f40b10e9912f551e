"""Bind an env's tool class to its server(s) as the no-arg factory TRL's `environment_factory` wants.

TRL calls the factory once per rollout slot (a pool that grows to the generation batch) and keeps
every instance (one env-server session each) for the whole run. We:
  * resolve every replica of the env service (Docker's DNS answers all IPs of `env-<name>`) and hand
    instances out round-robin, so N replicas share the sessions;
  * count tool calls / failures per episode and the seconds spent in env calls (trainer.metrics);
  * decode the dataset's `env_row` column (the env's own row fields, JSON, so rows of different envs
    share one Arrow schema) back into `reset(**row)` kwargs.
"""

from __future__ import annotations

import functools
import inspect
import ipaddress
import itertools
import json
import socket
import threading
from typing import Any
from urllib.parse import urlparse, urlunparse

from trainer.metrics import STATS, RolloutStats

ENV_ROW_COLUMN = "env_row"


class BindingError(RuntimeError):
    pass


def resolve_replicas(url: str) -> list[str]:
    """All replica base URLs behind `url`'s host name (IPv4, sorted). IP literals come back unchanged."""
    parsed = urlparse(url)
    host, port = parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)
    if host is None:
        raise BindingError(f"{url!r} has no host; write e.g. http://env-echo:8000")
    try:
        ipaddress.ip_address(host)
        return [url.rstrip("/")]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise BindingError(f"cannot resolve {host!r} ({exc.strerror})") from None
    ips = sorted({info[4][0] for info in infos}, key=ipaddress.ip_address)
    path = parsed.path.rstrip("/")
    return [urlunparse((parsed.scheme, f"{ip}:{port}", path, "", "", "")) for ip in ips]


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


def bind(env_name: str, tool_class: type, url: str, stats: RolloutStats = STATS,
         replicas: list[str] | None = None) -> type:
    """A no-arg subclass of `tool_class` whose instances spread over the replicas of `url`."""
    replicas = replicas or resolve_replicas(url)
    counter = itertools.count()
    counter_lock = threading.Lock()

    sessions: dict[str, int] = {r: 0 for r in replicas}  # instances (= sessions) handed to each replica

    def __init__(self) -> None:
        with counter_lock:
            index = next(counter)
            self._replica_url = replicas[index % len(replicas)]
            sessions[self._replica_url] += 1
        self._episode_calls = 0
        self._episode_failures = 0
        with stats.timer("env"):
            tool_class.__init__(self, self._replica_url)

    def reset(self, **row: Any):
        encoded = row.pop(ENV_ROW_COLUMN, None)
        if encoded:
            row.update(json.loads(encoded))
        self._episode_calls = 0
        self._episode_failures = 0
        with stats.timer("env"):
            return tool_class.reset(self, **row)

    def get_reward(self) -> float:
        with stats.timer("env"):
            reward = tool_class.get_reward(self)
        stats.add_episode(env_name, reward, self._episode_calls, self._episode_failures)
        return reward

    namespace: dict[str, Any] = {
        "__init__": __init__, "reset": reset, "get_reward": get_reward,
        "__module__": tool_class.__module__, "__doc__": tool_class.__doc__,
        "env_name": env_name, "replica_urls": tuple(replicas), "sessions_per_replica": sessions,
    }
    for name in tool_method_names(tool_class):
        namespace[name] = _instrumented(getattr(tool_class, name), stats)
    # Same class name as the env's tool class: TRL logs its reward as rewards/<ClassName>/mean.
    return type(tool_class.__name__, (tool_class,), namespace)


def _instrumented(method, stats: RolloutStats):
    # functools.wraps keeps __name__, __doc__, annotations and __wrapped__, so TRL builds the same tool schema.
    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def async_wrapper(self, *args, **kwargs):
            self._episode_calls += 1
            with stats.timer("env"):
                try:
                    return await method(self, *args, **kwargs)
                except Exception:
                    self._episode_failures += 1
                    raise
        return async_wrapper

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        self._episode_calls += 1
        with stats.timer("env"):
            try:
                return method(self, *args, **kwargs)
            except Exception:
                self._episode_failures += 1
                raise
    return wrapper


def build_factories(cfg, specs: dict[str, Any], stats: RolloutStats = STATS,
                    replicas: dict[str, list[str]] | None = None):
    """Single env: the bound class. Several: {name: bound class} (rows routed by their `environment` column).
    `specs`: name -> EnvSpec or GenericSpec, as preflight resolved them."""
    replicas = replicas or {}
    bound = {
        name: bind(name, specs[name].tool_class, cfg.env_url(name), stats, replicas.get(name))
        for name in cfg.env_names
    }
    return bound[cfg.env_names[0]] if len(bound) == 1 else bound
