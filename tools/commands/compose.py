"""`docker compose ARGS...` on the whole stack: compose.yaml plus the services generated from .env."""

from __future__ import annotations

from tools.prepare import prepare


def run(rest: list[str]) -> int:
    return prepare().compose(*rest)
