"""Bad input to `make train`/`make doctor` gets one clear message naming the fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys


import pytest
import yaml

from tests.helpers import ROOT


# `python -m tools` checks the Docker engine before anything else (it starts no container in these tests)
ENGINE = pytest.mark.docker


def stack(tmp_path, *args: str, env_lines: str = "", extra_env: dict | None = None, make: bool = False):
    env_file = tmp_path / "test.env"
    env_file.write_text((ROOT / ".env.example").read_text() + "\n" + env_lines + "\n")
    env = dict(os.environ, STACK_ENV_FILE=str(env_file), **(extra_env or {}))
    for k in ("TRAIN_MODE", "ENV_NAME", "DASHBOARD", "DASHBOARD_PORT"):
        env.pop(k, None)
    cmd = ["make", "--no-print-directory", *args] if make else [sys.executable, "-m", "tools", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)


@ENGINE
def test_env_name_that_is_not_built_in_asks_for_its_image(tmp_path):
    r = stack(tmp_path, "mode", env_lines="ENV_NAME=nope")
    assert r.returncode == 2
    assert ("ENV_NAME: 'nope' is not built in (catch, echo, wordle): to train on any OpenEnv image, set "
            "ENV_NOPE_IMAGE=<image> in .env") in r.stderr
    assert "or fix the name in .env" in r.stderr
    bad = stack(tmp_path, "mode", env_lines="ENV_NAME=No-Pe")
    assert bad.returncode == 2 and "ENV_NAME: 'no-pe' is not an env name" in bad.stderr


@ENGINE
def test_custom_env_service_is_generated_from_the_env_file(tmp_path):
    r = stack(tmp_path, "compose", "config", "--format", "json",
              env_lines="TRAIN_MODE=cpu\nENV_NAME=echo,connect4\nENV_CONNECT4_IMAGE=example/connect4:1\n"
                        "ENV_CONNECT4_REPLICAS=3")
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout[r.stdout.index("{"):])
    service = config["services"]["env-connect4"]
    builtin = config["services"]["env-echo"]
    assert service["image"] == "example/connect4:1" and service["deploy"]["replicas"] == 3
    for key in ("read_only", "cap_drop", "security_opt", "healthcheck", "mem_limit", "pids_limit", "tmpfs",
                "restart", "networks", "ports"):  # hardened and health-gated like the built-ins
        assert service[key] == builtin[key], key
    for job in ("trainer-cpu", "model-init"):
        assert config["services"][job]["depends_on"]["env-connect4"]["condition"] == "service_healthy"
    assert config["services"]["trainer-cpu"]["environment"]["ENV_CONNECT4_IMAGE"] == "example/connect4:1"


@ENGINE
def test_unknown_train_mode_is_rejected(tmp_path):
    r = stack(tmp_path, "mode", env_lines="TRAIN_MODE=tpu")
    assert r.returncode == 2 and "TRAIN_MODE: unknown value 'tpu'; choose from auto, cpu, gpu, colocate" in r.stderr


@ENGINE
def test_gpu_mode_without_gpus_says_what_to_do(tmp_path):
    r = stack(tmp_path, "mode", env_lines="TRAIN_MODE=gpu", extra_env={"STACK_FAKE_NO_GPU": "1"})
    assert r.returncode == 2
    assert "TRAIN_MODE=gpu needs 2 NVIDIA GPU(s), found 0 (no GPU (forced off by STACK_FAKE_NO_GPU))" in r.stderr
    assert "set TRAIN_MODE=auto or cpu" in r.stderr


@ENGINE
def test_auto_mode_on_a_gpu_less_host_says_it_uses_the_cpu_profile(tmp_path):
    r = stack(tmp_path, "mode", extra_env={"STACK_FAKE_NO_GPU": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().endswith("cpu")
    assert "CPU profile with a tiny local model" in r.stdout


def test_missing_docker_engine_names_the_fix(tmp_path):
    r = stack(tmp_path, "train", make=True, extra_env={"DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"})
    assert r.returncode != 0
    assert "the Docker engine is not answering" in r.stderr
    assert "sudo systemctl start docker" in r.stderr


@ENGINE
def test_port_in_use_names_the_port_and_the_fix(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = stack(tmp_path, "dashboard", env_lines=f"DASHBOARD_PORT={port}")
        doctor = stack(tmp_path, "doctor", make=True, env_lines=f"DASHBOARD_PORT={port}")
    assert r.returncode == 2
    assert f"port {port} (DASHBOARD_PORT) is already in use on 127.0.0.1" in r.stderr
    assert "set DASHBOARD_PORT to a free port in .env" in r.stderr
    assert doctor.returncode != 0 and f"port {port} (DASHBOARD_PORT) is already in use" in doctor.stdout


@ENGINE
def test_doctor_reports_every_problem_at_once(tmp_path):
    r = stack(tmp_path, "doctor", make=True, env_lines="ENV_NAME=nope\nTRAIN_MODE=tpu\nLEARNIG_RATE=0.1",
              extra_env={"STACK_FAKE_NO_GPU": "1"})
    assert r.returncode != 0
    assert "WARN LEARNIG_RATE in .env: no setting reads it (did you mean LEARNING_RATE?)" in r.stdout
    assert "ENV_NAME: 'nope' is not built in" in r.stderr
    assert "TRAIN_MODE: unknown value 'tpu'" in r.stderr
    assert "doctor found problems" in r.stdout


@ENGINE
def test_malformed_env_line_is_pointed_at(tmp_path):
    r = stack(tmp_path, "mode", env_lines="this is not a setting")
    assert r.returncode == 2 and "expected KEY=VALUE" in r.stderr and "line" in r.stderr


def test_help_lists_every_target():
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True).stdout
    targets = [l.split(":")[0] for l in (ROOT / "Makefile").read_text().splitlines()
               if l and not l[0].isspace() and "## " in l and ":" in l]
    assert set(targets) >= {"help", "up", "train", "down", "logs", "ps", "build", "test", "clean", "doctor"}
    for t in targets:
        assert f" {t} " in out.replace("\x1b[36m", " ").replace("\x1b[0m", " "), t


def test_every_env_service_is_generated_from_the_one_template(tmp_path, monkeypatch):
    """compose.yaml holds no env service, only env-template: the plan generates one per env served here, the same way
    for echo, for a built-in env added as one folder + its registry line (maze), and for an image named in .env;
    ENV_URLS's envs get none."""
    from envs import registry
    from tools import compose_file, images, settings
    from tools.plan import make_plan

    monkeypatch.setitem(registry._SPECS, "maze", registry._SPECS["catch"])  # stands in for envs/maze/
    monkeypatch.setattr(settings, "ENV_FILE", tmp_path / "none.env")
    servers = [n for n, svc in images.compose_yaml_services().items()
               if n.startswith("env-") and "build" not in svc.get("profiles", [])]
    assert servers == ["env-template"]
    plan = make_plan({"ENV_NAME": "echo,maze,connect4,far", "ENV_CONNECT4_IMAGE": "example/connect4:1",
                      "ENV_URLS": "far=http://10.0.0.9:8000", "TRAIN_MODE": "cpu"}, None)
    files = compose_file.write_compose_files(plan.generated_compose())
    generated = yaml.safe_load(files[1].read_text())["services"]
    assert set(generated) == {"env-echo", "env-maze", "env-connect4", "trainer", "trainer-cpu", "model-init"}
    for name in ("echo", "maze"):
        assert generated[f"env-{name}"] == {
            "extends": {"file": str(ROOT / "compose.yaml"), "service": "env-template"}, "profiles": [name],
            "image": f"${{ENV_{name.upper()}_IMAGE:-{images.image_ref(images.ENV_SERVER_BUILD)}}}",
            "deploy": {"replicas": f"${{ENV_{name.upper()}_REPLICAS:-1}}"},
            "user": f"${{ENV_{name.upper()}_USER:-10001:10001}}",  # non-root whatever the image says (SECURITY.md)
            # its server's port (tools/env_ports.py), published on loopback and named to the health check
            "ports": [f"127.0.0.1::${{ENV_{name.upper()}_PORT:-8000}}"],
            "environment": {"ENV_NAME": name, "PORT": f"${{ENV_{name.upper()}_PORT:-8000}}"}}
    assert generated["env-connect4"]["image"] == "${ENV_CONNECT4_IMAGE}"
    assert generated["env-connect4"]["extends"] == generated["env-echo"]["extends"]
    assert set(generated["trainer-cpu"]["depends_on"]) == {"env-echo", "env-maze", "env-connect4"}
    assert set(generated["model-init"]["depends_on"]) == {"env-connect4"}  # it warm-starts on learned envs only
    assert plan.services == ["env-echo", "env-maze", "env-connect4"]
    assert plan.profiles == ["cpu", "echo", "maze", "connect4", "far"]


