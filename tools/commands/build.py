"""Build the images this mode uses (cached after the first time)."""

from __future__ import annotations

from tools import stack
from tools.prepare import Prepared, prepare


def first_builds(services: list[str]) -> list[str]:
    """The images among these build services that are not on this machine yet."""
    images = [stack.compose_yaml_services()[s]["image"] for s in services]
    return [i for i in images if stack.run(["docker", "image", "inspect", "--", i]).returncode != 0]


def build(prepared: Prepared) -> None:
    plan = prepared.plan
    stack.say("building images: " + ", ".join(plan.images) + " (cached after the first time)")
    first = first_builds(plan.images)
    if first:  # Docker shows each step and its time as it goes; only the first build is long
        stack.say(f"first build of {', '.join(first)}: a few minutes (base image, then pip installs; the CPU trainer "
                  "image is the longest, about 5 min on 2 cores); later builds take seconds")
    if prepared.compose("build", *plan.images, extra_profiles=("build", "build-gpu")) != 0:
        raise stack.StackError("image build failed (see the output above); `make doctor` checks the usual causes")
    if plan.mode != "cpu":  # VLLM_IMAGE is here now: its own CUDA_VERSION against the driver
        stack.check_gpu_driver(plan.values, stack.detect_gpus())


def run(rest: list[str]) -> int:
    build(prepare())
    return 0
