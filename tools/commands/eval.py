"""Score a run's checkpoint and its base model on held-out episodes of each env; writes <run>/eval.json.
`eval [--run R] [--checkpoint C] [--tasks N] [--threshold T]`: trainer.evaluate, once the env servers are up."""

from __future__ import annotations

from tools import docker_host
from tools.commands.up import bring_up
from tools.prepare import prepare, run_in_cpu_trainer

EVALUATE = ("-m", "trainer.evaluate", "--outputs", "/outputs")


def run(rest: list[str]) -> int:
    prepared = prepare()
    bring_up(prepared)  # the episodes are played on the run's real env servers
    service = prepared.plan.spec.trainer_service
    if service == "trainer-cpu":
        return run_in_cpu_trainer(prepared, *EVALUATE, *rest)
    # GPU hosts: the trainer image on the trainer's GPU, vLLM inside it (trainer.evaluate); the model is downloaded
    return prepared.compose("run", "--rm", "--no-deps", service, *docker_host.TRAINER_PYTHON, *EVALUATE, *rest)
