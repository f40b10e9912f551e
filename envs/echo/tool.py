"""TRL `environment_factory` class for echo. Works against our server and upstream's echo_env image."""

from __future__ import annotations

from typing import Any, Optional

from envs.core.tool import EnvTool
from envs.echo import task


class EchoTool(EnvTool):
    """One echo session per rollout. Public methods are the model's tools."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._target: Optional[str] = None
        self._messages: list[str] = []

    def reset(self, target: Optional[str] = None, **row: Any) -> None:
        self._target = target
        self._messages = []
        self._client.reset(**({"target": target} if target is not None else {}))
        return None  # the dataset prompt already says what to do

    def _call(self, name: str, message: str) -> Any:
        if self._messages:
            raise RuntimeError("You already used the echo tool for this task. Stop calling tools and answer.")
        if not isinstance(message, str):
            raise TypeError(f"message must be a string, got {type(message).__name__}")
        obs = self._client.step({"type": "call_tool", "tool_name": name, "arguments": {"message": message}})
        observation = obs.get("observation") or {}
        if observation.get("error"):
            raise RuntimeError(observation["error"].get("message", "tool failed"))
        self._messages.append(message)
        result = observation.get("result")
        return result.get("data") if isinstance(result, dict) and "data" in result else result

    def echo_message(self, message: str) -> str:
        """
        Echo back the provided message.

        Args:
            message: The message to echo back.

        Returns:
            The same message that was provided.
        """
        return str(self._call("echo_message", message))

    def echo_with_length(self, message: str) -> str:
        """
        Echo back the message with its length.

        Args:
            message: The message to echo back.

        Returns:
            The message and its length, as JSON.
        """
        value = self._call("echo_with_length", message)
        return value if isinstance(value, str) else __import__("json").dumps(value)

    def get_reward(self) -> float:
        return task.reward(self._target, self._messages)
