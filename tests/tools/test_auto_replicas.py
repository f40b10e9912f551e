"""ENV_<NAME>_REPLICAS=auto (tools/env_replicas.py): the default for an env learned from its image. The rule, the
one line it prints, the numbers Compose and a Swarm fleet get, and real measurements of a one-session image and of
ours (`make train` with auto is in tests/envs/test_generic_containers.py)."""

from __future__ import annotations

import subprocess

import pytest

import tools.env_replicas as env_replicas
from tools import docker_host, env_ports, images
from tools import settings
from tools.env_replicas import Measurement, ReplicasError, auto_envs, replicas_for

LEARNED, BUILTIN = ["connect4"], ["echo"]


def test_auto_is_the_default_for_a_learned_env_and_opt_in_for_a_built_in_one():
    assert auto_envs({}, LEARNED, BUILTIN) == ["connect4"]
    assert auto_envs({"ENV_CONNECT4_REPLICAS": "3"}, LEARNED, BUILTIN) == []
    assert auto_envs({"ENV_CONNECT4_REPLICAS": "AUTO", "ENV_ECHO_REPLICAS": "auto"}, LEARNED, BUILTIN) == \
        ["connect4", "echo"]
    assert auto_envs({"ENV_ECHO_REPLICAS": "2"}, LEARNED, BUILTIN) == ["connect4"]


@pytest.mark.parametrize("value", ["0", "-1", "many", "2.5"])
def test_a_replica_count_that_is_neither_a_number_nor_auto_is_one_line(value):
    with pytest.raises(ReplicasError, match=rf"ENV_CONNECT4_REPLICAS='{value}': a number of containers .* or `auto`"):
        auto_envs({"ENV_CONNECT4_REPLICAS": value}, LEARNED, BUILTIN)


def test_containers_cover_the_sessions_and_the_line_says_why():
    count, line = replicas_for("connect4", 8, Measurement(1, 8, "counted"), most=16)
    assert count == 8
    assert line == ("env connect4: 1 session(s) per container (counted); running 8 container(s) for the 8 sessions "
                    "this run opens (ENV_CONNECT4_REPLICAS=auto, at most ENV_REPLICAS_MAX=16)")
    assert replicas_for("x", 10, Measurement(4, 10, "counted"), 16)[0] == 3
    assert replicas_for("x", 64, Measurement(256, 256, "reported by /health"), 16)[0] == 1
    # a count that reached its target is a lower bound: one container held them all
    count, line = replicas_for("x", 8, Measurement(8, 8, "counted"), 16)
    assert count == 1 and "8+ session(s) per container" in line


def test_past_the_cap_or_with_no_session_at_all_the_run_stops_with_the_fix():
    with pytest.raises(ReplicasError, match="need 64 containers, more than ENV_REPLICAS_MAX=16: raise ENV_REPLICAS_MAX"):
        replicas_for("connect4", 64, Measurement(1, 64, "counted"), 16)
    with pytest.raises(ReplicasError, match="accepted no session"):
        replicas_for("connect4", 8, Measurement(0, 8, "counted"), 16)


def test_a_stored_count_that_stopped_at_a_lower_target_is_measured_again_for_a_bigger_run():
    assert Measurement(1, 8, "counted").covers(64)  # exact: the count stopped below its target
    assert Measurement(8, 8, "counted").covers(8) and not Measurement(8, 8, "counted").covers(16)
    assert Measurement(256, 256, "reported by /health").covers(1024)


def test_compose_and_the_fleet_get_the_resolved_number(tmp_path, monkeypatch):
    env_file = tmp_path / "auto.env"
    env_file.write_text("TRAIN_MODE=cpu\nENV_NAME=connect4\nENV_CONNECT4_IMAGE=example/connect4:1\n"
                        "ENV_CONNECT4_REPLICAS=auto\nENV_FLEET=swarm\n")
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    env = settings.load_env()
    from tools.plan import make_plan

    assert make_plan(env, None).compose_vars([])["ENV_CONNECT4_REPLICAS"] == "1"  # before any `make up`: valid, no measuring
    import tools.fleet as fleet

    resolved = {**env, "ENV_CONNECT4_REPLICAS": "7"}  # what resolve_auto_replicas returns after measuring
    assert fleet.stack_file(resolved)["services"]["env-connect4"]["deploy"]["replicas"] == 7


def test_the_one_session_fixture_and_our_env_server_measured_for_real(docker):
    from tests.envs.test_generic_containers import fixture_image
    from tests.helpers import build_images

    build_images("env-server")
    guess = fixture_image("guess")
    said: list[str] = []
    measured = env_replicas.measure(guess, 4, {}, docker_host.run, said.append, port=env_ports.default("guess"))
    assert measured == Measurement(1, 4, "counted")  # stock create_app: one session per container
    assert said and "measuring how many sessions one grpo-fixture/guess:local container holds" in said[0]
    # on port 80: below 1024, yet served as compose.yaml runs it, non-root with every capability dropped (Docker sets
    # net.ipv4.ip_unprivileged_port_start=0 in a container's network namespace), so ENV_<NAME>_PORT needs no check
    ours = env_replicas.measure(images.local_env_image(), 4, {"MAX_CONCURRENT_ENVS": "32"}, docker_host.run, said.append,
                                port=env_ports.EnvPort(80, "ENV_ECHO_PORT in .env"), builtin_env="echo")
    assert ours == Measurement(32, 32, "reported by /health")
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "label=grpo-capacity=1"], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # the measured containers and their networks are gone
