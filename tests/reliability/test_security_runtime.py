"""Security by default, checked on built images and running containers.

- our images run as a non-root uid (image USER and what `id -u` says inside);
- HF_TOKEN reaches model-download only, as a Compose secret file readable by its non-root user; the trainer
  never gets it (no secret file, nothing in `docker inspect`'s environment or its logs);
- env servers take no filesystem path from clients: path-like values in reset kwargs, actions and
  HTTP routes read nothing (a canary file's content never comes back) and write nothing.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests
from websockets.sync.client import connect

from tests.helpers import ROOT, build_images, write_env_file
from tests.reliability.common import ENV_NAMES, VALID_ACTIONS, assert_structured, report
from tools.images import ENV_SERVER_BUILD, TRAINER_CPU_BUILD, image_of

pytestmark = pytest.mark.docker

IMAGES = {"env-server": image_of(ENV_SERVER_BUILD), "trainer-cpu": image_of(TRAINER_CPU_BUILD)}
DOCKERFILES = {"env-server": "services/env-server/Dockerfile", "trainer-cpu": "services/trainer/Dockerfile.cpu"}


def _need_image(key: str) -> str:
    if not (ROOT / DOCKERFILES[key]).exists():
        pytest.skip(f"{DOCKERFILES[key]} not written yet")
    build_images(key)
    return IMAGES[key]


@pytest.mark.parametrize("key", sorted(IMAGES))
def test_our_images_run_as_non_root(docker, key):
    image = _need_image(key)
    out = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True, check=True)
    user = json.loads(out.stdout)[0]["Config"]["User"]
    assert user and user.split(":")[0] not in ("0", "root"), f"{image} has USER {user!r}"
    uid = subprocess.run(["docker", "run", "--rm", "--entrypoint", "id", image, "-u"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert uid != "0", f"{image} runs as root"
    report(f"security: {image} runs as USER {user} (uid {uid})")


# ------------------------------------------------------------------ HF token
def test_hf_token_never_in_trainer_environment_or_logs(docker, tmp_path):
    image = _need_image("trainer-cpu")
    token = "hf_" + uuid.uuid4().hex + uuid.uuid4().hex[:6]  # dummy, looks like a real one
    # The layout SECURITY.md documents: a private directory, a file the container's uid can read
    # (a Compose file secret is a bind mount: the host file's owner and mode, uid/gid/mode ignored).
    secrets_dir = tmp_path / ".secrets"
    secrets_dir.mkdir(mode=0o700)
    token_file = secrets_dir / "hf_token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o644)
    project = f"grpo-test-{uuid.uuid4().hex[:8]}"
    env_file = write_env_file(tmp_path / "t.env", project, ["cpu"], {"HF_TOKEN_FILE": str(token_file),
                                                                     "MAX_STEPS": "1"})
    base = ["docker", "compose", "--env-file", str(env_file), "-p", project]
    name = f"{project}-trainer"
    try:
        # The real entrypoint, without model-init or env servers: it fails fast, and error paths are
        # where secrets usually leak (config dumps, tracebacks).
        subprocess.run([*base, "run", "-d", "--no-deps", "--name", name, "trainer-cpu"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            state = json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True,
                                              check=True).stdout)[0]
            if not state["State"]["Running"]:
                break
            time.sleep(2)
        logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
        inspect_text = json.dumps(state)
        assert token not in inspect_text, "the token is visible in `docker inspect`"
        assert not [e for e in state["Config"]["Env"] if e.split("=")[0] in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")]
        assert token not in logs.stdout + logs.stderr, "the token was printed to the container log"
        assert image in state["Config"]["Image"]
        # the trainer's secrets are W&B's key (REPORT_TO=wandb online) and JUDGE_URL's (JUDGE_API_KEY_FILE); the HF
        # token is never mounted there
        secrets = {m["Destination"] for m in state["Mounts"] if m["Destination"].startswith("/run/secrets")}
        assert secrets <= {"/run/secrets/wandb_api_key", "/run/secrets/judge_api_key"}, state["Mounts"]
        check = read_secret_in_container(base, tmp_path)
        assert token not in check.stdout + check.stderr
        assert check.returncode == 0 and f"len {len(token)}" in check.stdout, check.stderr[-600:]
        report(f"security: dummy HF token absent from the trainer (not mounted, not in docker inspect env, not "
               f"in {len(logs.stdout + logs.stderr)} bytes of logs); model-download reads it ({check.stdout.strip()})")
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        subprocess.run([*base, "down", "--volumes", "--remove-orphans"], cwd=ROOT, capture_output=True)


def read_secret_in_container(base: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """model-download as compose.yaml defines it (its secret, its uid), the one service given the token: the secret is
    a file its non-root user can read (length only). Stand-in: the CPU trainer image instead of the GPU one (both run
    as uid 10001; the GPU image is not built on CPU machines)."""
    override = tmp_path / "model-download-on-cpu-image.yaml"
    override.write_text(f'services:\n  model-download:\n    image: {IMAGES["trainer-cpu"]}\n')
    return subprocess.run(
        [*base, "-f", str(ROOT / "compose.yaml"), "-f", str(override), "run", "--rm", "--no-deps", "--entrypoint",
         "python3", "model-download", "-c",
         "import os; p='/run/secrets/hf_token'; print('uid', os.getuid(), 'len', len(open(p).read().strip()))"],
        cwd=ROOT, capture_output=True, text=True)


def test_token_file_made_by_setup_is_readable_by_the_container_user(docker, tmp_path, monkeypatch):
    _need_image("trainer-cpu")
    from tools import docker_host
    from tools import settings

    project = f"grpo-test-{uuid.uuid4().hex[:8]}"
    token_file = tmp_path / ".secrets" / "hf_token"
    env_file = write_env_file(tmp_path / "s.env", project, ["cpu"], {"HF_TOKEN_FILE": str(token_file)})
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    docker_host.setup()
    with token_file.open("w") as f:  # what a user does next: put the token in (mode is kept)
        f.write("hf_" + "x" * 34 + "\n")
    base = ["docker", "compose", "--env-file", str(env_file), "-p", project]
    try:
        check = read_secret_in_container(base, tmp_path)
    finally:
        subprocess.run([*base, "down", "--volumes", "--remove-orphans"], cwd=ROOT, capture_output=True)
    assert check.returncode == 0 and "len 37" in check.stdout, check.stderr[-400:]
    assert not (token_file.parent.stat().st_mode & 0o077), "the secrets directory must stay private to the owner"


# ------------------------------------------------------------------ no client paths
PATH_KWARGS = ("path", "file", "filename", "file_path", "data_path", "dataset", "dataset_path", "words_file",
               "word_list", "config", "config_path", "checkpoint", "load", "load_path", "game_name",
               "game_params", "game_string", "target", "word", "episode_id", "env_id", "log_file",
               "save_path", "output_dir", "record_path", "render_dir")


def _path_values(canary: str, write_target: str) -> list:
    return [canary, f"file://{canary}", f"../../../../../..{canary}", "/proc/self/environ", "/etc/passwd",
            write_target, f"efg_game(filename={canary})", {"filename": canary, "path": canary}]


def test_env_servers_read_and_write_no_client_paths(env_stack):
    secret = "CANARY-" + uuid.uuid4().hex
    canary = f"/tmp/grpo-canary-{uuid.uuid4().hex[:8]}"
    write_target = f"/tmp/grpo-written-{uuid.uuid4().hex[:8]}"
    # Content that must never come back: the canary, /etc/passwd's first line, the process environ.
    forbidden = [secret, "root:x:0:0", "PATH=/opt/venv/bin", "PYTHONUNBUFFERED="]
    sent = 0
    for env in ENV_NAMES:
        if env not in env_stack.urls:
            continue
        if env_stack.in_containers:
            env_stack.exec(env, "sh", "-c", f"printf %s {secret} > {canary}")
        else:
            Path(canary).write_text(secret)
        replies: list[str] = []
        with connect(env_stack.ws(env), open_timeout=30, max_size=None) as ws:
            def roundtrip(frame: dict) -> None:
                nonlocal sent
                sent += 1
                ws.send(json.dumps(frame))
                raw = ws.recv(timeout=30)
                assert_structured(json.loads(raw), str(frame))
                replies.append(raw)

            for value in _path_values(canary, write_target):
                for key in PATH_KWARGS:
                    roundtrip({"type": "reset", "data": {key: value}})
                roundtrip({"type": "reset", "data": {k: value for k in PATH_KWARGS}})
                action = dict(VALID_ACTIONS[env])
                for key in list(action):
                    if isinstance(action[key], str):
                        roundtrip({"type": "step", "data": {**action, key: value if isinstance(value, str) else canary}})
                roundtrip({"type": "step", "data": {**action, "game_name": value, "game_params": {"filename": canary}}})
                roundtrip({"type": "step", "data": {**action, "metadata": {"path": value, "file": canary}}})
                if env == "echo":
                    roundtrip({"type": "step", "data": {"type": "call_tool", "tool_name": "echo_message",
                                                        "arguments": {"message": f"@{canary}", "path": canary}}})
        # The stateless HTTP routes and path traversal on the URL.
        base = env_stack.urls[env]
        http = [requests.post(f"{base}/reset", json={k: canary for k in PATH_KWARGS}, timeout=30),
                requests.post(f"{base}/step", json={"action": {**VALID_ACTIONS[env], "path": canary}}, timeout=30),
                requests.get(f"{base}/..%2f..%2f..%2f..{canary}", timeout=10),
                requests.get(f"{base}/static/..%2f..%2f..%2f..{canary}", timeout=10),
                requests.get(f"{base}/web/..%2f..%2f..%2f..%2fetc/passwd", timeout=10),
                requests.get(f"{base}/{canary}", timeout=10)]
        sent += len(http)
        replies += [r.text for r in http]
        for text in replies:
            for bad in forbidden:
                assert bad not in text, f"{env}: a reply carries file content ({bad!r}): {text[:300]!r}"
        if env_stack.in_containers:
            assert env_stack.exec(env, "test", "-e", write_target, check=False).returncode != 0, \
                f"{env}: a client-given path was written"
            listing = env_stack.exec(env, "ls", "-a", "/tmp", "/app").stdout.split()
            assert not [f for f in listing if "grpo-written" in f], listing
            env_stack.exec(env, "rm", "-f", canary)
        else:
            assert not Path(write_target).exists()
            Path(canary).unlink()
    report(f"security: {sent} path-bearing frames/requests to {len(env_stack.urls)} env servers; "
           f"no file content came back, nothing was written")


# ------------------------------------------------------------------ issue #30 item 7
def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=300)


def test_fact__an_internal_network_publishes_no_port_so_envnet_is_not_internal(docker):
    """compose.yaml keeps envnet non-internal: on an `internal` network Docker publishes no port, and the env
    servers' 127.0.0.1 ports are how bench, the tests and users reach them."""
    image = _need_image("env-server")
    tag = f"grpo-test-secinfra-{uuid.uuid4().hex[:8]}"
    published = {}
    try:
        for internal in (False, True):
            name = f"{tag}-{int(internal)}"
            _run("docker", "network", "create", *(["--internal"] if internal else []), name)
            _run("docker", "run", "-d", "--name", name, "--network", name, "-p", "127.0.0.1::8000", "-e",
                 "ENV_NAME=echo", image)
            ports = json.loads(_run("docker", "inspect", name).stdout)[0]["NetworkSettings"]["Ports"] or {}
            published[internal] = [p["HostPort"] for p in ports.get("8000/tcp") or []]
    finally:
        for internal in (False, True):
            _run("docker", "rm", "-f", f"{tag}-{int(internal)}", check=False)
            _run("docker", "network", "rm", f"{tag}-{int(internal)}", check=False)
    assert published[False] and published[True] == [], published
