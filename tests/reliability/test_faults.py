"""Faults injected into a CPU training run on the real compose.yaml (model-init -> trainer-cpu -> env-echo).

- env server crash mid-training: the env-echo container's server process is SIGKILLed from the host
  (what the OOM killer or a segfault does) while a batch of rollouts holds episodes it reset there and
  the trainer waits on the server (`hold_batch_at_server`: the server is stopped the moment the batch's
  resets are in, and the trainer is frozen with `docker pause` once it waits on it). Compose's
  `restart: unless-stopped` brings the server back while the trainer is still frozen, so it cannot run
  ahead of the restart however fast or slow this machine is; thawed, its in-flight tool calls fail
  (counted in metrics as tool failures), its sessions reconnect on their next episode, and training
  finishes with every step logged once. Every wait is on an event (/health counters, the kernel's
  socket queues, metrics.jsonl, Docker's restart count and health status); deadlines only stop a hang.
  Note: `docker kill` / `docker stop` count as a *manual* stop, and Docker does not restart a
  container after one (checked here on engine 20.10): a crash, not an operator's kill, is the fault.
- trainer killed mid-run and resumed: covered by tests/trainer/test_cpu_training_docker.py
  (test_kill_and_resume_loses_and_repeats_no_step), not repeated here to keep CI short.
- vLLM (CPU twin) restart: not covered; the CPU trainer cannot use vLLM server mode (see report).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.request

import pytest

from tests.helpers import ROOT, build_images, compose_stack
from tests.reliability.common import container_id, report

pytestmark = [pytest.mark.docker, pytest.mark.slow]

RUN = "envcrash"
MAX_STEPS = int(os.environ.get("FAULT_MAX_STEPS", "16"))
CRASH_AFTER_STEP = 3
# A rollout that answers without the tool keeps its session at "reset" too (the tiny model skips the tool in
# some rollouts), so only a whole generation batch awaiting its first step says every rollout is still in its
# first turn: the default PER_DEVICE_TRAIN_BATCH_SIZE x STEPS_PER_GENERATION (8 x 1).
IN_FLIGHT = 8


class Project:
    def __init__(self, stack, env_file) -> None:
        self.stack, self.project = stack, stack.project
        self.base = ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "--env-file", str(env_file)]

    def compose(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        res = subprocess.run([*self.base, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} -> {res.returncode}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}")
        return res

    def read(self, path: str) -> str:
        res = self.compose("run", "--rm", "--no-deps", "--entrypoint", "cat", "trainer-cpu", path, check=False)
        return res.stdout if res.returncode == 0 else ""


def inspect(name: str) -> dict:
    out = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]


def steps_logged(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("kind") == "step":
            rows.append(row)
    return rows


@pytest.fixture(scope="module")
def project(docker, tmp_path_factory):
    build_images("env-server", "trainer-cpu")
    tmp = tmp_path_factory.mktemp("faults")
    overrides = {"RUN_NAME": RUN, "MAX_CONCURRENT_ENVS": "16", "TRAIN_MODE": "cpu", "SAVE_STEPS": "4"}
    with compose_stack(tmp, ["cpu", "echo"], services=["env-echo"], overrides=overrides) as stack:
        proj = Project(stack, tmp / f"{stack.project}.env")
        proj.compose("run", "--rm", "model-init")
        yield proj


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def running(name: str) -> bool:
    return inspect(name)["State"]["Running"]


def process_alive(pid: int) -> bool:
    """A container's main process, seen from the host: gone (or a zombie) once the container exited."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def envnet_ip(container: str) -> str:
    nets = inspect(container)["NetworkSettings"]["Networks"]
    [ip] = [net["IPAddress"] for name, net in nets.items() if name.endswith("envnet")]
    return ip


# Any request of the trainer (a reset, a step, a new session's handshake) is 36 bytes or more on the wire; the
# only frames a client sends unasked are keepalive pings and pongs, 10 bytes each, one per 20 s.
REQUEST_BYTES = 32


