"""What every stack command does first: check the host, read .env once, resolve the mode and GPU layout, and
return the environment Compose runs with. `prepare()` -> (compose env, mode)."""

from __future__ import annotations

from tools import gpu_layout, stack


def prepare() -> tuple[dict[str, str], str]:
    """Everything `make up/train` needs before Compose runs; returns (compose env, mode)."""
    stack.setup()
    for problem in (stack.check_docker(), stack.check_compose()):
        if problem:
            raise stack.StackError(problem)
    env = stack.load_env()
    gpus = stack.detect_gpus() if (env.get("TRAIN_MODE") or "auto").lower() != "cpu" else None
    mode, why = stack.resolve_mode(env, gpus)
    if mode != "cpu":
        stack.check_gpu_driver(env, gpus)
    stack.env_names(env)
    problem = stack.validate_run_config(env, mode)
    if problem:
        raise stack.StackError(problem)
    stack.say(why)
    if mode == "colocate":
        trainer_gpu, note = gpu_layout.colocate_trainer_gpu(env.get("TRAINER_GPU"), gpus.count)
        if note:
            env = {**env, "TRAINER_GPU": trainer_gpu}
            stack.say(note)
    layout = stack.gpu_plan(env, mode, gpus)
    if layout is not None:
        stack.say(layout.describe())
        used = len(set(layout.vllm) | set(layout.trainer))
        proposal = gpu_layout.propose_split(gpus.count) if used < gpus.count else None
        if proposal:
            stack.say(f"this host has {gpus.count} GPUs and the run uses {used}; to use all of them set "
                f"VLLM_GPU={proposal[0]} TRAINER_GPU={proposal[1]} VLLM_PARALLEL=data in .env (README \"Every GPU of "
                "a host\")")
    compose_vars = stack.compose_env(env, mode, gpus, layout)
    compose_vars["TRAINER_GPU"] = env.get("TRAINER_GPU") or compose_vars.get("TRAINER_GPU", "")
    return compose_vars, mode


def run_in_cpu_trainer(compose_vars: dict[str, str], *args: str) -> int:
    """A one-off `python3 -m ...` in the CPU trainer image with the outputs volume mounted (reading runs: rollouts,
    eval on the CPU profile, export); the image is built quietly first, as GPU hosts do not build it otherwise."""
    stack.compose(compose_vars, "--progress", "quiet", "build", "trainer-cpu-image", extra_profiles=("build",))
    return stack.compose(compose_vars, "run", "--rm", "--no-deps", "trainer-cpu", *stack.TRAINER_PYTHON, *args)
