"""Print the TRAIN_MODE this host resolves to (cpu, gpu or colocate), after the checks `make up` runs."""

from __future__ import annotations

from tools.prepare import prepare


def run(rest: list[str]) -> int:
    print(prepare().mode)
    return 0
