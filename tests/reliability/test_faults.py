"""Faults injected into a CPU training run on the real compose.yaml (model-init -> trainer-cpu -> env-echo).

- env server crash mid-training: the env-echo container's server process is SIGKILLed from the host
  (what the OOM killer or a segfault does). Compose's `restart: unless-stopped` brings it back; the
  trainer's in-flight tool calls fail (counted in metrics as tool failures; the second crash of each
  round waits until the server reports rollouts starting episodes), its sessions reconnect
  on their next episode, and training finishes with every step logged once.
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


def crash(env_cid: str) -> int:
    pid = inspect(env_cid)["State"]["Pid"]
    subprocess.run(["kill", "-KILL", str(pid)], check=True)
    return pid


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}


def crash_mid_episode(project: "Project", env_cid: str, trainer: str, timeout_s: float = 240) -> tuple[int, str]:
    """SIGKILL the env server while rollouts are between their reset and their tool call.

    The server counts reset frames (`episodes_started` in /health): when the count rises, a batch of
    rollouts has just reset and the policy is generating their first turn, so crashing now makes
    their tool calls fail. Polled over the published loopback port, a few ms apart. The timeout leaves
    room for a rollout stalled on a connection the crash cut without a FIN: keepalive (20 s pings,
    60 s timeout) finds it, then the rollout reconnects.
    """
    deadline = time.monotonic() + timeout_s
    url, seen, last_check = None, None, time.monotonic()
    while time.monotonic() < deadline:
        state = inspect(env_cid)["State"]
        if state["Running"] and state.get("Health", {}).get("Status") == "healthy":
            url = url or f"http://{project.compose('port', 'env-echo', '8000').stdout.strip()}"
            pid = state["Pid"]  # looked up now: at the moment to crash, every millisecond counts
            while time.monotonic() < deadline:
                started = health(url).get("episodes_started")
                if started is None:
                    seen = None  # restarting: a new process counts from 0
                    break
                if seen is not None and started > seen:
                    os.kill(pid, signal.SIGKILL)
                    return pid, "right after rollouts reset (episodes in flight)"
                seen = started
                time.sleep(0.003)
                if time.monotonic() - last_check > 1:
                    break  # look at the containers again
        if not inspect(trainer)["State"]["Running"]:
            break  # training ended: the assertion below says how
        last_check = time.monotonic()
        time.sleep(0.05)
    logs = subprocess.run(["docker", "logs", "--tail", "30", trainer], capture_output=True, text=True)
    raise AssertionError(
        f"never saw an episode in flight on env-echo ({url}: episodes_started stayed {seen}); trainer "
        f"{inspect(trainer)['State'].get('Status')}, its last log lines:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}"
    )


def wait_restarted_healthy(env_cid: str, restarts: int, timeout_s: float = 120) -> float:
    t0 = time.monotonic()
    while time.monotonic() < t0 + timeout_s:
        state = inspect(env_cid)
        if state["RestartCount"] >= restarts and state["State"].get("Health", {}).get("Status") == "healthy":
            return time.monotonic() - t0
        time.sleep(0.3)
    raise AssertionError(f"env-echo not restarted and healthy after {timeout_s}s: {inspect(env_cid)['State']}")


def tool_failures(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if (r.get("tools/failure_frequency") or 0) > 0
            or (r.get("env/echo/tool_failure_frequency") or 0) > 0]


def test_env_server_crash_mid_training_is_survived(project):
    env_cid = container_id(project.project, "env-echo")
    trainer = f"{project.project}-trainer-envcrash"
    project.compose("run", "-d", "--name", trainer, "trainer-cpu", "python", "-m", "trainer.train",
                    "--max-steps", str(MAX_STEPS), "--resume", "fresh")

    def logged() -> list[dict]:
        res = subprocess.run(["docker", "exec", trainer, "cat", f"/outputs/{RUN}/metrics.jsonl"],
                             capture_output=True, text=True)
        return steps_logged(res.stdout)

    def wait_for_step(step: int, timeout_s: float = 420) -> list[dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rows = logged()
            if rows and rows[-1]["step"] >= step:
                return rows
            if not inspect(trainer)["State"]["Running"]:
                return rows
            time.sleep(0.3)
        raise AssertionError(f"training did not reach step {step} in {timeout_s}s")

    crashes: list[tuple[int, str]] = []  # (steps logged when it crashed, how)
    try:
        # 1. Crash the env server mid-run (any moment), then again as soon as the trainer's rollouts
        #    have reconnected (they are in flight then). Up to two rounds, until tool failures show.
        rows = wait_for_step(CRASH_AFTER_STEP)
        for _ in range(3):
            crash(env_cid)
            crashes.append((rows[-1]["step"], "at a random moment"))
            wait_restarted_healthy(env_cid, len(crashes))
            _, how = crash_mid_episode(project, env_cid, trainer)
            crashes.append((logged()[-1]["step"], how))
            # 2. Compose's restart policy brings it back, healthy; training goes on.
            healthy_s = wait_restarted_healthy(env_cid, len(crashes))
            rows = wait_for_step(crashes[-1][0] + 2)
            if tool_failures([r for r in rows if r["step"] >= crashes[-1][0]]) or rows[-1]["step"] >= MAX_STEPS - 4:
                break

        # 3. training finishes.
        deadline = time.monotonic() + 600
        while inspect(trainer)["State"]["Running"] and time.monotonic() < deadline:
            time.sleep(1)
        final = inspect(trainer)["State"]
        logs = subprocess.run(["docker", "logs", trainer], capture_output=True, text=True)
        log_text = logs.stdout + logs.stderr
        assert not final["Running"], "training did not finish within 10 minutes after the crashes"
        assert final["ExitCode"] == 0, f"training died after the env server crash (exit {final['ExitCode']}):\n" \
                                       + log_text[-4000:]
    finally:
        subprocess.run(["docker", "rm", "-f", trainer], capture_output=True)

    # 4. nothing lost: every step once; in-flight rollouts' tool errors counted; sessions came back.
    rows = steps_logged(project.read(f"/outputs/{RUN}/metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "a step was lost or logged twice"
    failed = tool_failures([r for r in rows if r["step"] >= crashes[0][0]])
    assert failed, (f"no crash left a tool failure in the metrics (crashes: {crashes}); "
                    f"{[(r['step'], r.get('tools/failure_frequency')) for r in rows]}")
    tail = rows[-3:]
    assert all((r.get("tools/call_frequency") or 0) > 0 and (r.get("tools/failure_frequency") or 0) == 0
               for r in tail), f"sessions did not recover: {[(r['step'], r.get('tools/call_frequency'), r.get('tools/failure_frequency')) for r in tail]}"
    fail_freq = {r["step"]: round(r.get("tools/failure_frequency") or 0, 2) for r in rows if r["step"] in failed}
    report(f"fault env-crash: {len(crashes)} SIGKILLs of env-echo's server during a {MAX_STEPS}-step CPU run: "
           + "; ".join(f"after step {s} {how}" for s, how in crashes)
           + f"; healthy again {healthy_s:.1f}s after the last; tool failure frequency {fail_freq}; training "
           f"finished (exit 0), all {MAX_STEPS} steps logged once; last 3 steps: tools called, no failures")
