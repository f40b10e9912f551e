"""ENV_<NAME>_PORT (tools/env_ports.py): an env image serving elsewhere than 8000 (upstream calendar_env: 8004) is
published, health-checked, measured and reached on its own port. The rules, the generated Compose config (`docker
compose config`, no engine), the trainer's URL and the messages that name the port and where it came from."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from envs import naming
from tests.helpers import ROOT
from tools import compose_file, docker_host, env_ports, env_replicas, images, settings
from tools.env_kinds import env_kinds
from tools.env_ports import EnvPort
from tools.errors import StackError

CALENDAR = {"ENV_NAME": "calendar_env", "ENV_CALENDAR_ENV_IMAGE": "openenv-calendar", "TRAIN_MODE": "cpu"}


def resolve(values: dict[str, str], exposed: dict[str, tuple[str, ...]]):
    return env_ports.resolve(env_kinds(values), values, exposed)


def test_an_image_exposing_one_port_is_reached_there():
    ports, lines = resolve(CALENDAR, {"calendar_env": ("8004/tcp",)})
    assert ports == {"calendar_env": EnvPort(8004, "the image's EXPOSE")} and lines == []
    assert str(ports["calendar_env"]) == "port 8004, the image's EXPOSE"


def test_an_image_exposing_no_port_or_one_not_inspected_gets_8000_quietly():
    for exposed in ({"calendar_env": ()}, {}, {"calendar_env": ("53/udp",)}):
        ports, lines = resolve(CALENDAR, exposed)
        assert ports["calendar_env"].port == 8000 and lines == [], exposed
    assert str(ports["calendar_env"]) == ("port 8000, the default; set ENV_CALENDAR_ENV_PORT if the server listens "
                                          "elsewhere")


def test_an_image_exposing_several_ports_gets_8000_and_one_line_naming_the_variable():
    ports, lines = resolve(CALENDAR, {"calendar_env": ("8004/tcp", "7860/tcp")})
    assert ports["calendar_env"].port == 8000
    assert lines == ["env calendar_env: its image openenv-calendar EXPOSEs ports 7860, 8004; looking for its server on "
                     "8000, the default: set ENV_CALENDAR_ENV_PORT=<port> in .env if it listens on another"]


def test_a_port_set_in_env_wins_over_the_image():
    values = {**CALENDAR, "ENV_CALENDAR_ENV_PORT": " 9001 "}
    ports, lines = resolve(values, {"calendar_env": ("8004/tcp", "7860/tcp")})
    assert ports == {"calendar_env": EnvPort(9001, "ENV_CALENDAR_ENV_PORT in .env")} and lines == []


@pytest.mark.parametrize("value", ["0", "65536", "80a", "-1", "8004.0", "http://x:8004"])
def test_a_bad_port_is_one_line_naming_the_variable_and_what_to_write(value):
    with pytest.raises(StackError) as err:
        resolve({**CALENDAR, "ENV_CALENDAR_ENV_PORT": value}, {})
    assert str(err.value) == (
        f"ENV_CALENDAR_ENV_PORT={value!r} is not a port: write the port env calendar_env's server listens on inside "
        "its container, a number from 1 to 65535 (e.g. ENV_CALENDAR_ENV_PORT=8004), or leave it unset for the port "
        "its image EXPOSEs, else 8000 (edit .env)")


def test_built_in_envs_and_urls_elsewhere():
    """Our image serves on 8000 and is not inspected; an env of ENV_URLS has no server here to resolve."""
    values = {"ENV_NAME": "echo,far,calendar_env", "ENV_URLS": "far=http://10.0.0.9:8004",
              "ENV_CALENDAR_ENV_IMAGE": "openenv-calendar", "ENV_ECHO_IMAGE": images.local_env_image()}
    asked = []

    def run(cmd, timeout=20):
        asked.append(cmd[-1])
        return subprocess.CompletedProcess(cmd, 0, '{"8004/tcp":{}}\n', "")

    envs = env_kinds(values)
    exposed = docker_host.exposed_ports(envs, run)
    assert asked == ["openenv-calendar"] and exposed == {"calendar_env": ("8004/tcp",)}
    ports, _ = env_ports.resolve(envs, values, exposed)
    assert {n: p.port for n, p in ports.items()} == {"echo": 8000, "calendar_env": 8004}


def test_an_image_not_on_this_machine_is_left_for_the_pull():
    def run(cmd, timeout=20):
        return subprocess.CompletedProcess(cmd, 1, "", "Error: No such image: openenv-calendar")

    assert docker_host.exposed_ports(env_kinds(CALENDAR), run) == {}


# ------------------------------------------------------------------ where the port goes
@pytest.fixture
def calendar_config(tmp_path, monkeypatch):
    """`docker compose config` (no engine needed) of the stack `make` generates for calendar_env, its image
    exposing 8004, run with the environment the plan gives Compose."""
    from tools.plan import make_plan

    monkeypatch.setattr(settings, "ENV_FILE", tmp_path / "ports.env")  # its own generated file under .stack/
    plan = make_plan(CALENDAR, None, {"calendar_env": ("8004/tcp",)})
    files = compose_file.write_compose_files(plan.generated_compose())
    try:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("ENV_", "COMPOSE_"))}
        env = plan.compose_vars(files, {**environ, **CALENDAR})  # .env's values, as `--env-file` gives them
        out = subprocess.run(["docker", "compose", "-p", "ports-config", "config", "--format", "json"], cwd=ROOT,
                             env=env, capture_output=True, text=True)
    finally:
        files[1].unlink()
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["services"]


def test_the_generated_service_publishes_health_checks_and_names_the_resolved_port(calendar_config):
    svc = calendar_config["env-calendar_env"]
    assert [(p["host_ip"], p["target"], p.get("published", "")) for p in svc["ports"]] == [("127.0.0.1", 8004, "")]
    assert svc["environment"]["PORT"] == "8004"
    assert "/dev/tcp/127.0.0.1/$${PORT:-8000}" in svc["healthcheck"]["test"][-1]  # bash reads PORT in the container


def test_the_trainer_and_model_init_are_told_the_port(calendar_config):
    for name in ("trainer-cpu", "model-init"):
        assert calendar_config[name]["environment"]["ENV_CALENDAR_ENV_PORT"] == "8004", name


def test_the_trainer_reaches_the_port_it_is_told(monkeypatch):
    from contract.config import RunConfig

    cfg = RunConfig(env_name="calendar_env,echo", train_mode="cpu")
    monkeypatch.delenv("ENV_CALENDAR_ENV_PORT", raising=False)
    assert cfg.env_url("calendar_env") == "http://env-calendar_env:8000"
    monkeypatch.setenv("ENV_CALENDAR_ENV_PORT", "8004")
    assert cfg.env_url("calendar_env") == "http://env-calendar_env:8004"
    assert cfg.env_url("echo") == "http://env-echo:8000"
    swarm = RunConfig(env_name="calendar_env", train_mode="cpu", env_fleet="swarm")
    assert swarm.env_url("calendar_env") == "http://tasks.env-calendar_env:8004"
    urls = RunConfig(env_name="calendar_env", train_mode="cpu", env_urls="calendar_env=http://h:9")
    assert urls.env_url("calendar_env") == "http://h:9"  # ENV_URLS as given
    assert naming.service_url("x", port=8004) == "http://env-x:8004"


# ------------------------------------------------------------------ the messages
def test_the_probe_names_the_port_and_leaves_out_the_images_own_health_checks(monkeypatch):
    """calendar_env before: 180 s on 8000, then a message quoting `GET /health ... 200 OK`: the image's HEALTHCHECK
    on 8004, read as if our probe had been answered."""
    logs = ('INFO:     Uvicorn running on http://0.0.0.0:8004 (Press CTRL+C to quit)\n'
            'INFO:     127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK\n'
            'INFO:     127.0.0.1:40318 - "GET /health?full=1 HTTP/1.1" 200 OK\n'
            'INFO:     127.0.0.1:40330 - "GET /healthz HTTP/1.1" 404 Not Found\n')

    def run(cmd, timeout=20):
        out = "false\n" if cmd[:2] == ["docker", "inspect"] else logs if cmd[:2] == ["docker", "logs"] else ""
        return subprocess.CompletedProcess(cmd, 0, out, "")

    with pytest.raises(env_replicas.ReplicasError) as err:
        env_replicas.wait_healthy("http://127.0.0.1:9", "c", run, env_ports.default("calendar_env"))
    message = str(err.value)
    assert message.startswith("the measured container never answered GET /health (exited) on port 8000, the default; "
                              "set ENV_CALENDAR_ENV_PORT if the server listens elsewhere: is it an OpenEnv server "
                              "listening there? last log lines: ")
    assert "Uvicorn running on http://0.0.0.0:8004" in message and "GET /healthz" in message
    assert '"GET /health HTTP' not in message and "GET /health?" not in message


def test_an_unhealthy_env_names_the_port_its_check_looked_on(monkeypatch):
    def fake(cmd, **_):
        return subprocess.CompletedProcess(cmd, 0, '{"State": "running", "Health": "unhealthy"}\n', "")

    monkeypatch.setattr(docker_host.subprocess, "run", fake)
    lines = docker_host.unhealthy_custom_envs({}, env_kinds(CALENDAR), {"calendar_env": EnvPort(8004, "the image's EXPOSE")})
    assert lines == ["env-calendar_env (image openenv-calendar) is unhealthy: its GET /health never answered 200 on "
                     "port 8004, the image's EXPOSE. Is it an OpenEnv server (openenv's create_app) listening there? "
                     "`make logs` shows its output"]


@pytest.mark.parametrize("entry", ["0/tcp", "70000/tcp", "\u0668\u0660\u0660\u0660/tcp", "\uff18\uff10/tcp", "8004",
                                   "-1/tcp", "80 /tcp"])
def test_an_expose_entry_that_is_no_port_gets_the_default_and_one_line_naming_the_image(entry):
    """#63: `0/tcp` and `70000/tcp` were taken (the error came later, blaming ENV_X_PORT); an Arabic-Indic or
    fullwidth digit ended `make up` in a traceback (int() refused what str.isdigit() let through)."""
    ports, lines = resolve(CALENDAR, {"calendar_env": (entry,)})
    assert ports == {"calendar_env": env_ports.default("calendar_env")}
    assert lines == [f"env calendar_env: its image openenv-calendar EXPOSEs {ascii(entry)}, not a TCP port (1-65535): "
                     "ignored, looking for its server on 8000; set ENV_CALENDAR_ENV_PORT=<port> in .env if it listens "
                     "on another"]
    ports, lines = resolve(CALENDAR, {"calendar_env": (entry, "8004/tcp")})  # beside a real port: that one, said
    assert ports["calendar_env"].port == 8004 and "looking for its server on 8004" in lines[0] and len(lines) == 1
    ports, lines = resolve({**CALENDAR, "ENV_CALENDAR_ENV_PORT": "9000"}, {"calendar_env": (entry,)})
    assert ports["calendar_env"].port == 9000 and lines == []  # .env says where: nothing to say