def unread_requests(server_pid: int, client_ip: str, port: int = 8000) -> int:
    """Connections from `client_ip` with a request sitting unread in the server's socket. The kernel's table
    for the server's network namespace (/proc/PID/net/tcp): readable while the server process is stopped."""
    waiting = 0
    with open(f"/proc/{server_pid}/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            _, local, remote, state, queues = line.split()[:5]
            if state != "01" or int(local.split(":")[1], 16) != port:  # ESTABLISHED, on the server's port
                continue
            if socket.inet_ntoa(struct.pack("<I", int(remote.split(":")[0], 16))) != client_ip:
                continue
            waiting += int(queues.split(":")[1], 16) >= REQUEST_BYTES  # rx_queue: bytes not yet read
    return waiting


def hold_batch_at_server(project: "Project", trainer: str, env_cid: str, logged, guard_s: float = 900) -> dict:
    """Stop the env server (SIGSTOP) the moment a batch of rollouts has reset on it, let the trainer run
    until it waits on the server, freeze the trainer there, and check it is still inside that batch.

    Each step waits on an event, never on how long generation or a `docker` command takes here:
    1. /health: `episodes_started` moved since the previous read and `episodes_awaiting_step` counts the
       whole batch (IN_FLIGHT; a rollout that answers without the tool stays at "reset" too, so fewer
       would not say the batch has not called yet): the batch's resets are in and none of its steps. The
       server is stopped right then, by a signal from this process: whatever the trainer sends from now
       on stays unread and unanswered, and its tool round can no longer finish.
    2. The kernel shows a request of the trainer sitting unread in the stopped server's socket: the
       trainer is waiting on the server. It is frozen (`docker pause`) there.
    3. metrics.jsonl: no step logged since 1. So the trainer is inside that batch: its rollouts' episodes
       live on this server and no tool call of theirs can be answered before the crash. A step logged
       since 1 means the batch's calls were answered in the instant between the read and the stop (or it
       called no tool): the server and the trainer go on, and the next batch is held instead.
    Returns with the server stopped and the trainer frozen. `guard_s` only stops a hang.
    """
    url = f"http://{project.compose('port', 'env-echo', '8000').stdout.strip()}"
    server_pid = inspect(env_cid)["State"]["Pid"]
    trainer_ip = envnet_ip(trainer)
    let_go: list[int] = []  # steps after which a held batch had already been answered
    deadline = time.monotonic() + guard_s

    trainer_pid = inspect(trainer)["State"]["Pid"]

    def alive(what: str) -> None:  # no docker CLI in the polling loops: /proc, at once
        assert process_alive(trainer_pid), f"training ended {what} (batches held and let go after steps {let_go})"
        assert time.monotonic() < deadline, f"no batch held in {guard_s:.0f} s ({what}; let go after {let_go})"

    while True:
        before = health(url)
        while True:  # 1.
            now = health(url)
            if (now.get("episodes_started") != before.get("episodes_started")
                    and (now.get("episodes_awaiting_step") or 0) >= IN_FLIGHT):
                break
            before = now
            alive("before a batch was held")
            time.sleep(0.005)
        held_at = time.time()
        os.kill(server_pid, signal.SIGSTOP)
        try:
            while not (waiting := unread_requests(server_pid, trainer_ip)):  # 2.
                alive("while the env server was stopped")
                time.sleep(0.01)
            subprocess.run(["docker", "pause", trainer], check=True, capture_output=True)
            rows = logged()
            if not [r for r in rows if r["time"] > held_at]:  # 3.
                return {**now, "unread_requests": waiting, "last_step": rows[-1]["step"], "server_pid": server_pid,
                        "let_go": let_go}
            let_go.append(rows[-1]["step"])
            subprocess.run(["docker", "unpause", trainer], check=True, capture_output=True)
        except BaseException:
            os.kill(server_pid, signal.SIGCONT)  # a failed test leaves no stopped process behind
            raise
        os.kill(server_pid, signal.SIGCONT)


def crash(server_pid: int) -> None:
    """SIGKILL the server process from the host: a crash, which Compose's restart policy answers."""
    os.kill(server_pid, signal.SIGKILL)


def wait_restarted_healthy(env_cid: str, old_pid: int, restarts: int, guard_s: float = 600) -> float:
    """Until Docker has restarted the container (a new process) and its healthcheck passed; the deadline
    only stops a hang."""
    t0 = time.monotonic()
    while True:
        state = inspect(env_cid)
        if (state["RestartCount"] >= restarts and state["State"]["Running"] and state["State"]["Pid"] not in (0, old_pid)
                and state["State"].get("Health", {}).get("Status") == "healthy"):
            return time.monotonic() - t0
        assert time.monotonic() < t0 + guard_s, f"env-echo not restarted and healthy after {guard_s:.0f} s: {state['State']}"
        time.sleep(0.3)


def tool_failures(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if (r.get("tools/failure_frequency") or 0) > 0
            or (r.get("env/echo/tool_failure_frequency") or 0) > 0]


def test_env_server_crash_mid_training_is_survived(project):
    env_cid = container_id(project.project, "env-echo")
    trainer = f"{project.project}-trainer-envcrash"
    project.compose("run", "-d", "--name", trainer, "trainer-cpu", "python", "-m", "trainer.train",
                    "--max-steps", str(MAX_STEPS), "--resume", "fresh")

    def logged() -> list[dict]:
        return steps_logged(project.read(f"/outputs/{RUN}/metrics.jsonl"))  # from the volume: works while frozen

    def logged_live() -> list[dict]:  # cheaper while the trainer runs
        res = subprocess.run(["docker", "exec", trainer, "cat", f"/outputs/{RUN}/metrics.jsonl"],
                             capture_output=True, text=True)
        return steps_logged(res.stdout)

    try:
        # 1. A few steps in, hold a batch of rollouts whose episodes the env server has reset but not yet
        #    answered a tool call of (the server stopped, the trainer frozen while it waits on it); crash the
        #    server; let Compose restart it, healthy, while the trainer is still frozen; then thaw it. The
        #    held rollouts' tool calls go to sessions that died with the server.
        deadline = time.monotonic() + 900  # a hang guard only
        while not (reached := [r["step"] for r in logged_live() if r["step"] >= CRASH_AFTER_STEP]):
            assert running(trainer), f"training ended before step {CRASH_AFTER_STEP}"
            assert time.monotonic() < deadline, f"training did not reach step {CRASH_AFTER_STEP} in 900 s"
            time.sleep(0.3)
        held = hold_batch_at_server(project, trainer, env_cid, logged)
        crashed_after = held["last_step"]
        crash(held["server_pid"])
        healthy_s = wait_restarted_healthy(env_cid, held["server_pid"], 1)
        subprocess.run(["docker", "unpause", trainer], check=True, capture_output=True)

        # 2. training finishes: `docker wait` returns when the trainer exits (the timeout only stops a hang).
        try:
            subprocess.run(["docker", "wait", trainer], capture_output=True, timeout=1800)
        except subprocess.TimeoutExpired:
            pass
        final = inspect(trainer)["State"]
        logs = subprocess.run(["docker", "logs", trainer], capture_output=True, text=True)
        log_text = logs.stdout + logs.stderr
        assert not final["Running"], "training did not finish within 30 minutes after the crash"
        assert final["ExitCode"] == 0, f"training died after the env server crash (exit {final['ExitCode']}):\n" \
                                       + log_text[-4000:]
    finally:
        subprocess.run(["docker", "rm", "-f", trainer], capture_output=True)

    # 3. nothing lost: every step once; in-flight rollouts' tool errors counted; sessions came back.
    rows = logged()
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "a step was lost or logged twice"
    failed = tool_failures([r for r in rows if r["step"] > crashed_after])
    assert failed, (f"no step after the crash (after step {crashed_after}, {held['episodes_awaiting_step']} "
                    f"episodes reset and {held['unread_requests']} requests unanswered) shows a tool failure: "
                    f"{[(r['step'], r.get('tools/failure_frequency')) for r in rows]}")
    tail = rows[-3:]
    assert all((r.get("tools/call_frequency") or 0) > 0 and (r.get("tools/failure_frequency") or 0) == 0
               for r in tail), f"sessions did not recover: {[(r['step'], r.get('tools/call_frequency'), r.get('tools/failure_frequency')) for r in tail]}"
    fail_freq = {r["step"]: round(r.get("tools/failure_frequency") or 0, 2) for r in rows if r["step"] in failed}
    report(f"fault env-crash: SIGKILL of env-echo's server after step {crashed_after} with the trainer frozen, "
           f"{held['episodes_awaiting_step']} episodes reset there and {held['unread_requests']} requests of the "
           f"trainer unanswered (looked from step {reached[-1]}, batches let go: {len(held['let_go'])}); healthy again {healthy_s:.1f}s later; tool "
           f"failure frequency {fail_freq}; training finished (exit 0), all {MAX_STEPS} steps logged once; "
           "last 3 steps: tools called, no failures")
