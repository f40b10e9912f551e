"""Security by default, checked on the resolved Compose config (parsed JSON, never grepped).

What each check protects is explained in SECURITY.md. These tests need only the `docker compose`
CLI (no engine work); the image and runtime checks live in test_security_runtime.py.
"""

from __future__ import annotations

import re
import subprocess

import pytest

from tests.helpers import ROOT
from tests.helpers import compose_config as resolved

# Every run profile a user can pick (build-only profiles are checked separately).
RUN_PROFILES = ("gpu", "cpu", "echo", "wordle", "catch", "dashboard")
ENV_SERVERS = ("env-echo", "env-wordle", "env-catch")
# Services allowed to see the HF token: the one that downloads (gated) weights, and `make export`'s, which pushes.
TOKEN_HOLDERS = {"model-download", "export"}
# Services we build ourselves run as a non-root uid; vLLM's official image runs as root.
ROOT_IMAGES_ALLOWED = {"vllm"}


@pytest.fixture(scope="module")
def docker_cli():
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.fail("`docker compose` (v2) is missing: run `bash .ci/provision`")


@pytest.fixture(scope="module")
def full(docker_cli) -> dict:
    """Everything a user can run at once, as the brief's command resolves it."""
    return resolved(*RUN_PROFILES)


@pytest.fixture(scope="module")
def every(docker_cli) -> dict:
    """Every profile, build-only and any added later (colocate, vllm-cpu, ...) included."""
    return resolved("*")


def runtime_services(cfg: dict) -> dict[str, dict]:
    """Services that run something (the build-only ones just tag an image and exit)."""
    return {n: s for n, s in cfg["services"].items() if s.get("entrypoint") != ["true"]}


def test_no_port_is_published_beyond_loopback(full, every):
    seen = 0
    for cfg in (full, every):
        for name, svc in cfg["services"].items():
            for port in svc.get("ports", []):
                seen += 1
                assert port.get("host_ip") == "127.0.0.1", f"{name} publishes {port} beyond loopback"
    assert seen >= 4, "expected the env servers and the dashboard to publish on loopback"


def test_vllm_port_is_not_published_at_all(full, every):
    # vLLM's dev-mode routes (/update_weights, /collective_rpc, /sleep, ...) have no auth.
    for cfg in (full, every):
        for name, svc in cfg["services"].items():
            if name == "vllm" or name.startswith("vllm-"):
                assert not svc.get("ports"), f"{name} must not publish a port: {svc['ports']}"
    assert "vllm" in full["services"]


def test_env_servers_publish_only_an_ephemeral_loopback_port(full):
    for name in ENV_SERVERS:
        (port,) = full["services"][name]["ports"]
        assert port["target"] == 8000 and port["host_ip"] == "127.0.0.1"
        # No fixed host port: replicas don't collide and nothing guessable listens.
        assert not port.get("published"), (name, port)


def test_every_service_sets_no_new_privileges(every):
    for name, svc in runtime_services(every).items():
        assert "no-new-privileges:true" in svc.get("security_opt", []), name


def test_no_service_is_privileged_or_on_host_namespaces(every):
    for name, svc in runtime_services(every).items():
        assert not svc.get("privileged"), name
        assert svc.get("network_mode") in (None, ""), f"{name} uses network_mode {svc['network_mode']}"
        assert svc.get("pid") in (None, ""), name
        assert not (set(svc.get("cap_add") or []) & {"ALL", "SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE"}), name
        for vol in svc.get("volumes", []):
            assert vol.get("source") != "/var/run/docker.sock", f"{name} mounts the Docker socket"


def test_env_servers_have_memory_and_pids_limits(full):
    for name in ENV_SERVERS:
        svc = full["services"][name]
        assert 0 < int(svc["mem_limit"]) <= 64 * 2**30, (name, svc.get("mem_limit"))
        assert 0 < int(svc["pids_limit"]) <= 4096, (name, svc.get("pids_limit"))
        assert svc["restart"] == "unless-stopped", name


