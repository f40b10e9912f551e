"""Catch task: move the paddle under the falling ball. Light imports only (numpy for demo_calls)."""

from __future__ import annotations

import random

ROWS, COLS = 10, 5  # OpenSpiel catch defaults
DIRECTIONS = {"left": 0, "stay": 1, "right": 2}
PROMPT = (
    "Play Catch. A ball falls one row per move on a {rows}x{cols} grid; your paddle (=) is on the "
    "bottom row. Call the move tool with direction left, stay or right once per row until the ball "
    "(o) reaches the bottom. Catch it to win."
)


def make_dataset(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prompt = [{"role": "user", "content": PROMPT.format(rows=ROWS, cols=COLS)}]
    return [{"prompt": prompt, "seed": rng.randrange(2**31)} for _ in range(n)]


def render(info_state: list[float], rows: int = ROWS, cols: int = COLS) -> str:
    """Board text from OpenSpiel's catch info_state (one-hot ball and paddle cells, row-major)."""
    cells = ["." if v == 0 else "#" for v in info_state[: rows * cols]]
    lines = []
    for r in range(rows):
        row = cells[r * cols : (r + 1) * cols]
        glyph = "=" if r == rows - 1 else "o"
        lines.append("".join(glyph if c == "#" else "." for c in row))
    return "\n".join(lines)


def ball_column(seed: int) -> int:
    """The start column OpenSpiel's rl_environment draws after `env.seed(seed)` (uniform chance node)."""
    import numpy as np

    return int(np.random.RandomState(seed % (2**32)).choice(list(range(COLS)), p=[1.0 / COLS] * COLS))


def demo_calls(row: dict) -> list[tuple[str, dict]]:
    """The expert: walk to the ball's column, then stay (ROWS - 1 moves in all)."""
    dx = ball_column(row["seed"]) - COLS // 2
    moves = ["right" if dx > 0 else "left"] * abs(dx)
    moves += ["stay"] * (ROWS - 1 - len(moves))
    return [("move", {"direction": m}) for m in moves]


def baseline_action(rng: random.Random, observation_text: str) -> tuple[str, dict]:
    return ("move", {"direction": rng.choice(list(DIRECTIONS))})
