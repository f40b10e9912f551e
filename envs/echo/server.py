"""Echo environment server: upstream echo_env's schema and tools, without the per-call MCP round trip.

Upstream routes every tool call through an in-process FastMCP client/server pair; here a call is a
plain function call on the event loop, which is where the CPU per step goes. The wire format is the
same (see models.py), including the HTTP `/mcp` JSON-RPC path the upstream `EchoEnv` client uses.
"""

from __future__ import annotations

from typing import Any, Optional
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State

from envs.echo import task
from envs.echo.models import (
    TOOL_NAMES,
    TOOLS,
    CallToolAction,
    CallToolObservation,
    ListToolsAction,
    ListToolsObservation,
    ToolError,
    ToolErrorType,
    mcp_tool_list,
    tool_result,
)


class _ToolClientShim:
    """Enough of upstream's FastMCP client for openenv's `/mcp` handler (its `mcp_client` path, the one upstream's
    MCPEnvironment takes): tools/list items and errors as upstream's (e.g. -32603 "Unknown tool: 'nope'")."""

    def __init__(self, env: "EchoEnvironment") -> None:
        self._env = env

    def is_connected(self) -> bool:
        return True  # in-process: nothing to connect

    async def __aenter__(self) -> "_ToolClientShim":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None

    async def list_tools(self) -> list[dict]:
        return mcp_tool_list()

    async def call_tool(self, name: str, arguments: Any = None) -> dict:
        if name not in TOOL_NAMES:
            raise ValueError(f"Unknown tool: {name!r}")  # FastMCP's words; the handler answers -32603
        return tool_result(self._env._call(name, arguments if arguments is not None else {}))


class EchoEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True
    # openenv otherwise gives every session its own executor thread (256 sessions = 256 threads
    # against the container's pids limit); construction and reset are cheap, one shared thread does.
    REQUIRES_SINGLE_THREAD_EXECUTOR = True

    def __init__(self) -> None:
        super().__init__()
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target: Optional[str] = None
        self._messages: list[str] = []

    # openenv's /mcp handler looks for `mcp_client`; built only when that path is used.
    @property
    def mcp_client(self) -> _ToolClientShim:
        return _ToolClientShim(self)

    def reset(
        self, seed: Optional[int] = None, episode_id: Optional[str] = None, target: Optional[str] = None, **kwargs: Any
    ) -> Observation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target = str(target) if target is not None else None
        self._messages = []
        return Observation(done=False, reward=0.0, metadata={"status": "ready", "message": "Echo environment ready!"})

    def _call(self, name: str, arguments: Any) -> Any:
        """Run tool `name`; raises ValueError with a message fit for the caller."""
        if not isinstance(arguments, dict) or set(arguments) != {"message"} or not isinstance(arguments["message"], str):
            raise ValueError(
                f"{name} takes exactly one argument, message (a string); got {arguments!r:.200}"
            )
        message = arguments["message"]
        self._messages.append(message)
        if name == "echo_message":
            return message
        return {"message": message, "length": len(message)}

    def _dispatch(self, action: Action) -> Observation:
        self._state.step_count += 1
        if isinstance(action, ListToolsAction):
            return ListToolsObservation(tools=list(TOOLS))
        if not isinstance(action, CallToolAction):
            return Observation(
                done=False,
                reward=0.0,
                metadata={
                    "error": f"Unknown action type: {type(action).__name__}. "
                    "Use ListToolsAction or CallToolAction for MCP interactions."
                },
            )
        name = action.tool_name
        if name not in TOOL_NAMES:
            error = ToolError(
                error_type=ToolErrorType.TOOL_NOT_FOUND,
                message=f"Unknown tool: {name!r}; available: {', '.join(TOOL_NAMES)}",
            )
            return CallToolObservation(tool_name=name, result=None, error=error)
        try:
            value = self._call(name, action.arguments)
        except ValueError as e:
            error = ToolError(error_type=ToolErrorType.INVALID_ARGS, message=str(e))
            return CallToolObservation(tool_name=name, result=None, error=error)
        reward = task.reward(self._target, self._messages) if self._target is not None else None
        return CallToolObservation(tool_name=name, result=tool_result(value), reward=reward)

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._dispatch(action)

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._dispatch(action)  # microseconds of work: no thread hop

    @property
    def state(self) -> State:
        return self._state


def server_parts():
    return EchoEnvironment, CallToolAction, CallToolObservation, State