def test_trainers_have_memory_and_pids_limits(every):
    """An env image's replies are bounded in the client (envs.core.untrusted); the limits are the backstop. model-init
    plays the env servers too (#44: it had none)."""
    for name in ("trainer", "trainer-cpu", "model-init"):
        svc = every["services"][name]
        assert 0 < int(svc["mem_limit"]) <= 256 * 2**30, (name, svc.get("mem_limit"))
        assert 0 < int(svc["pids_limit"]) <= 16384, (name, svc.get("pids_limit"))


def test_env_servers_drop_all_capabilities(full):
    # uid 10001 on port 8000 needs none; dropping them all shrinks what a server bug can reach.
    for name in ENV_SERVERS:
        assert full["services"][name].get("cap_drop") == ["ALL"], name


def test_env_servers_have_a_read_only_root_filesystem(full):
    # Code, word lists and the venv can't be changed by a compromised server; /tmp is a small tmpfs.
    for name in ENV_SERVERS:
        svc = full["services"][name]
        assert svc.get("read_only") is True, name
        assert any(t.split(":")[0] == "/tmp" for t in svc.get("tmpfs", [])), name


def test_our_services_do_not_override_the_images_non_root_user(every):
    # Our images set USER 10001 (checked on the built images in test_security_runtime.py);
    # a compose `user:` may only keep it non-root.
    for name, svc in runtime_services(every).items():
        user = str(svc.get("user", "")).split(":")[0]
        if user:
            assert user not in ("0", "root"), f"{name} runs as root via compose `user:`"


def test_hf_token_is_only_a_compose_secret(every):
    assert every["secrets"]["hf_token"].get("file"), "hf_token must come from a file"
    assert not every["secrets"]["hf_token"].get("environment"), "secret must not be read from an env var"
    for name, svc in every["services"].items():
        env = svc.get("environment") or {}
        for key, value in env.items():
            assert "HF_TOKEN" not in key.upper() and "HUGGING_FACE_HUB_TOKEN" not in key.upper(), (name, key)
            assert not re.fullmatch(r"hf_[A-Za-z0-9]{20,}", str(value or "")), f"{name}.{key} looks like a token"
        args = (svc.get("build") or {}).get("args") or {}
        assert not [a for a in args if "TOKEN" in a.upper()], f"{name} passes a token as a build arg"
        holders = {s["source"] for s in svc.get("secrets", [])}
        if "hf_token" in holders:
            assert name in TOKEN_HOLDERS, f"{name} gets hf_token but neither downloads weights nor pushes them"


def test_env_servers_vllm_and_dashboard_never_see_the_token(full):
    for name in (*ENV_SERVERS, "vllm", "dashboard"):
        assert not full["services"][name].get("secrets"), name


def test_the_token_is_not_in_env_file_or_dockerfiles():
    # The documented way is a file under .secrets/ (git-ignored); nothing else may carry it.
    example = (ROOT / ".env.example").read_text()
    assert not re.search(r"^\s*(export\s+)?HF_TOKEN\s*=", example, re.M)
    assert ".secrets/" in (ROOT / ".gitignore").read_text().split()
    for dockerfile in ROOT.glob("services/**/Dockerfile*"):
        text = dockerfile.read_text()
        assert not re.search(r"^\s*(ARG|ENV)\s+\w*TOKEN", text, re.M | re.I), dockerfile


# Images we build from a base we control must end as a non-root user. The GPU trainer builds
# on vLLM's official image (root); it is checked too once it sets a USER.
MUST_BE_NON_ROOT = ("services/env-server/Dockerfile", "services/trainer/Dockerfile.cpu",
                    "services/vllm-cpu/Dockerfile")


def test_our_dockerfiles_end_as_a_non_root_user():
    checked = []
    for dockerfile in sorted(ROOT.glob("services/**/Dockerfile*")):
        rel = str(dockerfile.relative_to(ROOT))
        users = re.findall(r"^\s*USER\s+(\S+)", dockerfile.read_text(), re.M)
        if rel in MUST_BE_NON_ROOT:
            assert users, f"{rel} sets no USER: it would run as root"
        if users:
            assert users[-1].split(":")[0] not in ("0", "root"), f"{rel} ends as root"
            checked.append(rel)
    if not checked:
        pytest.skip("no Dockerfile written yet")