@ENGINE
def test_env_file_values_are_typed_with_one_line_per_bad_value(tmp_path):
    r = stack(tmp_path, "mode", env_lines="DASHBOARD=maybe\nDASHBOARD_PORT=abc")
    assert r.returncode == 2
    assert "DASHBOARD: Input should be a valid boolean" in r.stderr and "(got 'maybe'); edit .env" in r.stderr
    assert "DASHBOARD_PORT: Input should be a valid integer" in r.stderr and "(got 'abc')" in r.stderr


@ENGINE
def test_fleet_mode_starts_no_env_service_and_joins_the_trainers_not_vllm_to_the_fleet_network(tmp_path):
    r = stack(tmp_path, "compose", "config", "--format", "json",
              env_lines="TRAIN_MODE=cpu\nENV_NAME=echo,connect4\nENV_CONNECT4_IMAGE=example/connect4:1\n"
                        "ENV_FLEET=swarm\nFLEET_STACK=team-fleet")
    assert r.returncode == 0, r.stderr
    config = json.loads(r.stdout[r.stdout.index("{"):])
    assert not [s for s in config["services"] if s.startswith("env-")]  # the fleet serves them
    assert config["networks"]["fleet"]["name"] == "team-fleet" and config["networks"]["fleet"]["external"]
    assert set(config["services"]["trainer-cpu"]["networks"]) == {"agentnet", "envnet", "fleet"}
    assert set(config["services"]["model-init"]["networks"]) == {"envnet", "fleet"}
    assert config["services"]["trainer-cpu"]["environment"]["ENV_FLEET"] == "swarm"
    assert config["services"]["trainer-cpu"]["environment"]["ENV_CONNECT4_IMAGE"] == "example/connect4:1"
    from tools import compose_file
    from tools.env_kinds import env_kinds

    attached = compose_file.fleet_attachments(env_kinds({"ENV_NAME": "echo", "ENV_FLEET": "swarm"}))
    assert "vllm" not in attached and set(attached) == {"trainer", "trainer-cpu", "model-init"}


