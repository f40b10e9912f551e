"""#67 items 1, 3, 4, 5, on the CPU: VLLM_EXTRA_ARGS (contract/vllm_flags.py) reaches the vllm service, its CPU twin
and colocate's engine, and never a flag the stack relies on; NO_PROXY on every container that talks to another, and
`make doctor`'s proxy line; CUDA forward compatibility for datacenter GPUs on R535-R570; colocate's vLLM variables and
compile-cache volume. The stack as `docker compose config` resolves it (no engine needed), with the plan's file."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from contract import vllm_flags
from contract.config import ConfigError, RunConfig
from tests.helpers import ROOT, compose_config, compose_file_args
from tools import compose_file, gpu_doctor, proxies
from tools.errors import StackError
from tools.gpu_doctor import DockerGpus, Gpu
from tools.images import compose_yaml_services

H100 = "NVIDIA H100 80GB HBM3"


def gpus(name: str = H100, driver: str = "580.95.05", n: int = 2) -> DockerGpus:
    return DockerGpus("--gpus all", [Gpu(str(i), f"GPU-{i}", name, 81559, 0, 81559, driver) for i in range(n)])


def resolved(values: dict[str, str], found: DockerGpus | None, *profiles: str, tmp_path) -> dict:
    """The plan's generated file over compose.yaml, as `docker compose config` resolves them."""
    from tools import settings
    from tools.plan import make_plan

    plan = make_plan(values, found)
    path = tmp_path / "compose.envs.yaml"
    path.write_text(compose_file.yaml_text(plan.generated_compose()))
    cmd = ["docker", "compose", "--env-file", ".env.example", *compose_file_args([ROOT / "compose.yaml", path])]
    for p in profiles or plan.profiles:
        cmd += ["--profile", p]
    out = subprocess.run([*cmd, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert settings  # the plan read nothing from the machine's .env: values only
    return json.loads(out.stdout)["services"]


# ---------------------------------------------------------------------------- 1. VLLM_EXTRA_ARGS
def test_extra_vllm_flags_follow_the_stacks_flags_on_the_vllm_service_and_its_twin(tmp_path):
    services = resolved({"TRAIN_MODE": "gpu", "VLLM_EXTRA_ARGS": "--no-async-scheduling --kv-cache-dtype 'fp8'"},
                        gpus(), "gpu", "echo", "vllm-cpu", tmp_path=tmp_path)
    stack_flags = compose_yaml_services()["vllm"]["command"]
    for name in ("vllm", "vllm-cpu"):
        command = services[name]["command"]
        assert command[-3:] == ["--no-async-scheduling", "--kv-cache-dtype", "fp8"], name
        assert len(command) == len(stack_flags) + 3  # every flag the stack relies on is still there, before them


def test_every_flag_the_stack_sets_is_refused_in_one_line_naming_it(monkeypatch):
    from contract import lora_rules

    cfg = RunConfig.load(["--lora-r", "8", "--rollouts", "async", "--train-mode", "gpu"])
    ours = [*compose_yaml_services()["vllm"]["command"], *lora_rules.vllm_lora_flags(cfg), "--model=x", "-tp 2"]
    for flag in ours:
        name = flag.split("=", 1)[0].split()[0]
        with pytest.raises(ValueError) as refused:
            vllm_flags.parse(f"--enforce-eager {flag.replace('=', ' ', 1)}")
        assert str(refused.value).startswith(name) and "\n" not in str(refused.value), flag
    monkeypatch.setenv("VLLM_EXTRA_ARGS", "--max_model_len=8192")  # vLLM's underscore spelling too
    with pytest.raises(ConfigError, match=r"^VLLM_EXTRA_ARGS: --max_model_len is set by VLLM_MAX_MODEL_LEN"):
        RunConfig.load([])
    monkeypatch.delenv("VLLM_EXTRA_ARGS")
    with pytest.raises(StackError, match="--port is set by the stack"):
        from tools.plan import make_plan

        make_plan({"TRAIN_MODE": "gpu", "VLLM_EXTRA_ARGS": "--port 9000"}, gpus())


def test_colocate_maps_extra_flags_onto_trls_engine_and_refuses_server_only_ones_stand_in_llm(monkeypatch):
    from trl.generation import vllm_generation

    from tools.plan import make_plan
    from trainer.gpu import colocate, grpo_kwargs

    words = vllm_flags.parse("--no-async-scheduling --enforce-eager --max-num-partial-prefills=2 --model-impl vllm")
    assert vllm_flags.engine_kwargs(words) == (
        {"async_scheduling": False, "enforce_eager": True, "max_num_partial_prefills": 2}, {"vllm_model_impl": "vllm"})
    for flag in ("--uvicorn-log-level debug", "--max-num-seqs 8"):
        with pytest.raises(StackError, match=f"^invalid|VLLM_EXTRA_ARGS: {flag.split()[0]}"):
            make_plan({"TRAIN_MODE": "colocate", "VLLM_EXTRA_ARGS": flag}, gpus(n=1))
    monkeypatch.setenv("VLLM_EXTRA_ARGS", "--no-async-scheduling --model-impl transformers")
    cfg = RunConfig.load(["--train-mode", "colocate"])
    assert grpo_kwargs.grpo_vllm_kwargs(cfg)["vllm_model_impl"] == "transformers"
    built = []
    monkeypatch.setattr(vllm_generation, "LLM", lambda **kw: built.append(kw), raising=False)  # stands in for vllm.LLM
    assert colocate.install_engine_args(colocate.extra_flags(cfg)[0])
    vllm_generation.LLM(model="m", seed=0)  # as TRL's VLLMGeneration._init_vllm calls it
    assert built == [{"model": "m", "seed": 0, "async_scheduling": False}]
    assert colocate.install_engine_args({}) and vllm_generation.LLM(model="m") is None and len(built) == 2


def test_gpu_smoke_says_which_scheduler_ran():
    from tools.commands.smoke import scheduler_line

    line = scheduler_line({"vllm_scheduler": {"detail": vllm_flags.scheduler_detail(True, "/server_info", [])}}, {})
    assert "async scheduling, from /server_info" in line and "--no-async-scheduling" in line
    line = scheduler_line({}, {"VLLM_EXTRA_ARGS": "--no-async-scheduling"})
    assert "not reported" in line and "started with --no-async-scheduling" in line


def test_the_server_report_reads_the_scheduler_from_server_info_stand_in_server():
    from trainer.gpu import server

    class Response:
        def __init__(self, body, status=200):
            self.status_code, self._body, self.text = status, body, json.dumps(body)

        def json(self):
            return self._body

    info = {"vllm_config": {"weight_transfer_config": {"backend": "nccl"}, "scheduler_config": {"async_scheduling": True},
                            "model_config": {"dtype": "torch.bfloat16"}}}
    routes = {"/health": {}, "/server_info": info, "/get_world_size": {"world_size": 1}, "/v1/models": {"data": []}}

    class Session:  # stands in for vLLM's HTTP server
        def get(self, url, **kw):
            return Response(routes[url.removeprefix("http://vllm:8000")])

    assert server.check_vllm_server("http://vllm:8000", 5, session=Session()).async_scheduling is True


# ---------------------------------------------------------------------------- 3. proxies
def test_every_container_that_talks_to_another_bypasses_an_injected_proxy_for_the_stacks_names(tmp_path):
    services = resolved({"TRAIN_MODE": "gpu", "ENV_NAME": "echo,catch"}, gpus(), "gpu", "echo", "catch", "cpu",
                        "vllm-cpu", tmp_path=tmp_path)
    for name in ("trainer", "trainer-cpu", "model-init", "vllm", "vllm-cpu"):
        env = services[name]["environment"]
        hosts = set(env["NO_PROXY"].split(","))
        assert env["no_proxy"] == env["NO_PROXY"], name
        assert {"vllm", "trainer", "localhost", "127.0.0.1"} <= hosts, name
        if name in ("trainer", "trainer-cpu", "model-init"):
            assert {"env-echo", "env-catch"} <= hosts, name
    fleet = compose_file.fleet_attachments(__import__("tools.env_kinds", fromlist=["x"]).env_kinds({"ENV_NAME": "echo"}))
    assert "tasks.env-echo" in fleet["trainer"]["environment"]["NO_PROXY"].split(",")


def test_doctor_says_when_docker_injects_proxies_and_that_the_stack_handles_them():
    config = {"proxies": {"default": {"httpProxy": "http://user:secret@proxy.corp:3128", "noProxy": "corp"}}}
    line = proxies.describe(config, {})
    assert "HTTP_PROXY=http://proxy.corp:3128" in line and "secret" not in line and "NO_PROXY" in line
    assert "injects no proxy" in proxies.describe({}, {"HTTPProxy": "http://proxy:80"})
    assert proxies.describe({}, {}) == "no proxy injected into containers"


# ---------------------------------------------------------------------------- 4. older datacenter drivers
def test_datacenter_gpus_on_r535_to_r570_are_offered_cuda_forward_compatibility():
    image, cuda = gpu_doctor.DEFAULT_VLLM_IMAGE, "13.0"
    ok, line = gpu_doctor.check_driver("550.54.15", image, cuda, H100)
    assert not ok and "CUDA_FORWARD_COMPAT=1" in line and "datacenter" in line
    ok, line = gpu_doctor.check_driver("570.86.15", image, cuda, "NVIDIA L40S", compat=True)
    assert ok and "forward compatibility applies and is on" in line
    ok, line = gpu_doctor.check_driver("550.54.15", image, cuda, "NVIDIA GeForce RTX 4090", compat=True)
    assert not ok and "consumer GPUs" in line and "upgrade it to >= 580.65.06" in line
    assert not gpu_doctor.check_driver("525.60.13", image, cuda, "NVIDIA A100-SXM4-80GB", compat=True)[0]  # < R535
    assert not gpu_doctor.check_driver("580.95.05", image, cuda, "NVIDIA GeForce RTX 5090", compat=True)[0]
    assert [gpu_doctor.datacenter_gpu(n) for n in (H100, "NVIDIA H200", "NVIDIA A10G", "Tesla T4", "NVIDIA RTX A6000",
                                                   "NVIDIA GeForce RTX 4090")] == [True, True, True, True, False, False]


def test_forward_compatibility_reaches_the_vllm_service_and_the_trainers_library_path(tmp_path):
    services = resolved({"TRAIN_MODE": "gpu", "CUDA_FORWARD_COMPAT": "1"}, gpus(driver="550.54.15"), "gpu", "echo",
                        tmp_path=tmp_path)
    assert services["vllm"]["environment"]["VLLM_ENABLE_CUDA_COMPATIBILITY"] == "1"
    assert services["trainer"]["environment"]["LD_LIBRARY_PATH"].split(":")[0] == compose_file.CUDA_COMPAT_LIBS
    assert services["trainer"]["environment"]["NVIDIA_DISABLE_REQUIRE"] == "1"  # the CUDA image's own check skipped
    plain = resolved({"TRAIN_MODE": "gpu"}, gpus(), "gpu", "echo", tmp_path=tmp_path)
    assert "VLLM_ENABLE_CUDA_COMPATIBILITY" not in plain["vllm"]["environment"]
    assert "LD_LIBRARY_PATH" not in plain["trainer"]["environment"]


# ---------------------------------------------------------------------------- 5. colocate's vLLM
def test_colocate_trainer_has_vllms_privacy_variables_and_its_compile_cache_on_a_volume():
    trainer = compose_config("colocate", "echo")["services"]["trainer"]
    env = trainer["environment"]
    assert env["VLLM_NO_USAGE_STATS"] == "1" and env["DO_NOT_TRACK"] == "1"
    mounts = {v["target"]: v for v in trainer["volumes"]}
    assert mounts[env["VLLM_CACHE_ROOT"]]["type"] == "volume" and not mounts[env["VLLM_CACHE_ROOT"]].get("read_only")
    dockerfile = (ROOT / "services/trainer/Dockerfile").read_text()
    assert env["VLLM_CACHE_ROOT"] in dockerfile  # made and owned by uid 10001 in the image, so the volume is too
    assert yaml.safe_load((ROOT / "compose.yaml").read_text())["volumes"][mounts[env["VLLM_CACHE_ROOT"]]["source"]
                                                                            .removeprefix("grpo-stack_")] is not None
