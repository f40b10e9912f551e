"""Print a run's traced rollouts: `rollouts [--run R] [--step N]` (trainer.rollouts, reading the outputs volume)."""

from __future__ import annotations

from tools.prepare import prepare, run_in_cpu_trainer


def run(rest: list[str]) -> int:
    compose_vars, _ = prepare()
    return run_in_cpu_trainer(compose_vars, "-m", "trainer.rollouts", "--outputs", "/outputs", *rest)
