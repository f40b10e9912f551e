"""The Swarm fleet of env servers: `fleet {up|ps|logs|down}` (tools/fleet.py; README "Across machines")."""

from __future__ import annotations

from tools import fleet, stack


def run(rest: list[str]) -> int:
    stack.setup()
    return fleet.main(rest)
