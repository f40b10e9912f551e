"""Create what a fresh checkout lacks: .env from .env.example, the empty HF token secret, the local torch wheel."""

from __future__ import annotations

from tools import docker_host


def run(rest: list[str]) -> int:
    docker_host.setup()
    return 0
