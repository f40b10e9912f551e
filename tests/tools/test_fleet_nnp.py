"""Fleet tasks' no-new-privileges comes from each node's Docker daemon, never from the image it restricts (#44).

Swarm drops `security_opt`. The fleet used to start tasks through the image's own `setpriv`, after probing it in an
unhardened `docker run` of that image: a `setpriv` script that dropped the flag passed (`NoNewPrivs: 0`). Now the env
image never runs before the deploy; `fleet up` runs our own image as a one-shot job on every env node, reads the flag
the daemon gives it, and refuses unless every node has it or .env opts out (FLEET_ALLOW_NEW_PRIVILEGES=1).
The host tests drive tools.fleet against a fake `docker`; the last one runs the check on this engine's swarm.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tools import fleet
from tools.errors import StackError

HOSTILE = "hostile/setpriv-liar:1"  # an env image whose setpriv would lie
NODES = {"n1": "gpu-host ready active gpu", "n2": "cpu-a ready active ", "n3": "cpu-b ready active ",
         "n4": "cpu-c ready drain "}


class FakeDocker:
    """Answers the docker commands tools.fleet runs; `tasks` is what `docker service ps` of the check job shows."""

    def __init__(self, tasks: list[dict], create_error: str = ""):
        self.tasks, self.calls, self.create_error = tasks, [], create_error

    def __call__(self, cmd: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
        self.calls.append(cmd)
        out = ""
        if cmd[1:3] == ["node", "ls"]:
            out = "\n".join(NODES)
        elif cmd[1:3] == ["node", "inspect"]:
            out = "\n".join(NODES[i] for i in cmd[cmd.index("--format") + 2:])
        elif cmd[1:3] == ["service", "ps"]:
            out = "\n".join(json.dumps(t) for t in self.tasks)
        elif cmd[1:3] == ["service", "create"] and self.create_error:
            return subprocess.CompletedProcess(cmd, 1, "", self.create_error)
        return subprocess.CompletedProcess(cmd, 0, out, "")


def task(node: str, state: str, error: str = "") -> dict:
    return {"Node": node, "CurrentState": f"{state} 2 seconds ago", "Error": json.dumps(error) if error else ""}


def test_a_fleet_service_never_runs_its_env_image_and_no_setpriv_stands_in(monkeypatch):
    fake = FakeDocker([])
    monkeypatch.setattr(fleet, "run", fake)
    svc = fleet.swarm_service({"image": HOSTILE, "healthcheck": {}, "cap_drop": ["ALL"], "user": "10001:10001",
                               "command": ["python3", "-m", "server"]})
    assert fake.calls == []  # neither `docker run` of the image nor an inspect: nothing of it is trusted
    assert "entrypoint" not in svc and svc["command"] == ["python3", "-m", "server"]


def test_fleet_up_is_refused_naming_each_env_node_whose_daemon_does_not_set_it(monkeypatch):
    fake = FakeDocker([task("cpu-a", "Complete"), task("cpu-b", "Failed", "task: non-zero exit (3)")])
    monkeypatch.setattr(fleet, "run", fake)
    problem = fleet.check_no_new_privileges("grpo-fleet", "grpo-stack/env-server:local")
    assert problem.startswith("fleet tasks get no-new-privileges only from each node's Docker daemon")
    assert "the Docker daemon of cpu-b does not set it: add \"no-new-privileges\": true to /etc/docker/daemon.json" \
        in problem and "restart Docker" in problem and "FLEET_ALLOW_NEW_PRIVILEGES=1" in problem
    assert "cpu-a" not in problem and "gpu-host" not in problem and "\n" not in problem
    [create] = [c for c in fake.calls if c[1:3] == ["service", "create"]]
    for flag, value in (("--mode", "global-job"), ("--limit-memory", "64m"), ("--limit-pids", "16"),
                        ("--cap-drop", "ALL"), ("--user", "10001:10001"), ("--name", "grpo-fleet-nnp-check"),
                        ("--constraint", "node.labels.grpo.role != gpu"), ("--restart-condition", "none")):
        assert create[create.index(flag) + 1] == value, flag
    assert "--read-only" in create and "--security-opt" not in create  # it reads the daemon's flag, not its own
    assert create[create.index("--") + 1] == "grpo-stack/env-server:local"  # our image, never an env's
    assert fake.calls[-1] == ["docker", "service", "rm", "grpo-fleet-nnp-check"]


def test_every_env_node_setting_it_passes_and_the_job_is_removed(monkeypatch):
    fake = FakeDocker([task("cpu-a", "Complete"), task("cpu-b", "Complete"), task("cpu-c", "Failed", "x")])
    monkeypatch.setattr(fleet, "run", fake)
    assert fleet.check_no_new_privileges("grpo-fleet", "img") is None  # cpu-c is drained: no env task lands there
    assert fake.calls[-1] == ["docker", "service", "rm", "grpo-fleet-nnp-check"]


def test_a_check_past_its_timeout_is_removed_by_name_and_says_which_nodes_did_not_answer(monkeypatch):
    fake = FakeDocker([task("cpu-a", "Rejected", "No such image: img"), task("cpu-b", "Running")])
    monkeypatch.setattr(fleet, "run", fake)
    monkeypatch.setattr(fleet.time, "sleep", lambda s: None)
    problem = fleet.check_no_new_privileges("grpo-fleet", "img", timeout_s=0)
    assert "cpu-a (rejected: No such image: img), cpu-b (no answer in 0 s) could not run the check with img: load it " \
           "there (`docker save img | ssh <node> docker load`)" in problem
    assert fake.calls[-1] == ["docker", "service", "rm", "grpo-fleet-nnp-check"]


def test_an_engine_that_cannot_run_the_job_is_named_with_what_to_do(monkeypatch):
    fake = FakeDocker([], create_error='invalid mode "global-job"')
    monkeypatch.setattr(fleet, "run", fake)
    problem = fleet.check_no_new_privileges("grpo-fleet", "img")
    assert problem.startswith('could not start the no-new-privileges check (invalid mode "global-job"): a swarm job '
                              "needs Docker 20.10 or newer") and "FLEET_ALLOW_NEW_PRIVILEGES=1" in problem
    assert fake.calls[-1] == ["docker", "service", "rm", "grpo-fleet-nnp-check"]


def test_the_opt_out_skips_the_check_with_a_note_and_a_bad_value_is_named(monkeypatch, capsys):
    fake = FakeDocker([])
    monkeypatch.setattr(fleet, "run", fake)
    fleet.require_no_new_privileges({"FLEET_ALLOW_NEW_PRIVILEGES": "1"})
    assert fake.calls == []
    assert "note: FLEET_ALLOW_NEW_PRIVILEGES=1: fleet tasks run without no-new-privileges" in capsys.readouterr().out
    with pytest.raises(StackError, match="FLEET_ALLOW_NEW_PRIVILEGES: .*edit .env"):
        fleet.require_no_new_privileges({"FLEET_ALLOW_NEW_PRIVILEGES": "maybe"})


def test_fleet_up_refuses_before_any_env_image_runs_or_the_stack_is_deployed(monkeypatch):
    from tools import docker_host

    monkeypatch.setattr(fleet, "require_manager", lambda: None)
    monkeypatch.setattr(docker_host, "check_custom_images", lambda envs: None)
    built = []
    monkeypatch.setattr(docker_host, "compose", lambda *a, **k: built.append(a) or 0)
    monkeypatch.setattr(fleet, "check_no_new_privileges", lambda name, image: "refused: the line")

    def never(*a, **k):
        raise AssertionError("ran before the no-new-privileges check")

    monkeypatch.setattr(docker_host, "resolve_auto_replicas", never)  # runs the env image to measure it
    monkeypatch.setattr(fleet, "write_stack_file", never)
    monkeypatch.setattr(fleet.subprocess, "run", never)  # `docker stack deploy`
    with pytest.raises(StackError, match="^refused: the line$"):
        fleet.cmd_up({"ENV_NAME": "connect4", "ENV_CONNECT4_IMAGE": HOSTILE, "ENV_FLEET": "swarm"})
    assert built  # our image is built first even for a fleet of other images: the check runs it


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.swarm  # joins and leaves this engine's swarm
def test_the_check_on_this_engines_swarm_reads_what_its_daemon_gives(docker):
    from tests.helpers import build_images
    from tools.images import local_env_image

    build_images("env-server")
    image = local_env_image()
    plain = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "grep", image, "NoNewPrivs",
                            "/proc/self/status"], capture_output=True, text=True, check=True).stdout.split()
    name = "grpo-test-fleetnnp"
    with fleet.local_swarm():
        problem = fleet.check_no_new_privileges(name, image)
        missing = fleet.check_no_new_privileges(name, "grpo-test-fleetnnp/missing:1", timeout_s=60)
        left = subprocess.run(["docker", "service", "ls", "-q", "--filter", f"name={name}-nnp-check"],
                              capture_output=True, text=True).stdout.split()
    if plain == ["NoNewPrivs:", "1"]:  # a daemon with "no-new-privileges": true
        assert problem is None
    else:
        assert "does not set it: add \"no-new-privileges\": true to /etc/docker/daemon.json" in problem, problem
    assert "could not run the check with grpo-test-fleetnnp/missing:1" in missing and "No such image" in missing
    assert left == []  # removed by name once done
