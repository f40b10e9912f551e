"""Names -> environments. Importable with no heavy dependency: everything resolves lazily.

    from envs.registry import get, resolve
    spec = get("echo")
    spec.tool_class            # the TRL environment_factory class (imported on first use)
    spec.make_dataset(64, 0)   # rows: {"prompt": [...chat...], **reset kwargs}
    resolve("connect4", "http://env-connect4:8000")  # any other name: learned from its running server
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass
from typing import Any, Callable


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class EnvSpec:
    name: str
    upstream_env_name: str  # the env_name upstream's app passes to create_app
    tool_class_path: str
    task_module: str
    server_parts_path: str  # -> (factory, Action, Observation, State) for create_app
    episode_budget_tokens: int  # rough completion tokens one episode needs (preflight warning)

    @property
    def tool_class(self) -> type:
        return _resolve(self.tool_class_path)

    def _task(self) -> Any:
        return importlib.import_module(self.task_module)

    def make_dataset(self, n: int, seed: int) -> list[dict]:
        """`n` rows: `prompt` (chat messages) plus the kwargs the tool class's `reset(**row)` takes."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        return self._task().make_dataset(n, seed)

    def demo_calls(self, row: dict, observation: str | None = None) -> list[tuple[str, dict]]:
        """An expert's tool calls for `row` (for a supervised warm-start of a tiny model). `observation`: the reset's
        text, for envs learned from their server (a built-in env's expert knows its task from the row)."""
        return self._task().demo_calls(row)

    def baseline_action(self, rng: random.Random, observation_text: str) -> tuple[str, dict]:
        """A random legal tool call given the last observation text (for `make baseline`)."""
        return self._task().baseline_action(rng, observation_text)

    def server_parts(self) -> tuple[Callable[[], Any], type, type, type]:
        return _resolve(self.server_parts_path)()


_SPECS = {
    "echo": EnvSpec(
        name="echo",
        upstream_env_name="echo_env",
        tool_class_path="envs.echo.tool:EchoTool",
        task_module="envs.echo.task",
        server_parts_path="envs.echo.server:server_parts",
        episode_budget_tokens=96,
    ),
    "wordle": EnvSpec(
        name="wordle",
        upstream_env_name="textarena_env",
        tool_class_path="envs.wordle.tool:WordleTool",
        task_module="envs.wordle.task",
        server_parts_path="envs.wordle.server:server_parts",
        episode_budget_tokens=1024,
    ),
    "catch": EnvSpec(
        name="catch",
        upstream_env_name="openspiel_env",
        tool_class_path="envs.catch.tool:CatchTool",
        task_module="envs.catch.task",
        server_parts_path="envs.catch.server:server_parts",
        episode_budget_tokens=768,
    ),
}
NAMES = tuple(_SPECS)  # the built-in envs: a new one is its folder plus its line above, nothing else


def names() -> tuple[str, ...]:
    """The built-in envs now (read at call time, so a spec added after import counts too)."""
    return tuple(_SPECS)


def get(name: str) -> EnvSpec:
    """The spec for `name`; a ValueError naming the valid choices otherwise."""
    key = (name or "").strip().lower()
    if key not in _SPECS:
        raise ValueError(f"Unknown environment {name!r}; valid choices: {', '.join(names())}.")
    return _SPECS[key]


def is_builtin(name: str) -> bool:
    return (name or "").strip().lower() in _SPECS


def resolve(name: str, url: str, **generic_options: Any) -> Any:
    """The built-in spec for `name`, else a `GenericSpec` whose tools are learned from the OpenEnv
    server at `url` (`generic_options`: instruction, prompts_file, reward, observation_chars).
    Raises envs.generic.InterfaceError (or UnsupportedSchema) with one line naming the problem."""
    if is_builtin(name):
        return get(name)
    from envs.generic import GenericSpec

    return GenericSpec.discover(name, url, **generic_options)
