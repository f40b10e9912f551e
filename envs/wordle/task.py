"""Wordle task rows and helpers. Light imports only."""

from __future__ import annotations

import random

from envs.wordle.words import SECRET_WORDS

PROMPT = (
    "Let's play Wordle. Find the secret 5-letter English word in at most 6 guesses with the guess "
    "tool. After each guess you get one letter per position: G = right letter, right spot; "
    "Y = in the word, wrong spot; X = not in the word."
)


def make_dataset(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompt = [{"role": "user", "content": PROMPT}]
    return [{"prompt": prompt, "seed": rng.randrange(2**31)} for _ in range(n)]


def secret_for(seed: int) -> str:
    """The word our server picks for `seed` (it draws from SECRET_WORDS with random.Random(seed))."""
    return random.Random(seed).choice(SECRET_WORDS)


def demo_calls(row: dict) -> list[tuple[str, dict]]:
    return [("guess", {"word": secret_for(row["seed"])})]


def baseline_action(rng: random.Random, observation_text: str) -> tuple[str, dict]:
    return ("guess", {"word": rng.choice(SECRET_WORDS)})
