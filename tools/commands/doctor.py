"""Check Docker, Compose, the NVIDIA runtime and GPUs, ports and .env values; report every problem at once, each
with its fix."""

from __future__ import annotations

import shutil

from tools import fleet, gpu_doctor, settings, stack

def run(rest: list[str]) -> int:
    ok = True

    def report(name: str, problem: str | None, fine: str = "ok") -> None:
        nonlocal ok
        ok = ok and problem is None
        print(f"  {'FAIL' if problem else 'ok  '} {name}: {problem or fine}")

    print("make doctor")
    docker = stack.check_docker()
    report("docker engine", docker, stack.run(["docker", "info", "--format", "{{.ServerVersion}}"]).stdout.strip())
    report("compose v2", stack.check_compose() if not docker or shutil.which("docker") else docker,
           stack.run(["docker", "compose", "version", "--short"]).stdout.strip())
    exposure = None if docker else stack.check_loopback_guarantee()
    if exposure:  # a warning, not a failure: the stack still works, and the fix is the host's (SECURITY.md)
        print(f"  WARN docker loopback ports: {exposure}")
    if not settings.ENV_FILE.exists():
        print("  note .env: not created yet; checking .env.example (`make up` creates .env)")
    try:
        dotenv = settings.load_env()
    except stack.StackError:
        return 2
    gpus = stack.detect_gpus() if not docker else gpu_doctor.DockerGpus(None, [], "docker not answering")
    report("GPUs for containers", None, gpus.detail)
    mode = "cpu"
    try:
        mode, why = stack.resolve_mode(dotenv, gpus)
        report("TRAIN_MODE", None, why)
    except stack.StackError:
        ok = False
    try:
        report("ENV_NAME", None, ", ".join(stack.env_names(dotenv)))
    except stack.StackError:
        ok = False
    report(".env values", stack.validate_run_config(dotenv, mode))
    report("HF token file", stack.check_token_file(dotenv), "readable by the containers' user")
    report("DASHBOARD_PORT", stack.check_port(dotenv, "DASHBOARD_PORT"), f"{dotenv.get('DASHBOARD_PORT', '6006')} free")
    if stack.fleet_mode(dotenv):
        report("ENV_FLEET=swarm", fleet.swarm_problem(), f"this node manages the swarm; fleet {fleet.stack_name(dotenv)}")
    if mode in ("gpu", "colocate") or gpus.count:  # the GPUs detected above, not a second probe
        ok = gpu_doctor.print_report(gpus, dotenv) and ok
    if mode in ("gpu", "colocate") and gpus.count:
        ok = trainer_memory(gpus, dotenv, mode) and ok
    print("all good" if ok else "doctor found problems: fix the FAIL lines above")
    return 0 if ok else 1


def trainer_memory(gpus: gpu_doctor.DockerGpus, dotenv: dict[str, str], mode: str) -> bool:
    """The trainer's memory for the model and layout next to each trainer GPU's (contract.memory); False: cannot fit."""
    try:
        cfg = stack.run_config(dotenv, mode)
    except Exception:  # noqa: BLE001 - a bad .env is reported by the `.env values` row
        return True
    config, where = gpu_doctor.model_config(cfg)
    rows = gpu_doctor.memory_rows(gpus.gpus, dotenv, mode, cfg, config, where)
    for fine, name, msg in rows:
        print(f"  {'ok  ' if fine else 'FAIL'} {name}: {msg}")
    return all(fine for fine, _, _ in rows)
