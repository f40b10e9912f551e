"""Build the images this mode uses (cached after the first time)."""

from __future__ import annotations

from tools import stack
from tools.prepare import prepare


def build(compose_vars: dict[str, str], mode: str) -> None:
    env = stack.load_env()
    services = stack.images_to_build(env, mode)
    stack.say("building images: " + ", ".join(services) + " (cached after the first time)")
    if stack.compose(compose_vars, "build", *services, extra_profiles=("build", "build-gpu")) != 0:
        raise stack.StackError("image build failed (see the output above); `make doctor` checks the usual causes")
    if mode != "cpu":  # VLLM_IMAGE is here now: its own CUDA_VERSION against the driver
        stack.check_gpu_driver(env, stack.detect_gpus())


def run(rest: list[str]) -> int:
    build(*prepare())
    return 0
