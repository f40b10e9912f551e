"""The host commands the Makefile runs: `python -m tools COMMAND` (tools/__main__.py).

    python -m tools {setup|mode|profiles|build|up|train [ARGS]|smoke [--gpu]|compose ARGS...|doctor|sync-check|
                     nccl-check [--full]|rollouts [--run R] [--step N]|fleet {up|ps|logs|down}}

Each command is a function here, listed once in COMMANDS; what the stack is (settings, services, compose files,
checks) comes from tools/stack.py, the Swarm fleet from tools/fleet.py. Nothing below imports this module.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Callable

from envs import naming
from tools import commands, fleet, gpu_doctor, gpu_layout, stack
from tools.prepare import prepare as cmd_prepare  # stack.* stays qualified: one module, patchable in tests


# ------------------------------------------------------------------ commands
def cmd_build(cenv: dict[str, str], mode: str) -> None:
    env = stack.load_env()
    services = stack.images_to_build(env, mode)
    stack.say("building images: " + ", ".join(services) + " (cached after the first time)")
    if stack.compose(cenv, "build", *services, extra_profiles=("build", "build-gpu")) != 0:
        raise stack.StackError("image build failed (see the output above); `make doctor` checks the usual causes")
    if mode != "cpu":  # VLLM_IMAGE is here now: its own CUDA_VERSION against the driver
        stack.check_gpu_driver(env, stack.detect_gpus())


def long_running_services(env: dict[str, str], mode: str) -> list[str]:
    from envs import registry

    custom = stack.custom_envs(env)  # an env only in ENV_URLS runs elsewhere: no service here
    services = [] if stack.fleet_mode(env) else [naming.service_name(n) for n in stack.env_names(env) if registry.is_builtin(n) or n in custom]
    if mode == "gpu":
        services.append("vllm")
    return services


def cmd_up(cenv: dict[str, str], mode: str) -> None:
    env = stack.load_env()
    if stack.fleet_mode(env):
        fleet_role(env)  # no swarm: stack.say so before any build
    cmd_build(cenv, mode)
    processes = int(cenv.get("TRAINER_PROCESSES") or env.get("TRAINER_PROCESSES") or 1)  # each opens its sessions
    if stack.fleet_mode(env):
        fleet_up(env, mode, processes)
    services = long_running_services(env, mode)
    if dashboard_wanted(env):
        problem = stack.check_port(env, "DASHBOARD_PORT")
        if problem:
            raise stack.StackError(problem)
        services.append("dashboard")
        cenv = {**cenv, "COMPOSE_PROFILES": cenv["COMPOSE_PROFILES"] + ",dashboard"}
    if not stack.fleet_mode(env):
        stack.check_custom_images(env)
        cenv.update(stack.resolve_auto_replicas(env, mode, processes))  # in place: later stack.compose calls keep the scale
    if not services:
        return
    stack.say("starting " + ", ".join(services) + " and waiting until healthy")
    if stack.compose(cenv, "up", "-d", "--wait", *services) != 0:
        custom = stack.unhealthy_custom_envs(cenv, env)
        raise stack.StackError("; ".join(custom) if custom else
                         "some services did not become healthy: `make ps` and `make logs` show why; "
                         "`make doctor` checks the usual causes")


def fleet_role(env: dict[str, str]) -> str:
    """ENV_FLEET=swarm: `manager` (this node deploys the fleet) or `worker` (it joins the fleet's network as it
    is); anything else stops with what to run."""
    role, problem = fleet.swarm_role()
    if role == "manager":
        return role
    if role == "worker" and stack.run(["docker", "network", "inspect", fleet.stack_name(env)]).returncode == 0:
        return role
    raise stack.StackError(f"ENV_FLEET=swarm: {problem}")


def fleet_up(env: dict[str, str], mode: str, processes: int) -> None:
    """ENV_FLEET=swarm: on a manager, deploy or update the fleet (a no-op when .env did not change)."""
    if fleet_role(env) == "manager":
        fleet.cmd_up(env, mode, processes)
    else:
        stack.say(f"fleet {fleet.stack_name(env)}: this node is a worker; joining the fleet's network as it is (a manager "
            "runs make fleet-up)")


def dashboard_wanted(env: dict[str, str]) -> bool:
    return (env.get("DASHBOARD") or "0").strip().lower() in ("1", "true", "yes", "on")


def cmd_dashboard(cenv: dict[str, str], mode: str) -> None:
    env = stack.load_env()
    problem = stack.check_port(env, "DASHBOARD_PORT")
    if problem:
        raise stack.StackError(problem)
    if mode != "cpu":  # the dashboard runs on the CPU trainer image
        stack.compose(cenv, "build", "trainer-cpu-image", extra_profiles=("build",))
    if stack.compose(cenv, "up", "-d", "dashboard", extra_profiles=("dashboard",)) != 0:
        raise stack.StackError("the dashboard did not start: `make logs` shows why")
    stack.say(f"dashboard: http://127.0.0.1:{env.get('DASHBOARD_PORT') or 6006}")


def cmd_train(cenv: dict[str, str], mode: str, args: list[str]) -> int:
    cmd_up(cenv, mode)
    service = "trainer-cpu" if mode == "cpu" else "trainer"
    deps: list[str] = []
    if mode == "cpu":  # the init job in the foreground, so its messages (e.g. an env's bad schema) are seen
        rc = stack.compose(cenv, "run", "--rm", "model-init")
        if rc != 0:
            stack.say(f"the CPU profile's model-init job failed (exit {rc}); the messages above say why")
            return rc
        deps = ["--no-deps"]  # env servers are up and healthy (above), the model is made
    stack.say(f"training with `{service}` (mode {mode}); outputs go to the `outputs` volume")
    rc = stack.compose(cenv, "run", "--rm", *deps, service, *([*stack.TRAINER_PYTHON, "-m", "trainer.launch", *args] if args else []))
    where = "the CPU profile (tiny local model, no vLLM)" if mode == "cpu" else f"mode {mode}"
    if rc == 0:
        stack.say(f"training finished on {where}; `make report` plots it, `make dashboard` shows it live")
    else:
        stack.say(f"training on {where} stopped with exit code {rc}; the messages above say why. "
            "`make train` again resumes from the last checkpoint")
    return rc


def cmd_sync_check(cenv: dict[str, str], mode: str) -> int:
    """`make nccl-check FULL=1`: trainer.gpu.sync_check in the trainer service, against the running vllm."""
    if mode != "gpu":
        raise stack.StackError(f"nccl-check --full pushes weights into the vllm service, which runs with TRAIN_MODE=gpu "
                         f"(this host resolves to {mode}: {stack.detect_gpus().detail}); set TRAIN_MODE=gpu on a 2-GPU host")
    cmd, env = stack.compose_command(cenv, "ps", "--format", "json", "vllm")
    r = subprocess.run(cmd, cwd=stack.ROOT, env=env, capture_output=True, text=True)
    states = [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]
    if not any(s.get("Health") == "healthy" for s in states):
        raise stack.StackError("the vllm service is not running and healthy: start the stack first (`make up`), then "
                         "run `make nccl-check FULL=1` again")
    return stack.compose(cenv, "run", "--rm", "--no-deps", "trainer", *stack.TRAINER_PYTHON, "-m", "trainer.gpu.sync_check")


# ------------------------------------------------------------------ smoke stack.run
SMOKE_STEPS = 3
# (stage, what it proves, what a failure usually means); README "First stack.run on a GPU host" has the same list.
SMOKE_STAGES = {
    "model_download": ("model download", "MODEL_NAME at MODEL_REVISION fetched, chat template checked",
                       "MODEL_NAME / MODEL_REVISION / HF token (a gated model), or the chat template TRL cannot train"),
    "vllm_healthy": ("vLLM healthy", "the vllm service serves the model with dev mode + NCCL weight transfer",
                     "`make logs`: out of GPU memory (VLLM_GPU_MEMORY_UTILIZATION, VLLM_MAX_MODEL_LEN), driver"),
    "rendezvous": ("rendezvous", "trainer (rank 0) and the vLLM workers formed the NCCL group",
                   "network between the containers, VLLM_HOST_IP, NCCL_SOCKET_IFNAME; run `make nccl-check`"),
    "first_generation": ("first generation", "rollouts generated, tool calls sent to the env servers",
                         "env servers (capacity, health) or generation; the trainer log says which"),
    "first_optimizer_step": ("first optimizer step", "loss, backward and AdamW step on the trainer's device",
                             "trainer GPU memory (PER_DEVICE_TRAIN_BATCH_SIZE, MAX_COMPLETION_LENGTH)"),
    "first_weight_sync": ("first weight sync", "new weights pushed into vLLM (seconds)",
                          "NCCL transport; `make nccl-check FULL=1` repeats it with timings"),
    "tool_calls": ("tool calls per episode", "the model calls the env's tools (> 0)",
                   "0: the model never calls a tool (chat template, ENABLE_THINKING, MAX_COMPLETION_LENGTH)"),
}
SMOKE_STAGES_BY_MODE = {
    "gpu": ["model_download", "vllm_healthy", "rendezvous", "first_generation", "first_optimizer_step",
            "first_weight_sync", "tool_calls"],
    "colocate": ["model_download", "first_generation", "first_optimizer_step", "first_weight_sync", "tool_calls"],
    "cpu": ["first_generation", "first_optimizer_step", "tool_calls"],
}


def smoke_table(mode: str, found: dict[str, dict], failed_rc: int | None) -> tuple[list[str], bool]:
    """The smoke run's verdict, one line per stage: pass with its time, or FAIL with what it usually means."""
    lines, ok = [], True
    for key in SMOKE_STAGES_BY_MODE[mode]:
        title, proves, meaning = SMOKE_STAGES[key]
        record = found.get(key)
        passed = record is not None and (key != "tool_calls" or (record.get("value") or 0) > 0)
        if passed:
            took = f" {record['seconds']:.1f}s" if record.get("seconds") is not None else ""
            detail = record.get("detail") or proves
            lines.append(f"  pass {title:<24}{took:>9}  {detail}")
        else:
            ok = False
            why = "never reached" if record is None else (record.get("detail") or "failed")
            lines.append(f"  FAIL {title:<24}{'':>9}  {why}: {meaning}")
    if failed_rc not in (None, 0):
        ok = False
        lines.append(f"  FAIL {'trainer exit':<24}{'':>9}  exit code {failed_rc}: the trainer log above says why")
    return lines, ok