def test_vllm_dev_routes_stay_on_the_private_network(full):
    vllm = full["services"]["vllm"]
    assert vllm["environment"].get("VLLM_SERVER_DEV_MODE") == "1"  # why the rule above matters
    assert set(vllm["networks"]) == {"agentnet"}
    assert not full["networks"]["agentnet"].get("external"), "agentnet must be private to the project"


def test_env_images_never_share_a_network_with_vllm(full, every):
    """An env image is code the user did not write: it must not reach vLLM's weight routes, nor the judge that scores
    its transcripts (SECURITY.md)."""
    for cfg in (full, every):
        vllm_nets = {n for name in ("vllm", "vllm-cpu", "judge") if name in cfg["services"]
                     for n in cfg["services"][name]["networks"]}
        for name, svc in cfg["services"].items():
            if name.startswith("env-") or name == "model-init":
                assert not set(svc.get("networks", {})) & vllm_nets, (name, svc.get("networks"))


# ------------------------------------------------------------------ issue #30 item 7
def test_gpu_vllm_drops_every_capability_and_has_limits_like_its_cpu_twin(every):
    vllm, twin = every["services"]["vllm"], every["services"]["vllm-cpu"]
    assert vllm["cap_drop"] == twin["cap_drop"] == ["ALL"]
    assert "no-new-privileges:true" in vllm["security_opt"]
    assert 0 < int(vllm["pids_limit"]) and 0 < int(vllm["mem_limit"])
    assert 0 < int(twin["mem_limit"])


def test_env_servers_run_as_a_non_root_user_whatever_their_image_says(full, every):
    # An upstream image without a USER line would run as root; env-template names the user (ENV_<NAME>_USER=0 opts out).
    for cfg, names in ((full, ENV_SERVERS), (every, ("env-template",))):
        for name in names:
            assert cfg["services"][name]["user"] == "10001:10001", name


def test_an_image_that_needs_root_is_opted_in_by_name(tmp_path):
    env_file = tmp_path / "root.env"
    env_file.write_text((ROOT / ".env.example").read_text() + "\nENV_CATCH_IMAGE=x/catch:1\nENV_CATCH_USER=0\n")
    cfg = resolved("echo", "catch", env_file=str(env_file))
    assert cfg["services"]["env-catch"]["user"] == "0" and cfg["services"]["env-echo"]["user"] == "10001:10001"


def test_the_dashboard_has_its_own_network_and_reads_the_runs_read_only(full):
    dash = full["services"]["dashboard"]
    assert set(dash["networks"]) == {"dashnet"} and dash["cap_drop"] == ["ALL"]
    assert not [name for name, svc in full["services"].items() if name != "dashboard" and "dashnet" in svc["networks"]]
    mounts = {v["target"]: v for v in dash["volumes"]}
    assert mounts["/outputs"]["source"] == "outputs" and mounts["/outputs"]["read_only"] is True
    writable = [t for t, v in mounts.items() if not v.get("read_only")]
    assert writable == ["/trackio"] and mounts["/trackio"]["source"] == "trackio"
    assert dash["environment"]["TRACKIO_DIR"] == "/trackio"
    for trainer in ("trainer", "trainer-cpu"):  # the trainers write trackio's store where the dashboard reads it
        svc = full["services"][trainer]
        assert svc["environment"]["TRACKIO_DIR"] == "/trackio", trainer
        assert {v["target"]: v["source"] for v in svc["volumes"]}["/trackio"] == "trackio", trainer


def test_envnet_is_not_internal_because_env_servers_publish_loopback_ports(full):
    # The reason (an internal network publishes no port) is shown on the engine in test_security_runtime.py.
    assert not full["networks"]["envnet"].get("internal")
    assert all(full["services"][name]["ports"] for name in ENV_SERVERS)