def test_fleet_commands_off_a_swarm_manager_say_what_to_run(monkeypatch):
    from tools import fleet

    answers = {
        '{"LocalNodeState":"inactive","ControlAvailable":false}': "this Docker engine is not in a swarm (state: "
                                                                  "inactive): run `docker swarm init`",
        '{"LocalNodeState":"active","ControlAvailable":false}': "this node is a swarm worker: run `make fleet-up`",
    }
    for info, message in answers.items():
        monkeypatch.setattr(fleet, "run", lambda cmd, timeout=20, info=info: subprocess.CompletedProcess(cmd, 0, info, ""))
        assert message in fleet.swarm_problem()
    monkeypatch.setattr(fleet, "run", lambda cmd, timeout=20: subprocess.CompletedProcess(
        cmd, 0, '{"LocalNodeState":"active","ControlAvailable":true}', ""))
    assert fleet.swarm_problem() is None


def test_a_compose_env_service_becomes_a_swarm_service_with_the_same_values():
    from tools import fleet

    compose_service = {"image": "example/env:1", "environment": {"MAX_CONCURRENT_ENVS": "64"},
                       "healthcheck": {"test": ["CMD", "true"]}, "read_only": True, "cap_drop": ["ALL"],
                       "tmpfs": ["/tmp:size=64m"], "mem_limit": "4294967296", "pids_limit": 512,
                       "deploy": {"replicas": 5}, "ports": [{"target": 8000}], "restart": "unless-stopped"}
    svc = fleet.swarm_service(compose_service)
    assert svc["deploy"]["replicas"] == 5 and svc["deploy"]["endpoint_mode"] == "dnsrr"
    assert svc["deploy"]["resources"]["limits"] == {"memory": "4294967296", "pids": 512}
    assert svc["volumes"] == [{"type": "tmpfs", "target": "/tmp", "tmpfs": {"size": 64 << 20}}]
    assert "ports" not in svc  # reached over the overlay only
    assert svc["deploy"]["update_config"]["order"] == "start-first"
    assert fleet.size_bytes("4g") == 4 << 30