def run_logged(cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Run, echo every line as it comes, and keep the text for the stage records."""
    proc = subprocess.Popen(cmd, cwd=stack.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1)
    seen = []
    assert proc.stdout is not None
    for line in proc.stdout:
        print(line, end="", flush=True)
        seen.append(line)
    return proc.wait(), "".join(seen)


def cmd_smoke(cenv: dict[str, str], mode: str, require_gpu: bool) -> int:
    """`make gpu-smoke`: 3 training steps, then pass/FAIL with timings for every stage a first run goes
    through. `--gpu` refuses to stand in the CPU profile for the GPU path."""
    from trainer import stages

    if require_gpu and mode == "cpu":
        raise stack.StackError(f"make gpu-smoke checks the GPU path, and this host has {stack.detect_gpus().detail}; "
                         "`make doctor` says why, `make train` trains on the CPU profile here")
    log_text, t0 = "", time.monotonic()
    if mode != "cpu":
        stack.say("stage: model download (model-download job)")
        rc, text = run_logged(stack.compose_command(cenv, "run", "--rm", "-T", "model-download")[0], cenv)
        log_text += text
        if rc != 0:
            lines, _ = smoke_table(mode, stages.parse(log_text), rc)
            print("\n".join(["[stack] gpu-smoke: model download failed", *lines]))
            return rc
    cmd_up(cenv, mode)
    service = "trainer-cpu" if mode == "cpu" else "trainer"
    if mode == "cpu":
        rc, text = run_logged(stack.compose_command(cenv, "run", "--rm", "-T", "model-init")[0], cenv)
        if rc != 0:
            stack.say(f"the CPU profile's model-init job failed (exit {rc}); the messages above say why")
            return rc
    args = [*stack.TRAINER_PYTHON, "-m", "trainer.launch", "--max-steps", str(SMOKE_STEPS), "--run-name", f"smoke-{mode}",
            "--resume", "fresh"]
    stack.say(f"stage: {SMOKE_STEPS} training steps with `{service}` (mode {mode}), run smoke-{mode}")
    rc, text = run_logged(stack.compose_command(cenv, "run", "--rm", "-T", "--no-deps", service, *args)[0], cenv)
    lines, ok = smoke_table(mode, stages.parse(log_text + text), rc)
    print(f"[stack] smoke run, mode {mode}, {time.monotonic() - t0:.0f}s in all:")
    print("\n".join(lines))
    print("[stack] smoke: " + ("PASSED: a real run will go through the same stages" if ok else
                               "FAILED: see the first FAIL line and README 'First run on a GPU host'"))
    return 0 if ok else 1


def cmd_doctor() -> int:
    """Report every problem at once, each with its fix."""
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
    if not stack.ENV_FILE.exists():
        print("  note .env: not created yet; checking .env.example (`make up` creates .env)")
    try:
        env = stack.load_env()
    except stack.StackError:
        return 2
    gpus = stack.detect_gpus() if not docker else gpu_doctor.DockerGpus(None, [], "docker not answering")
    report("GPUs for containers", None, gpus.detail)
    mode = "cpu"
    try:
        mode, why = stack.resolve_mode(env, gpus)
        report("TRAIN_MODE", None, why)
    except stack.StackError:
        ok = False
    try:
        report("ENV_NAME", None, ", ".join(stack.env_names(env)))
    except stack.StackError:
        ok = False
    report(".env values", stack.validate_run_config(env, mode))
    report("HF token file", stack.check_token_file(env), "readable by the containers' user")
    report("DASHBOARD_PORT", stack.check_port(env, "DASHBOARD_PORT"), f"{env.get('DASHBOARD_PORT', '6006')} free")
    if stack.fleet_mode(env):
        report("ENV_FLEET=swarm", fleet.swarm_problem(), f"this node manages the swarm; fleet {fleet.stack_name(env)}")
    if mode in ("gpu", "colocate") or gpus.count:  # the GPUs detected above, not a second probe
        ok = gpu_doctor.print_report(gpus, env) and ok
    print("all good" if ok else "doctor found problems: fix the FAIL lines above")
    return 0 if ok else 1


def run_setup(rest: list[str]) -> int:
    stack.setup()
    return 0


def print_mode(rest: list[str]) -> int:
    print(cmd_prepare()[1])
    return 0


def print_profiles(rest: list[str]) -> int:
    print(cmd_prepare()[0]["COMPOSE_PROFILES"])
    return 0


def run_compose(rest: list[str]) -> int:
    return stack.compose(cmd_prepare()[0], *rest)


def with_plan(command: Callable[[dict[str, str], str], object]) -> Callable[[list[str]], int]:
    """A command that needs the prepared stack (compose environment + mode) and takes no arguments."""
    def run_it(rest: list[str]) -> int:
        result = command(*cmd_prepare())
        return result if isinstance(result, int) else 0
    return run_it


def run_nccl_check(rest: list[str]) -> int:
    """NCCL between the two images (tools/nccl_check.py); --full: TRL's own rendezvous and weight push, in the trainer
    service against the running vllm (trainer.gpu.sync_check)."""
    if "--full" in rest:
        return cmd_sync_check(*cmd_prepare())
    from tools import nccl_check

    return nccl_check.main(rest)


def run_fleet(rest: list[str]) -> int:
    stack.setup()
    return fleet.main(rest)


# The one list of host commands: name -> function(argv rest) -> exit code. A new command is a function and a line.
COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "setup": run_setup,
    "mode": print_mode,
    "profiles": print_profiles,
    "compose": run_compose,
    "build": with_plan(cmd_build),
    "up": with_plan(cmd_up),
    "dashboard": with_plan(cmd_dashboard),
    "train": lambda rest: cmd_train(*cmd_prepare(), rest),
    "sync-check": with_plan(cmd_sync_check),
    "nccl-check": run_nccl_check,
    "smoke": lambda rest: cmd_smoke(*cmd_prepare(), require_gpu="--gpu" in rest),
    "doctor": lambda rest: cmd_doctor(),
    "fleet": run_fleet,
}


def main(argv: list[str]) -> int:
    if argv and argv[0] in COMMANDS:
        return COMMANDS[argv[0]](argv[1:])
    module = commands.load(argv[0]) if argv else None
    if module is None:
        print(__doc__)
        return 2
    return module.run(argv[1:])
