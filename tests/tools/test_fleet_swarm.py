"""An env-server fleet on a real single-node Docker Swarm, trained against from Compose (docs/fleets.md).

The module joins this engine to a swarm when it is in none (and leaves it afterwards; a swarm it found is kept),
then, as a user drives it with an env file (ENV_FLEET=swarm, 3 echo tasks):
  * `fleet up` deploys the stack with the settings the issue asks for (read back from Swarm, not from our file);
  * `train` (what `make train` runs) trains the CPU profile with sessions on every fleet task;
  * a run is frozen (`docker pause`) after step 3 while one task is killed, Swarm replaces it and the service is
    scaled to 4; unfrozen, it finishes with every step logged once and its sessions on the 4 live tasks;
  * `fleet down` leaves no service, container or network.
Freezing the trainer is what keeps this deterministic: nothing it does can race the fleet's changes.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from tests.helpers import TRAINER_CPU_IMAGE, EnvFileStack, build_images, seed_models_volume
from tools.images import local_env_image

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.swarm]  # joins and leaves this engine's swarm

TASKS = 3


def cli(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {res.returncode}: {res.stderr[-2000:]}")
    return res


@pytest.fixture(scope="module")
def swarm(docker):
    from tools.fleet import local_swarm

    with local_swarm():  # joined to none: initialised now, left at the end
        yield


@pytest.fixture(scope="module")
def fleet(swarm, tmp_path_factory, tiny_model_dir):
    build_images("env-server", "trainer-cpu")
    stack = EnvFileStack(tmp_path_factory.mktemp("fleet"), {
        "TRAIN_MODE": "cpu", "ENV_NAME": "echo", "ENV_FLEET": "swarm", "ENV_ECHO_REPLICAS": str(TASKS),
        "MAX_CONCURRENT_ENVS": "64", "PER_DEVICE_TRAIN_BATCH_SIZE": "8",
        "FLEET_ALLOW_NEW_PRIVILEGES": "1",  # this engine's daemon.json is not ours to set (test_fleet_nnp.py)
    })
    stack.name = f"{stack.project}-fleet"
    stack.env_file.write_text(stack.env_file.read_text() + f"FLEET_STACK={stack.name}\n")
    up = stack.stack("fleet", "up")
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert "note: FLEET_ALLOW_NEW_PRIVILEGES=1: fleet tasks run without no-new-privileges" in up.stdout
    seed_models_volume(stack.project, tiny_model_dir, TRAINER_CPU_IMAGE)  # model-init finds it complete
    init = stack.stack("compose", "run", "--rm", "model-init")  # the CPU profile's tiny model, as `train` makes it
    assert init.returncode == 0, init.stdout[-3000:] + init.stderr[-3000:]
    yield stack
    for c in cli("ps", "-aq", "--filter", f"label=com.docker.compose.project={stack.project}").stdout.split():
        cli("rm", "-f", c, check=False)
    stack.down()
    stack.stack("fleet", "down")  # again, idempotent: test_fleet_down_leaves_nothing_behind asserts it


def service(stack) -> str:
    return f"{stack.name}_env-echo"


def running_tasks(stack) -> list[dict]:
    out = cli("service", "ps", service(stack), "--filter", "desired-state=running", "--format", "json").stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def task_containers(stack) -> dict[str, str]:
    """Task name (`<stack>_env-echo.N`) -> container id, for running tasks."""
    out = cli("ps", "--filter", f"label=com.docker.swarm.service.name={service(stack)}", "--format",
                 '{{.ID}} {{.Label "com.docker.swarm.task.name"}}').stdout
    return {name.rsplit(".", 1)[0]: cid for cid, name in (line.split() for line in out.splitlines())}


def task_address(cid: str, network: str) -> str:
    nets = json.loads(cli("inspect", cid, "--format", "{{json .NetworkSettings.Networks}}").stdout)
    return nets[network]["IPAddress"]


def tasks_dns(stack) -> list[str]:
    """What `tasks.env-echo` answers on the fleet's network now (a throw-away container, as the trainer asks)."""
    res = cli("run", "--rm", "--network", stack.name, "--entrypoint", "python", local_env_image(), "-c",
              "import socket; print(' '.join(sorted({a[4][0] for a in socket.getaddrinfo('tasks.env-echo', 8000, "
              "socket.AF_INET)})))", check=False)
    return res.stdout.split()


def test_fleet_up_deploys_what_the_issue_asks_for(fleet):
    spec = json.loads(cli("service", "inspect", service(fleet)).stdout)[0]["Spec"]
    task = spec["TaskTemplate"]
    assert spec["Mode"]["Replicated"]["Replicas"] == TASKS
    assert spec["EndpointSpec"]["Mode"] == "dnsrr"  # the VIP needs IPVS; the trainer resolves the tasks
    assert task["Placement"]["Preferences"] == [{"Spread": {"SpreadDescriptor": "node.id"}}]
    assert task["Placement"]["Constraints"] == ["node.labels.grpo.role != gpu"]
    assert task["RestartPolicy"]["Condition"] == "any"
    assert spec["UpdateConfig"]["Order"] == "start-first" and spec["UpdateConfig"]["Parallelism"] == 1
    assert spec["UpdateConfig"]["FailureAction"] == "rollback"
    assert task["Resources"]["Limits"] == {"MemoryBytes": 4 << 30, "Pids": 512}
    container = task["ContainerSpec"]
    assert container["ReadOnly"] is True and container["CapabilityDrop"] == ["ALL"]
    assert container["Healthcheck"]["Test"][:2] == ["CMD", "bash"]
    assert "MAX_CONCURRENT_ENVS=64" in container["Env"]  # the same .env values as the Compose stack
    net = json.loads(cli("network", "inspect", fleet.name).stdout)[0]
    assert net["Driver"] == "overlay" and net["Attachable"] is True and "encrypted" in net["Options"]
    cid = next(iter(task_containers(fleet).values()))
    assert cli("exec", cid, "id", "-u").stdout.strip() == "10001"  # non-root
    # no-new-privileges comes from the daemon only (test_fleet_nnp.py): nothing of the image's stands in for it
    assert "setpriv" not in json.dumps(container)
    assert len(running_tasks(fleet)) == TASKS


