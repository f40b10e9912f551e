"""What every stack command does first: check the host, read .env once, probe the GPUs, make the plan
(tools/plan.py), write the generated compose file from it. `prepare()` -> Prepared (the plan + the environment
Compose runs with); the commands execute it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from contract.config import TrainModeVariant
from tools import compose_file, derive, docker_host, env_ports, settings
from tools.env_kinds import env_kinds
from tools.errors import StackError, say
from tools.images import TRAINER_CPU_BUILD
from tools.plan import StackPlan, make_plan, rehearsal_plan


@dataclass
class Prepared:
    plan: StackPlan
    compose_vars: dict[str, str]  # the environment every `docker compose` call of this stack runs with

    @property
    def mode(self) -> TrainModeVariant:
        return self.plan.mode

    def compose(self, *args: str, extra_profiles: tuple[str, ...] = ()) -> int:
        return docker_host.compose(self.compose_vars, *args, extra_profiles=extra_profiles)

    def build(self, *services: str, extra_profiles: tuple[str, ...] = (), quiet: bool = False) -> int:
        """`docker compose build` of these build services, unless each is vouched fresh (docker_host.built_fresh)."""
        if docker_host.built_fresh(self.compose_vars, services, extra_profiles):
            return 0
        return self.compose(*(("--progress", "quiet") if quiet else ()), "build", *services, extra_profiles=extra_profiles)

    def read_ports_again(self) -> None:
        """The env servers' ports once images the plan did not find are here (`make up` pulled them, or deployed the
        fleet): what their EXPOSE says, into the plan and the environment Compose runs with (the generated file
        interpolates them)."""
        ports, lines = env_ports.resolve(self.plan.envs, self.plan.values, docker_host.exposed_ports(self.plan.envs))
        for line in lines:
            if line not in self.plan.notes:
                say(line)
        self.plan = dataclasses.replace(self.plan, ports=ports)
        self.compose_vars.update(env_ports.compose_vars(ports))


def compose_vars_for(plan: StackPlan, name: str = "compose.envs") -> dict[str, str]:
    """Write the plan's generated compose file (.stack/<name>.yaml); the environment Compose runs the stack with."""
    return plan.compose_vars(compose_file.write_compose_files(plan.generated_compose(), name))


def prepare(rehearse: bool = False) -> Prepared:
    """Everything `make up/train` needs before Compose runs. `rehearse`: `make rehearse`'s plan (mode gpu's services
    on CPU, no GPU probed), written to a generated file of its own."""
    docker_host.setup()
    for problem in (docker_host.check_docker(), docker_host.check_compose()):
        if problem:
            raise StackError(problem)
    dotenv = settings.load()
    exposed = docker_host.exposed_ports(env_kinds(dotenv.values))  # the env images' ports (tools/env_ports.py)
    if rehearse:
        plan = rehearsal_plan(dotenv, exposed)
        for line in (plan.why, *plan.notes):
            say(line)
        return Prepared(plan, compose_vars_for(plan, "compose.rehearse"))
    gpus = docker_host.detect_gpus() if dotenv.TRAIN_MODE.strip().lower() != "cpu" else None
    if gpus is not None:  # TRAIN_MODE=gpu/colocate/auto: the driver against VLLM_IMAGE's CUDA, before any pull
        docker_host.check_gpu_driver(dotenv.values, gpus)
    plan = make_plan(dotenv, gpus, exposed)
    say(plan.why)
    for note in plan.notes:
        say(note)
    return Prepared(plan, compose_vars_for(plan))


def run_in_cpu_trainer(prepared: Prepared, *args: str, run_options: tuple[str, ...] = ()) -> int:
    """A one-off `python3 -m ...` in the CPU trainer image with the outputs volume mounted (reading runs: rollouts,
    eval on the CPU profile, report, baseline); the image is built quietly first, as GPU hosts do not build it
    otherwise. `run_options`: more `docker compose run` options (a user, a mount)."""
    prepared.build(TRAINER_CPU_BUILD, extra_profiles=("build",), quiet=True)
    return prepared.compose("run", "--rm", "--no-deps", *run_options, "trainer-cpu", *docker_host.TRAINER_PYTHON, *args)
