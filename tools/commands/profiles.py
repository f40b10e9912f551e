"""Print the Compose profiles this .env and host turn on."""

from __future__ import annotations

from tools.prepare import prepare


def run(rest: list[str]) -> int:
    print(prepare().compose_vars["COMPOSE_PROFILES"])
    return 0
