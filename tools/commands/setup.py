"""Create what a fresh checkout lacks: .env from .env.example, the empty HF token secret, the local torch wheel."""

from __future__ import annotations

from tools import stack


def run(rest: list[str]) -> int:
    stack.setup()
    return 0
