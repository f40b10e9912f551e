"""Echo task: say one of a few words through the echo tool. Light imports only (no openenv)."""

from __future__ import annotations

import random

WORDS = ("apple", "river", "green", "music", "cloud", "stone")
PROMPT = "Use the echo tool to say the word: {target}"

FULL = 1.0  # first echo call says the target
PARTIAL = 0.2  # called the tool, with another message
NONE = 0.0  # never called it


def make_dataset(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        target = rng.choice(WORDS)
        rows.append({"prompt": [{"role": "user", "content": PROMPT.format(target=target)}], "target": target})
    return rows


def normalize(message: str) -> str:
    return str(message).strip().strip(".!\"'").strip().lower()


def reward(target: str | None, messages: list[str]) -> float:
    """Only the FIRST call counts, so echoing every candidate word earns nothing extra."""
    if not messages:
        return NONE
    if target is not None and normalize(messages[0]) == normalize(target):
        return FULL
    return PARTIAL


def demo_calls(row: dict) -> list[tuple[str, dict]]:
    return [("echo_message", {"message": row["target"]})]


def baseline_action(rng: random.Random, observation_text: str) -> tuple[str, dict]:
    return ("echo_message", {"message": rng.choice(WORDS)})
