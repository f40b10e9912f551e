"""TRL `environment_factory` class for Wordle (TextArena). Works against upstream's textarena_env too."""

from __future__ import annotations

import re
from typing import Any, Optional

from envs.core.tool import EnvTool


def _full_text(observation: dict) -> str:
    return "".join(m.get("content", "") for m in observation.get("messages", []) if isinstance(m, dict))


def _clean(text: str, word: str) -> str:
    """Drop the echo of our own guess and TextArena's speaker tags."""
    lines = [ln for ln in text.splitlines() if ln.strip() not in (f"[GAME] [{word}]", "")]
    return "\n".join(re.sub(r"^\[GAME\] ", "", ln) for ln in lines).strip()


class WordleTool(EnvTool):
    """One Wordle session per rollout. Public methods are the model's tools."""

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._seen = ""
        self._done = False
        self._reward = 0.0

    def reset(self, seed: Optional[int] = None, **row: Any) -> None:
        data = self._client.reset(**({"seed": seed} if seed is not None else {}))
        self._seen = _full_text(data.get("observation", {}))
        self._done, self._reward = False, 0.0
        return None  # the dataset prompt carries the rules

    def guess(self, word: str) -> str:
        """
        Guess the secret word.

        Args:
            word: A 5-letter English word.

        Returns:
            Feedback for the guess, one letter per position (G, Y or X), or why it was not accepted.
        """
        if self._done:
            raise RuntimeError("The game is over. Stop calling tools and give your final answer.")
        word = str(word).strip().strip("[]").strip().lower()
        data = self._client.step({"message": f"[{word}]"})
        full = _full_text(data.get("observation", {}))
        # Upstream's observation carries the whole history: return only what is new.
        new = full[len(self._seen) :] if full.startswith(self._seen) else full
        self._seen = full
        self._reward = float(data.get("reward") or 0.0)
        text = _clean(new, word)
        if data.get("done"):
            self._done = True
            text = (text + "\n" if text else "") + ("You won! " if self._reward >= 1.0 else "") + "The game is over."
        return text or "(no feedback)"

    def get_reward(self) -> float:
        return self._reward
