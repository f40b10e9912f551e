"""TRL's own rendezvous and weight push into the running vllm service (trainer.sync_check, in the trainer
service): `make nccl-check FULL=1`."""

from __future__ import annotations

import json
import subprocess

from tools import docker_host, settings
from tools.errors import StackError
from tools.prepare import Prepared, prepare


def sync_check(prepared: Prepared) -> int:
    mode, compose_vars = prepared.mode, prepared.compose_vars
    if not prepared.plan.spec.runs_vllm_service:
        raise StackError(f"nccl-check --full pushes weights into the vllm service, which runs with TRAIN_MODE=gpu "
                               f"(this host resolves to {mode}: {docker_host.detect_gpus().detail}); set TRAIN_MODE=gpu on a "
                               "2-GPU host")
    cmd, env = docker_host.compose_command(compose_vars, "ps", "--format", "json", "vllm")
    r = subprocess.run(cmd, cwd=settings.ROOT, env=env, capture_output=True, text=True)
    states = [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]
    if not any(s.get("Health") == "healthy" for s in states):
        raise StackError("the vllm service is not running and healthy: start the stack first (`make up`), then "
                               "run `make nccl-check FULL=1` again")
    return prepared.compose("run", "--rm", "--no-deps", "trainer", *docker_host.TRAINER_PYTHON, "-m",
                         "trainer.sync_check")


def run(rest: list[str]) -> int:
    return sync_check(prepare())