def test_compose_before_2_24_4_is_refused_for_override_tags():
    from tools.docker_host import compose_too_old

    assert "need >= 2.24.4" in compose_too_old("2.24.3") and "`!override`" in compose_too_old("v2.24.0")
    assert compose_too_old("2.24.4") is None and compose_too_old("v2.40.3") is None
    assert compose_too_old("garbage") is not None


def test_report_baseline_and_clean_are_host_commands_running_what_the_makefile_ran(monkeypatch, tmp_path):
    """The Makefile's one-liners call these; what each runs, with Compose and Docker recorded instead of called."""
    from tools import docker_host, images, prepare
    from tools.commands import baseline, clean, report
    from tools.plan import make_plan

    calls = []
    prepared = prepare.Prepared(make_plan({"TRAIN_MODE": "cpu"}, None), {})
    monkeypatch.setattr(prepare.Prepared, "compose", lambda self, *args, **kw: calls.append(("compose", *args)) or 0)
    monkeypatch.setattr(docker_host, "run", lambda cmd, **kw: calls.append(tuple(cmd)))
    for command in (report, baseline, clean):
        monkeypatch.setattr(command, "prepare", lambda: prepared)
    monkeypatch.setattr(baseline, "bring_up", lambda p: calls.append(("bring_up",)))
    monkeypatch.setattr(report, "ROOT", tmp_path)

    assert report.run(["--run", "r1"]) == 0
    built, ran = calls[-2], calls[-1]
    assert built == ("compose", "--progress", "quiet", "build", "trainer-cpu-image")
    assert ran[:4] == ("compose", "run", "--rm", "--no-deps") and ran[ran.index("--user") + 1] == f"{os.getuid()}:{os.getgid()}"
    assert f"{tmp_path / 'reports'}:/reports" in ran and (tmp_path / "reports").is_dir()
    assert ran[ran.index("trainer-cpu"):] == ("trainer-cpu", "python3", "-m", "trainer.report", "--outputs", "/outputs",
                                              "--run", "r1", "--out-dir", "/reports")
    calls.clear()
    assert baseline.run([]) == 0
    assert calls[0] == ("bring_up",) and calls[-1][-3:] == ("python3", "-m", "trainer.baseline")
    calls.clear()
    assert clean.run([]) == 0
    assert calls[0] == ("compose", "--profile", "*", "down", "--volumes", "--remove-orphans")
    assert calls[1][:4] == ("docker", "image", "rm", "-f")
    assert set(calls[1][4:]) == {images.image_of(s) for s in images.BUILT_HERE} and len(calls[1][4:]) == 5
