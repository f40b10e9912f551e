"""`make rehearse`'s plan, resolved by `docker compose config` (no container started): TRAIN_MODE=gpu's services with
the vLLM CPU twin in the vllm service's place, the trainer on CPU with weights by reload, and nothing that needs a GPU
or the Hub. The run itself: tests/gpu_path/test_rehearse_command.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import ROOT
from tools.images import TRAINER_REHEARSE_BUILD, TWIN_BUILD, compose_yaml_services, image_of


def rehearsal_config(tmp_path, monkeypatch, lines: str = "") -> tuple[dict, object]:
    from tools import docker_host, settings
    from tools.plan import rehearsal_plan
    from tools.prepare import compose_vars_for

    env_file = tmp_path / "stack.env"
    env_file.write_text((ROOT / ".env.example").read_text() + lines)
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    plan = rehearsal_plan(settings.load())
    cmd, env = docker_host.compose_command(compose_vars_for(plan, "compose.rehearse"), "config", "--format", "json")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), plan


def test_the_twin_takes_the_vllm_services_place_with_its_flags_on_the_tiny_model(tmp_path, monkeypatch):
    config, plan = rehearsal_config(tmp_path, monkeypatch, "\nTRAIN_MODE=auto\n")
    vllm = config["services"]["vllm"]
    assert plan.mode.name == "gpu" and plan.services == ["env-echo", "vllm"]  # gpu's long-running services, health-gated
    assert vllm["image"] == image_of(TWIN_BUILD) and vllm["entrypoint"] == ["vllm-serve", "/models/tiny-qwen3"]
    flags = vllm["command"]
    assert "--weight-transfer-config={\"backend\":\"nccl\"}" in flags and "--revision=main" in flags
    assert vllm["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert "deploy" not in vllm and "ports" not in vllm  # no GPU; dev routes stay off the host
    assert vllm["depends_on"] == {"model-init": {"condition": "service_completed_successfully", "required": True}}
    mounts = {v["target"]: v for v in vllm["volumes"]}
    assert set(mounts) == {"/models", "/weights"} and all(v["read_only"] for v in mounts.values())


def test_the_trainer_trains_on_cpu_and_pushes_by_reload_through_a_shared_volume(tmp_path, monkeypatch):
    config, plan = rehearsal_config(tmp_path, monkeypatch, "\nTRAINER_PROCESSES=2\nROLLOUTS=sync\n")
    trainer = config["services"]["trainer"]
    env = trainer["environment"]
    assert trainer["image"] == image_of(TRAINER_REHEARSE_BUILD)
    assert (env["TRAIN_MODE"], env["WEIGHT_TRANSFER"], env["WEIGHT_RELOAD_DIR"]) == ("gpu", "reload", "/weights")
    assert env["MODEL_NAME"] == "/models/tiny-qwen3" and env["TRAINER_PROCESSES"] == "2"  # .env's own settings
    assert "deploy" not in trainer
    assert set(trainer["depends_on"]) == {"vllm", "env-echo"}  # not model-download: nothing comes from the Hub
    assert {v["target"]: v.get("read_only", False) for v in trainer["volumes"]}["/weights"] is False
    assert config["volumes"]["weights"]["driver_opts"]["o"].startswith("uid=10001")
    assert "rehearse" in config["services"]["model-init"]["profiles"]
    assert plan.images[-1] == "trainer-rehearse-image" and "vllm-cpu" in plan.build_profiles


def test_a_bad_training_setting_stops_the_rehearsal_with_one_line(tmp_path, monkeypatch, capsys):
    from tools.errors import StackError

    with pytest.raises(StackError) as stop:  # the CLI prints it, once, and exits 2
        rehearsal_config(tmp_path, monkeypatch, "\nNUM_GENERATIONS=3\nPER_DEVICE_TRAIN_BATCH_SIZE=4\n")
    err = str(stop.value).strip().splitlines()
    assert len(err) == 1 and "NUM_GENERATIONS=3" in err[0] and "PER_DEVICE_TRAIN_BATCH_SIZE" in err[0], err


LORA_ASYNC = "\nTRAIN_MODE=auto\nROLLOUTS=async\nLORA_R=8\nMAX_STALENESS=2\n"


def test_lora_async_serves_adapters_with_the_same_flags_in_the_rehearsal_as_on_a_gpu_host(tmp_path, monkeypatch):
    """#32: LORA_R with ROLLOUTS=async syncs the adapter alone, so vLLM serves LoRA: its LoRA flags, the runtime
    adapter routes and the trainer's outputs (read-only, where TRL writes <run dir>/.vllm_lora) come from
    trainer/modeling/lora.py, and the twin of `make rehearse` runs exactly the GPU host's vllm command."""
    from tests.gpu_path.conftest import resolved
    from tests.gpu_path.test_gpu_layouts import host_with

    config, plan = rehearsal_config(tmp_path, monkeypatch, LORA_ASYNC)
    twin = config["services"]["vllm"]
    gpu_host = resolved(tmp_path, monkeypatch, LORA_ASYNC, host_with(2))["vllm"]
    hub_pins = ("--revision=", "--tokenizer-revision=")  # the twin serves a local folder (MODEL_REVISION empty)
    assert [f for f in twin["command"] if not f.startswith(hub_pins)] == \
        [f for f in gpu_host["command"] if not f.startswith(hub_pins)]
    assert len(twin["command"]) == len(compose_yaml_services()["vllm"]["command"]) + 3
    assert twin["command"][-3:] == ["--enable-lora", "--max-lora-rank=8", "--max-loras=4"]  # MAX_STALENESS + 2
    for vllm in (twin, gpu_host):
        assert vllm["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
        outputs = next(v for v in vllm["volumes"] if v["target"] == "/outputs")
        assert outputs["source"] == "outputs" and outputs["read_only"] is True
    assert {v["target"] for v in twin["volumes"]} == {"/models", "/weights", "/outputs"}
    # full fine-tuning, or LoRA with sync rollouts (merged weights pushed): compose.yaml's flags alone
    for lines in ("\nROLLOUTS=async\n", "\nROLLOUTS=sync\nLORA_R=8\n"):
        plain, _ = rehearsal_config(tmp_path, monkeypatch, "\nTRAIN_MODE=auto\n" + lines)
        assert "--enable-lora" not in plain["services"]["vllm"]["command"]
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain["services"]["vllm"]["environment"]


def test_lora_async_with_data_parallel_vllm_stops_with_one_line(tmp_path, monkeypatch, capsys):
    from tests.gpu_path.conftest import resolved
    from tests.gpu_path.test_gpu_layouts import host_with
    from tools.errors import StackError

    with pytest.raises(StackError) as raised:
        resolved(tmp_path, monkeypatch, LORA_ASYNC + "VLLM_GPU=0,1\nTRAINER_GPU=2\nVLLM_PARALLEL=data\n", host_with(3))
    err = str(raised.value).strip().splitlines()  # the CLI prints it once (tools/cli.py)
    assert len(err) == 1 and "LORA_R with ROLLOUTS=async and vLLM data parallel" in err[0], err
    assert "VLLM_PARALLEL=tensor" in err[0]


def test_the_twin_and_the_trainer_get_cpu_sets_of_their_own_only_when_asked(tmp_path, monkeypatch):
    """Two emulated devices (make bench-async --cpusets): REHEARSE_VLLM_CPUSET and REHEARSE_TRAINER_CPUSET become
    Compose's cpuset of the twin and of the trainer; unset, both may use every core (no cpuset key at all)."""
    config, _ = rehearsal_config(tmp_path, monkeypatch)
    assert "cpuset" not in config["services"]["vllm"] and "cpuset" not in config["services"]["trainer"]
    monkeypatch.setenv("REHEARSE_VLLM_CPUSET", "0")
    monkeypatch.setenv("REHEARSE_TRAINER_CPUSET", "1")
    config, _ = rehearsal_config(tmp_path, monkeypatch)
    assert config["services"]["vllm"]["cpuset"] == "0" and config["services"]["trainer"]["cpuset"] == "1"
