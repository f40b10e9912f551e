"""The Swarm fleet of env servers: `fleet {up|ps|logs|down}` (tools/fleet.py; docs/fleets.md)."""

from __future__ import annotations

from tools import docker_host, fleet


def run(rest: list[str]) -> int:
    docker_host.setup()
    return fleet.main(rest)