def test_make_train_spreads_sessions_over_every_fleet_task(fleet):
    res = fleet.stack("train", "--max-steps", "2", "--resume", "fresh", "--run-name", "fleet-spread")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-5000:]
    assert f"[preflight] ok: env echo: {TASKS} fleet task(s) healthy; capacity {64 * TASKS} sessions in all" in out
    [line] = [x for x in out.splitlines() if x.startswith("[train] env echo: 8 sessions over")]
    opened = dict(re.findall(r"([\w.-]+_env-echo\.\d) \([0-9.]+\): \d+ open, (\d+) opened", line))
    assert sorted(opened) == sorted(task_containers(fleet)), line  # every task, named by Swarm's task name
    assert sorted(map(int, opened.values())) == [2, 3, 3], line


def test_a_killed_task_and_a_scale_up_during_a_run(fleet):
    # frozen once step 3 is read (0.5 s polls), so steps remain after the unfreeze: the sessions on the dead task fail
    # in the first of them and reopen on the live tasks, and the run's last line shows where they went (40 steps before)
    run, steps = "fleet-faults", 12
    name = f"{fleet.project}-faults"
    res = fleet.stack("compose", "run", "-d", "--name", name, "--no-deps", "trainer-cpu", "python", "-m",
                      "trainer.launch", "--max-steps", str(steps), "--resume", "fresh", "--run-name", run)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    deadline = time.monotonic() + 900
    while True:  # frozen right after step 3 is logged (a docker call after the read: it cannot run ahead)
        logged = cli("exec", name, "sh", "-c", f"cat /outputs/{run}/metrics.jsonl 2>/dev/null", check=False).stdout
        if sum('"kind": "step"' in x for x in logged.splitlines()) >= 3:
            cli("pause", name)
            break
        assert time.monotonic() < deadline, cli("logs", name, check=False).stdout[-4000:]
        time.sleep(0.5)
    logged = fleet.read(f"/outputs/{run}/metrics.jsonl")  # read again now that it is frozen
    paused_at = max(json.loads(x)["step"] for x in logged.splitlines() if '"kind": "step"' in x)
    assert paused_at < steps, "the run ended before it could be frozen"

    victim, cid = sorted(task_containers(fleet).items())[1]
    victim_ip = task_address(cid, fleet.name)
    cli("kill", cid)  # the task dies with some of the trainer's sessions on it
    cli("service", "scale", "--detach", f"{service(fleet)}=4")
    deadline = time.monotonic() + 300
    while True:  # Swarm replaced the dead task and added one: what the trainer's DNS lookups will answer
        answer = tasks_dns(fleet)
        if len(answer) == 4 and victim_ip not in answer:
            break
        assert time.monotonic() < deadline, (answer, running_tasks(fleet))
        time.sleep(1)
    cli("unpause", name)

    assert cli("wait", name, timeout=1200).stdout.strip() == "0", cli("logs", name, check=False).stdout[-5000:]
    out = cli("logs", name).stdout
    cli("rm", name)
    rows = [json.loads(x) for x in fleet.read(f"/outputs/{run}/metrics.jsonl").splitlines() if x.startswith("{")]
    assert [r["step"] for r in rows if r.get("kind") == "step"] == list(range(1, steps + 1))  # each once
    assert re.search(rf"\[envs\] http://tasks\.env-echo:8000: 4 replica\(s\) now; added .*; gone {re.escape(victim)}",
                     out), out[-5000:]
    [line] = [x for x in out.splitlines() if x.startswith("[train] env echo: 8 sessions over 4 replica(s)")]
    per_task = re.findall(r"([\w.-]+_env-echo\.\d) \(([0-9.]+)\): (\d+) open, (\d+) opened", line)
    live = {(t, int(now)) for t, _, now, _ in per_task if int(now)}
    assert len(live) == 4 and sum(n for _, n in live) == 8, line  # the 4 live tasks, the new one included
    assert sum(int(opened) for *_, opened in per_task) > 8, line  # sessions reconnected
    assert sorted(t for t, _ in live) == sorted(task_containers(fleet)), line


def test_fleet_down_leaves_nothing_behind(fleet):
    res = fleet.stack("fleet", "down")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"fleet {fleet.name}: removed" in res.stdout
    label = f"label=com.docker.stack.namespace={fleet.name}"
    assert cli("service", "ls", "-q", "--filter", label).stdout.split() == []
    assert cli("ps", "-aq", "--filter", label).stdout.split() == []
    assert cli("network", "inspect", fleet.name, check=False).returncode != 0
