"""The images built here: each tag is written once, in compose.yaml (its `x-image-tags`, which the build services
and the services that run them name by alias); host code and tests read a tag from its build service, here."""

from __future__ import annotations

import functools

from tools.settings import ROOT

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


def image_of(build_service: str) -> str:
    """The image a build service of compose.yaml makes."""
    return compose_yaml_services()[build_service]["image"]


def local_env_image() -> str:
    """Our env-server image (built-in envs; an env without ENV_<NAME>_IMAGE)."""
    return image_of(ENV_SERVER_BUILD)
