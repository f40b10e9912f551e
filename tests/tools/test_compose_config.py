"""The resolved Compose config (`docker compose --env-file .env.example config`), parsed, not grepped."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import ROOT
from tests.helpers import compose_config as resolved

pytestmark = pytest.mark.usefixtures("docker_cli")


@pytest.fixture(scope="module")
def docker_cli():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` (v2) is missing: run `bash .ci/provision`")


@pytest.fixture(scope="module")
def gpu() -> dict:
    return resolved("gpu", "echo", "wordle", "catch")


@pytest.fixture(scope="module")
def cpu() -> dict:
    return resolved("cpu", "echo")


def gpu_ids(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert [d["driver"] for d in devices] == ["nvidia"]
    assert ["gpu"] in [d["capabilities"] for d in devices]
    return [i for d in devices for i in d["device_ids"]]


def test_gpu_stack_pins_vllm_to_gpu0_and_trainer_to_gpu1(gpu):
    assert gpu_ids(gpu["services"]["vllm"]) == ["0"]
    assert gpu_ids(gpu["services"]["trainer"]) == ["1"]


def test_gpu_stack_start_up_is_health_gated(gpu):
    deps = gpu["services"]["trainer"]["depends_on"]
    assert deps["vllm"]["condition"] == "service_healthy"
    for env in ("env-echo", "env-wordle", "env-catch"):
        assert deps[env]["condition"] == "service_healthy"
        assert gpu["services"][env]["healthcheck"]["test"]
        # an upstream image compiling its packages at every start (no bytecode, read-only root) took 144 s with 8
        # replicas at once on 2 busy cores: the start's failing checks do not count for that long
        assert _seconds(gpu["services"][env]["healthcheck"]["start_period"]) >= 180
    assert gpu["services"]["vllm"]["depends_on"]["model-download"]["condition"] == "service_completed_successfully"
    hc = gpu["services"]["vllm"]["healthcheck"]
    assert "/health" in " ".join(hc["test"])
    # vLLM takes minutes to load a model: the start period must allow for that.
    assert _seconds(hc["start_period"]) >= 600


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1}
    total, num = 0.0, ""
    for ch in duration:
        if ch.isdigit() or ch == ".":
            num += ch
        elif ch in units:
            total += float(num) * units[ch]
            num = ""
    return total


def test_two_private_networks_and_only_the_trainers_on_both(gpu, cpu):
    for cfg in (gpu, cpu):
        assert set(cfg["networks"]) == {"agentnet", "envnet"}
        both = {name for name, s in cfg["services"].items() if {"agentnet", "envnet"} <= set(s.get("networks", {}))}
        assert both == {"trainer", "trainer-cpu"} & set(cfg["services"]), both
        for name, s in cfg["services"].items():
            if name.startswith("env-"):
                assert set(s["networks"]) == {"envnet"}, name


def test_vllm_runs_trl_server_mode_flags(gpu):
    vllm = gpu["services"]["vllm"]
    assert vllm["image"] == "vllm/vllm-openai:v0.31.0"
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    args = vllm["command"]
    flags = dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)
    assert json.loads(flags["--weight-transfer-config"]) == {"backend": "nccl"}
    assert flags["--logprobs-mode"] == "processed_logprobs"
    assert flags["--max-logprobs"] == "-1"
    # the image's ENTRYPOINT `vllm serve`, restated so the model can be its positional argument before the flags
    assert vllm["entrypoint"] == ["vllm", "serve", "Qwen/Qwen3-0.6B"]
    assert vllm.get("shm_size") or vllm.get("ipc") == "host"


def test_nothing_published_beyond_loopback(gpu, cpu):
    for cfg in (gpu, cpu, resolved("cpu", "echo", "dashboard")):
        for name, svc in cfg["services"].items():
            for port in svc.get("ports", []):
                assert port.get("host_ip") == "127.0.0.1", (name, port)


def test_vllm_port_is_not_published(gpu):
    # vLLM's dev routes (/update_weights, /collective_rpc, ...) have no authentication.
    assert not gpu["services"]["vllm"].get("ports")


def test_hf_token_is_a_secret_of_model_download_only_never_an_environment_variable(gpu, cpu):
    assert "hf_token" in gpu["secrets"]
    for cfg in (gpu, cpu):
        for name, svc in cfg["services"].items():
            assert "HF_TOKEN" not in (svc.get("environment") or {}), name
        holders = {name: {s["source"] for s in svc.get("secrets") or []} for name, svc in cfg["services"].items()}
        assert {n for n, h in holders.items() if "hf_token" in h} <= {"model-download"}, holders  # it downloads
        assert {n for n, h in holders.items() if "wandb_api_key" in h} <= {"trainer", "trainer-cpu"}, holders
    assert [s["source"] for s in gpu["services"]["model-download"]["secrets"]] == ["hf_token"]


def test_cpu_stack_has_no_vllm_and_trains_on_the_local_tiny_model(cpu):
    assert "vllm" not in cpu["services"] and "trainer" not in cpu["services"]
    trainer = cpu["services"]["trainer-cpu"]
    assert "deploy" not in trainer or not trainer["deploy"].get("resources", {}).get("reservations")
    assert trainer["environment"]["TRAIN_MODE"] == "cpu"
    assert trainer["environment"]["MODEL_NAME"].startswith("/models/")
    assert trainer["depends_on"]["model-init"]["condition"] == "service_completed_successfully"
    assert trainer["depends_on"]["env-echo"]["condition"] == "service_healthy"
    mounts = {v["target"]: v for v in trainer["volumes"]}
    assert mounts["/outputs"]["type"] == "volume" and mounts["/models"]["read_only"]


def test_env_server_image_capacity_and_replicas_come_from_env_file(tmp_path):
    env = (ROOT / ".env.example").read_text()
    env += "\nENV_ECHO_IMAGE=registry.example/openenv/echo-env:1.2\nMAX_CONCURRENT_ENVS=77\nENV_ECHO_REPLICAS=3\n"
    f = tmp_path / "e.env"
    f.write_text(env)
    svc = resolved("cpu", "echo", env_file=str(f))["services"]["env-echo"]
    assert svc["image"] == "registry.example/openenv/echo-env:1.2"
    assert svc["environment"]["MAX_CONCURRENT_ENVS"] == "77"
    assert svc["deploy"]["replicas"] == 3


def test_openenv_mode_and_web_interface_reach_every_env_server_from_the_env_file(tmp_path):
    """Upstream's create_app and ours read OPENENV_MODE and ENABLE_WEB_INTERFACE from the container's environment: the
    one env-template passes them to built-in and custom-image env servers alike (defaults: simulation, no UI)."""
    default = resolved("cpu", "echo")["services"]["env-echo"]["environment"]
    assert (default["OPENENV_MODE"], default["ENABLE_WEB_INTERFACE"]) == ("simulation", "false")
    f = tmp_path / "e.env"
    for image in ("", "ENV_ECHO_IMAGE=openenv/echo-env:1\n"):  # ours, and an upstream image in its place
        f = tmp_path / "e.env"
        f.write_text((ROOT / ".env.example").read_text() + f"\n{image}OPENENV_MODE=production\nENABLE_WEB_INTERFACE=true\n")
        env = resolved("cpu", "echo", env_file=str(f))["services"]["env-echo"]["environment"]
        assert (env["OPENENV_MODE"], env["ENABLE_WEB_INTERFACE"]) == ("production", "true"), image


def test_env_servers_are_hardened(gpu):
    for name in ("env-echo", "env-wordle", "env-catch"):
        svc = gpu["services"][name]
        assert "no-new-privileges:true" in svc["security_opt"]
        assert svc["mem_limit"] and svc["pids_limit"]


def test_env_servers_publish_and_check_8000_unless_told_otherwise(cpu):
    """ENV_<NAME>_PORT unset and our image: port 8000, on loopback, named to the health check (tools/env_ports.py)."""
    svc = cpu["services"]["env-echo"]
    assert [(p["host_ip"], p["target"]) for p in svc["ports"]] == [("127.0.0.1", 8000)]
    assert svc["environment"]["PORT"] == "8000"
    assert cpu["services"]["trainer-cpu"]["environment"]["ENV_ECHO_PORT"] == "8000"
