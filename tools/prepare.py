"""What every stack command does first: check the host, read .env once, probe the GPUs, make the plan
(tools/plan.py), write the generated compose file from it. `prepare()` -> Prepared (the plan + the environment
Compose runs with); the commands execute it."""

from __future__ import annotations

from dataclasses import dataclass

from tools import settings, stack
from tools.plan import Plan, make_plan, rehearsal_plan


@dataclass
class Prepared:
    plan: Plan
    compose_vars: dict[str, str]  # the environment every `docker compose` call of this stack runs with

    @property
    def mode(self) -> str:
        return self.plan.mode

    def compose(self, *args: str, extra_profiles: tuple[str, ...] = ()) -> int:
        return stack.compose(self.compose_vars, *args, extra_profiles=extra_profiles)


def compose_vars_for(plan: Plan, name: str = "compose.envs") -> dict[str, str]:
    """Write the plan's generated compose file (.stack/<name>.yaml); the environment Compose runs the stack with."""
    return plan.compose_vars(stack.write_compose_files(plan.generated_compose(), name))


def prepare(rehearse: bool = False) -> Prepared:
    """Everything `make up/train` needs before Compose runs. `rehearse`: `make rehearse`'s plan (mode gpu's services
    on CPU, no GPU probed), written to a generated file of its own."""
    stack.setup()
    for problem in (stack.check_docker(), stack.check_compose()):
        if problem:
            raise stack.StackError(problem)
    dotenv = settings.load()
    if rehearse:
        plan = rehearsal_plan(dotenv)
        stack.say(plan.why)
        return Prepared(plan, compose_vars_for(plan, "compose.rehearse"))
    gpus = stack.detect_gpus() if dotenv.TRAIN_MODE.strip().lower() != "cpu" else None
    if gpus is not None:  # TRAIN_MODE=gpu/colocate/auto: the driver against VLLM_IMAGE's CUDA, before any pull
        stack.check_gpu_driver(dotenv.values, gpus)
    plan = make_plan(dotenv, gpus)
    stack.say(plan.why)
    for note in plan.notes:
        stack.say(note)
    return Prepared(plan, compose_vars_for(plan))


def run_in_cpu_trainer(prepared: Prepared, *args: str) -> int:
    """A one-off `python3 -m ...` in the CPU trainer image with the outputs volume mounted (reading runs: rollouts,
    eval on the CPU profile); the image is built quietly first, as GPU hosts do not build it otherwise."""
    prepared.compose("--progress", "quiet", "build", "trainer-cpu-image", extra_profiles=("build",))
    return prepared.compose("run", "--rm", "--no-deps", "trainer-cpu", *stack.TRAINER_PYTHON, *args)
