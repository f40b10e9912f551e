"""Print a run's traced rollouts: `rollouts [--run R] [--step N]` (trainer.rollouts, reading the outputs volume)."""

from __future__ import annotations

from tools.prepare import prepare, run_in_cpu_trainer


def run(rest: list[str]) -> int:
    return run_in_cpu_trainer(prepare(), "-m", "trainer.rollouts", "--outputs", "/outputs", *rest)
