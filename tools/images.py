"""The images built here: each tag is written once, in compose.yaml (its `x-image-tags`, which the build services
and the services that run them name by alias); host code and tests read a tag from its build service, here. A tag
starts with the stack's name (STACK_NAME, tools/settings.py): compose.yaml writes it as STACK_REF, which Compose
resolves; image_of resolves it the same way for the calls that name an image themselves."""

from __future__ import annotations

import functools

from tools import settings
from tools.settings import ROOT

STACK_REF = "${STACK_NAME:-grpo-stack}"  # how compose.yaml writes the stack's name (tests/tools/test_two_stacks.py)

# compose.yaml's build services, one per image built here
ENV_SERVER_BUILD = "env-server-image"
TRAINER_CPU_BUILD = "trainer-cpu-image"
TRAINER_GPU_BUILD = "trainer-gpu-image"
TWIN_BUILD = "vllm-cpu"                      # the vLLM CPU twin (profile vllm-cpu)
TRAINER_REHEARSE_BUILD = "trainer-rehearse-image"
BUILT_HERE = (ENV_SERVER_BUILD, TRAINER_CPU_BUILD, TRAINER_GPU_BUILD, TRAINER_REHEARSE_BUILD, TWIN_BUILD)


@functools.lru_cache(maxsize=1)
def compose_yaml_services() -> dict[str, dict]:
    """The services compose.yaml defines, parsed (anchors and merge keys resolved), not searched for as text."""
    import yaml

    return (yaml.safe_load((ROOT / "compose.yaml").read_text()) or {}).get("services") or {}


def image_ref(build_service: str) -> str:
    """The image a build service of compose.yaml makes, as compose.yaml writes it (for a compose file: Compose
    resolves STACK_REF with the STACK_NAME it is given)."""
    return compose_yaml_services()[build_service]["image"]


def image_of(build_service: str, stack_name: str | None = None) -> str:
    """The image a build service of compose.yaml makes, for this stack (`stack_name`, else .env's STACK_NAME or the
    checkout's)."""
    return image_ref(build_service).replace(STACK_REF, stack_name or settings.load().stack_name)


def local_env_image() -> str:
    """Our env-server image (built-in envs; an env without ENV_<NAME>_IMAGE)."""
    return image_of(ENV_SERVER_BUILD)
