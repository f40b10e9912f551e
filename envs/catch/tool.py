"""TRL `environment_factory` class for Catch (OpenSpiel). Works against upstream's openspiel_env too."""

from __future__ import annotations

from typing import Any, Optional

from envs.core.tool import EnvTool
from envs.catch.task import DIRECTIONS, render


class CatchTool(EnvTool):
    """One Catch session per rollout. Public methods are the model's tools."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._done = False
        self._reward = 0.0

    def reset(self, seed: Optional[int] = None, **row: Any) -> str:
        self._done, self._reward = False, 0.0
        data = self._client.reset(**({"seed": seed} if seed is not None else {}))
        return "\n\n" + render(data.get("observation", {}).get("info_state", []))

    def move(self, direction: str) -> str:
        """
        Move the paddle one column, or keep it still, while the ball falls one row.

        Args:
            direction: Where to move the paddle: "left", "stay" or "right".

        Returns:
            The board after the move: o is the ball, = is the paddle.
        """
        if self._done:
            raise RuntimeError("The game is over. Stop calling tools and give your final answer.")
        key = str(direction).strip().lower()
        if key not in DIRECTIONS:
            raise ValueError(f"direction must be one of left, stay, right; got {direction!r}")
        data = self._client.step({"action_id": DIRECTIONS[key], "game_name": "catch", "game_params": {}})
        board = render(data.get("observation", {}).get("info_state", []))
        if data.get("done"):
            self._done = True
            self._reward = 1.0 if (data.get("reward") or 0.0) > 0 else 0.0
            return board + ("\nCaught it! The game is over." if self._reward else "\nMissed. The game is over.")
        return board

    def get_reward(self) -> float:
        return self._reward
