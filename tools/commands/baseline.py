"""Play each env with a random/scripted policy; print mean reward and episode length (trainer.baseline)."""

from __future__ import annotations

from tools.commands.up import bring_up
from tools.prepare import prepare, run_in_cpu_trainer


def run(rest: list[str]) -> int:
    prepared = prepare()
    bring_up(prepared)  # the episodes are played on the run's env servers
    return run_in_cpu_trainer(prepared, "-m", "trainer.baseline", *rest)
