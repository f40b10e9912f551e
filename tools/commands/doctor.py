"""Check Docker, Compose, the NVIDIA runtime and GPUs, ports and .env values; report every problem at once, each
with its fix."""

from __future__ import annotations

import os
import shutil

from tools import derive, docker_host, env_keys, env_ports, fleet, gpu_doctor, judge, proxies, settings
from tools.env_kinds import env_kinds
from tools.errors import StackError, report_stack_error
from contract.config import CpuMode, TrainModeVariant

def run(rest: list[str]) -> int:
    ok = True

    def report(name: str, problem: str | None, fine: str = "ok") -> None:
        nonlocal ok
        ok = ok and problem is None
        print(f"  {'FAIL' if problem else 'ok  '} {name}: {problem or fine}")

    print("make doctor")
    docker = docker_host.check_docker()
    report("docker engine", docker, docker_host.run(["docker", "info", "--format", "{{.ServerVersion}}"]).stdout.strip())
    report("compose v2", docker_host.check_compose() if not docker or shutil.which("docker") else docker,
           docker_host.run(["docker", "compose", "version", "--short"]).stdout.strip())
    if not docker:
        report("proxies", None, docker_proxies())
    exposure = None if docker else docker_host.check_loopback_guarantee()
    if exposure:  # a warning, not a failure: the stack still works, and the fix is the host's (SECURITY.md)
        print(f"  WARN docker loopback ports: {exposure}")
    if not settings.ENV_FILE.exists():
        print("  note .env: not created yet; checking .env.example (`make up` creates .env)")
    try:
        dotenv = settings.load_env()
    except StackError as exc:
        return report_stack_error(exc)
    for line in env_keys.unread_keys(dotenv):  # a warning: users keep their own variables there too
        print(f"  WARN {line}")
    gpus = docker_host.detect_gpus() if not docker else gpu_doctor.DockerGpus(None, [], "docker not answering")
    report("GPUs for containers", None, gpus.detail)
    mode: TrainModeVariant = CpuMode()
    try:
        mode, why = derive.resolve_mode(dotenv, gpus)
        report("TRAIN_MODE", None, why)
    except StackError as exc:  # its line on stderr, as every host error; doctor goes on to the next check
        report_stack_error(exc)
        ok = False
    try:
        envs = env_kinds(dotenv)
        report("ENV_NAME", None, ", ".join(envs.names))
        ports, lines = env_ports.resolve(envs, dotenv, {} if docker else docker_host.exposed_ports(envs))
        report("env server ports", None, "; ".join(f"{n}: {p}" for n, p in ports.items()) or "none served here")
        for line in lines:
            print(f"  WARN {line}")
    except StackError as exc:
        report_stack_error(exc)
        ok = False
    report(".env values", derive.validate_run_config(dotenv, mode))
    ok = judge_rows(dotenv, mode, gpus) and ok
    report("HF token file", docker_host.check_token_file(dotenv), "readable by the containers' user")
    report("DASHBOARD_PORT", docker_host.check_port(dotenv, "DASHBOARD_PORT"), f"{dotenv.get('DASHBOARD_PORT', '6006')} free")
    if derive.fleet_mode(dotenv):
        report("ENV_FLEET=swarm", fleet.swarm_problem(), f"this node manages the swarm; fleet {fleet.stack_name(dotenv)}")
    if mode.uses_vllm or gpus.count:  # the GPUs detected above, not a second probe
        ok = gpu_doctor.print_report(gpus, dotenv) and ok
    if mode.uses_vllm and gpus.count:
        ok = trainer_memory(gpus, dotenv, mode) and ok
    print("all good" if ok else "doctor found problems: fix the FAIL lines above")
    return 0 if ok else 1


def judge_rows(dotenv: dict[str, str], mode: TrainModeVariant, gpus: gpu_doctor.DockerGpus) -> bool:
    """The judge's lines (tools/judge.py): JUDGE_MODEL/JUDGE_URL, JUDGE_GPU and its split, the key file, the pin.
    False: a FAIL among them."""
    try:
        layout = derive.gpu_layout_for(dotenv, mode, gpus)
    except StackError:  # the GPU rows below name it
        layout = None
    rows = judge.doctor_rows(dotenv, mode, layout, gpus.gpus, on_cpu=not mode.uses_vllm)
    for status, name, msg in rows:
        print(f"  {status:<4} {name}: {msg}")
    return all(status != "FAIL" for status, _, _ in rows)


def docker_proxies() -> str:
    """Whether Docker injects proxies into containers, and that the stack handles them (tools/proxies.py)."""
    import json

    info = docker_host.run(["docker", "info", "--format", "{{json .}}"])
    try:
        parsed = json.loads(info.stdout) if info.returncode == 0 else {}
    except ValueError:
        parsed = {}
    return proxies.describe(proxies.client_config(), parsed if isinstance(parsed, dict) else {},
                            os.environ.get("DOCKER_HOST"))


def trainer_memory(gpus: gpu_doctor.DockerGpus, dotenv: dict[str, str], mode: TrainModeVariant) -> bool:
    """The trainer's memory for the model and layout next to each trainer GPU's (contract.memory); False: cannot fit."""
    try:
        cfg = derive.run_config(dotenv, mode)
    except Exception:  # noqa: BLE001 - a bad .env is reported by the `.env values` row
        return True
    config, where = gpu_doctor.model_config(cfg)
    try:  # colocate: a judge on the trainer's GPU takes its share too (tools/judge.py)
        layout = derive.gpu_layout_for(dotenv, mode, gpus)
    except StackError:
        layout = None
    judge_share = {g.index: judge.trainer_gpu_share(dotenv, mode, layout, g.index) for g in gpus.gpus}
    rows = gpu_doctor.memory_rows(gpus.gpus, dotenv, mode, cfg, config, where, judge_share)
    for fine, name, msg in rows:
        print(f"  {'ok  ' if fine else 'FAIL'} {name}: {msg}")
    return all(fine for fine, _, _ in rows)
