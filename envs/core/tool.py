"""The tool-instance contract: what one instance of a TRL `environment_factory` class holds, and the only way the
trainer and the benches reach it.

TRL publishes every public function of a tool class as a tool the model may call (all but `reset` and `get_reward`),
so what a tool instance keeps for the trainer lives in underscored attributes of `EnvTool`, and nothing outside this
module (and the classes that write them: the tool classes and trainer.rollouts.envs_binding's bound subclass) spells those
names. The trainer calls the functions below instead; each accepts any object (a custom env that does not derive
from `EnvTool`, a test double, `detached`'s snapshot) and answers "nothing there" where the attribute is missing.

What an instance holds:
  * `_client`: its env-server session, one per instance: a `/ws` session (envs.core.client.SessionClient), or an MCP
    session over HTTP (envs.core.http_mcp.McpHttpSession) where the class's `_session_class` says so;
  * `_rewards`: the per-step rewards the env sent this episode, where the tool class keeps them (envs.generic);
  * `_trace`: the episode as the binding saw it (trainer.rollouts.Trace), set at each reset;
  * `_infra_failure`: why the env side ended this episode (trainer.rollouts.infra_failures), else None;
  * `_abandon_session()`: what the rollout loop calls when a call outran TOOL_TIMEOUT_S (the binding's records why).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from envs.core.client import SessionClient
from envs.core.http_mcp import McpHttpSession


class EnvTool:
    """Base of the stack's tool classes: one env-server session per instance. Adds no public method (TRL would
    publish it as a tool; tests/trainer/test_tool_contract.py checks what TRL sees)."""

    _session_class: type = SessionClient  # the transport: McpHttpSession for an env that serves no /ws
    _client: SessionClient | McpHttpSession | None = None
    _rewards: list[float] | None = None
    _trace: Any = None
    _infra_failure: str | None = None

    def __init__(self, base_url: str) -> None:
        self._client = self._session_class(base_url)

    def _abandon_session(self) -> None:
        """A call outran TOOL_TIMEOUT_S: its reply must never reach a later call, so the session closes."""
        close_session(self)


def session_of(tool: Any) -> SessionClient | McpHttpSession | None:
    """The instance's env-server session, or None (a tool class with no session client of ours)."""
    client = getattr(tool, "_client", None)
    return client if isinstance(client, (SessionClient, McpHttpSession)) else None


def close_session(tool: Any) -> None:
    """Close the instance's session (its next reset opens a new one). No session: nothing to do."""
    close = getattr(getattr(tool, "_client", None), "close", None)
    if callable(close):
        close()


def abandon_session(tool: Any) -> None:
    """The rollout loop gave up on one of the instance's calls (TOOL_TIMEOUT_S): the bound class records why and
    closes the session. An object with no such hook is left alone."""
    abandon = getattr(tool, "_abandon_session", None)
    if callable(abandon):
        abandon()


def step_rewards(tool: Any) -> list[float] | None:
    """A copy of the per-step rewards the env sent this episode, or None where the tool class keeps none."""
    rewards = getattr(tool, "_rewards", None)
    return list(rewards) if isinstance(rewards, list) else None


def trace_of(tool: Any) -> Any:
    """The current episode's trace (trainer.rollouts.Trace), or None (an unbound instance, before the first reset)."""
    return getattr(tool, "_trace", None)


def infra_failure_of(tool: Any) -> str | None:
    """Why the env side ended the instance's current episode, or None (the episode is the model's to win or lose)."""
    return getattr(tool, "_infra_failure", None)


def submit_final_answer(tool: Any, text: str) -> tuple[str, dict, str, bool] | None:
    """An episode that ended in plain text, for a tool class that scores final answers through a tool (envs.generic's
    for an env serving its tasks with an answer tool): the text submitted through it; (tool, arguments, result,
    failed), or None where nothing was submitted. A failure of the env side is a failed submission, not a raise."""
    submit = getattr(tool, "_submit_final", None)
    if not callable(submit):
        return None
    try:
        return submit(text)
    except Exception as exc:  # noqa: BLE001 - a lost session: the episode keeps the reward it had
        return "", {}, f"{type(exc).__name__}: {exc}", True


def detached(tool: Any) -> SimpleNamespace:
    """What the functions above read from `tool` now, kept after the instance goes back to TRL's pool and its next
    reset replaces them (ROLLOUTS=async traces a group once it is scored). The trace object stays this episode's."""
    return SimpleNamespace(_trace=trace_of(tool), _rewards=step_rewards(tool), _infra_failure=infra_failure_of(tool),
                           env_name=getattr(tool, "env_name", "?"))


class _ResetSent(Exception):
    """Stops `reset_data`'s reset once its session was asked to reset."""


class _ResetRecorder:
    data: dict | None = None

    def reset(self, **data: Any) -> dict:
        self.data = data
        raise _ResetSent


def reset_data(tool_class: type, row: dict) -> dict | None:
    """What `tool_class`'s reset sends its env server for dataset `row` (a built-in env maps its row's own keys, a
    learned one sends the row's `reset_kwargs`), found by running that reset against a recorder: no session is opened.
    None where the reset never asks its session (a tool class with no SessionClient of ours)."""
    tool = tool_class.__new__(tool_class)  # no __init__: no session
    recorder = _ResetRecorder()
    tool._client = recorder
    try:
        tool.reset(**{k: v for k, v in row.items() if k != "prompt"})
    except _ResetSent:
        return recorder.data
    except Exception:  # noqa: BLE001 - a reset that needs more than its session: nothing to learn here
        return None
    return None
