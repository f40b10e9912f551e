"""Faults injected into a CPU training run on the real compose.yaml (model-init -> trainer-cpu -> env-echo).

- env server crash mid-training: the env-echo container's server process is SIGKILLed from the host
  (what the OOM killer or a segfault does) while the trainer is frozen (`docker pause`) with reset
  episodes in flight, so the outcome does not depend on how fast this machine runs. Compose's
  `restart: unless-stopped` brings the server back; the thawed trainer's in-flight tool calls fail
  (counted in metrics as tool failures), its sessions reconnect on their next episode, and training
  finishes with every step logged once.
  Note: `docker kill` / `docker stop` count as a *manual* stop, and Docker does not restart a
  container after one (checked here on engine 20.10): a crash, not an operator's kill, is the fault.
- trainer killed mid-run and resumed: covered by tests/trainer/test_cpu_training_docker.py
  (test_kill_and_resume_loses_and_repeats_no_step), not repeated here to keep CI short.
- vLLM (CPU twin) restart: not covered; the CPU trainer cannot use vLLM server mode (see report).
"""

from __future__ import annotations

import json
import os
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


def freeze_with_episodes_in_flight(project: "Project", trainer: str, attempts: int = 100) -> dict:
    """Freeze the trainer (`docker pause`) at a moment when its rollouts hold reset episodes.

    No window to hit: the trainer is frozen first, then the server is asked. `episodes_awaiting_step`
    counts sessions whose last frame was a reset, i.e. rollouts whose first turn is being generated.
    A rollout that answered without a call stays there too, so the whole batch (IN_FLIGHT) must be: then
    no rollout of the batch has reached its tool round yet. TRL sends a batch's tool calls one at a time
    and waits for each reply, so at most one frame of the frozen trainer can still be on its way, and
    every other rollout that calls does so only after the trainer is thawed. Otherwise thaw, wait until
    the server sees new resets, and look again.
    """
    url = f"http://{project.compose('port', 'env-echo', '8000').stdout.strip()}"
    seen = []
    for _ in range(attempts):
        subprocess.run(["docker", "pause", trainer], check=True, capture_output=True)
        now = health(url)
        seen.append(now.get("episodes_awaiting_step"))
        if (now.get("episodes_awaiting_step") or 0) >= IN_FLIGHT:
            return now
        subprocess.run(["docker", "unpause", trainer], check=True, capture_output=True)
        if not inspect(trainer)["State"]["Running"]:
            break
        started = now.get("episodes_started")
        while inspect(trainer)["State"]["Running"]:  # until the next batch of rollouts resets
            later = health(url)
            if later.get("episodes_started") != started and (later.get("episodes_awaiting_step") or 0) >= IN_FLIGHT:
                break
            time.sleep(0.01)
    logs = subprocess.run(["docker", "logs", "--tail", "30", trainer], capture_output=True, text=True)
    raise AssertionError(
        f"never froze the trainer with episodes in flight (episodes_awaiting_step seen: {seen[-20:]}); trainer "
        f"{inspect(trainer)['State'].get('Status')}, its last log lines:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")


def crash(env_cid: str) -> None:
    """SIGKILL the server process from the host: a crash, which Compose's restart policy answers."""
    subprocess.run(["kill", "-KILL", str(inspect(env_cid)["State"]["Pid"])], check=True)


def wait_restarted_healthy(env_cid: str, restarts: int, timeout_s: float = 300) -> float:
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
        return steps_logged(project.read(f"/outputs/{RUN}/metrics.jsonl"))  # from the volume: works while frozen

    def logged_live() -> list[dict]:  # cheaper while the trainer runs
        res = subprocess.run(["docker", "exec", trainer, "cat", f"/outputs/{RUN}/metrics.jsonl"],
                             capture_output=True, text=True)
        return steps_logged(res.stdout)

    try:
        # 1. A few steps in, freeze the trainer while its rollouts hold reset episodes; crash the env
        #    server; let Compose restart it, healthy, while the trainer is still frozen (it cannot
        #    move on meanwhile, however fast or slow this machine is); then thaw it. The episodes in
        #    flight now send their tool calls to a session that died with the server.
        deadline = time.monotonic() + 420
        while not [r for r in logged_live() if r["step"] >= CRASH_AFTER_STEP]:
            assert inspect(trainer)["State"]["Running"], f"training ended before step {CRASH_AFTER_STEP}"
            assert time.monotonic() < deadline, f"training did not reach step {CRASH_AFTER_STEP} in 420 s"
            time.sleep(0.3)
        in_flight = freeze_with_episodes_in_flight(project, trainer)
        crashed_after = logged()[-1]["step"]
        crash(env_cid)
        healthy_s = wait_restarted_healthy(env_cid, 1)
        subprocess.run(["docker", "unpause", trainer], check=True, capture_output=True)

        # 2. training finishes.
        deadline = time.monotonic() + 600
        while inspect(trainer)["State"]["Running"] and time.monotonic() < deadline:
            time.sleep(1)
        final = inspect(trainer)["State"]
        logs = subprocess.run(["docker", "logs", trainer], capture_output=True, text=True)
        log_text = logs.stdout + logs.stderr
        assert not final["Running"], "training did not finish within 10 minutes after the crash"
        assert final["ExitCode"] == 0, f"training died after the env server crash (exit {final['ExitCode']}):\n" \
                                       + log_text[-4000:]
    finally:
        subprocess.run(["docker", "rm", "-f", trainer], capture_output=True)

    # 3. nothing lost: every step once; in-flight rollouts' tool errors counted; sessions came back.
    rows = logged()
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "a step was lost or logged twice"
    failed = tool_failures([r for r in rows if r["step"] > crashed_after])
    assert failed, (f"no step after the crash (after step {crashed_after}, {in_flight['episodes_awaiting_step']} "
                    f"episodes in flight) shows a tool failure: "
                    f"{[(r['step'], r.get('tools/failure_frequency')) for r in rows]}")
    tail = rows[-3:]
    assert all((r.get("tools/call_frequency") or 0) > 0 and (r.get("tools/failure_frequency") or 0) == 0
               for r in tail), f"sessions did not recover: {[(r['step'], r.get('tools/call_frequency'), r.get('tools/failure_frequency')) for r in tail]}"
    fail_freq = {r["step"]: round(r.get("tools/failure_frequency") or 0, 2) for r in rows if r["step"] in failed}
    report(f"fault env-crash: SIGKILL of env-echo's server after step {crashed_after} with the trainer frozen and "
           f"{in_flight['episodes_awaiting_step']} episodes in flight; healthy again {healthy_s:.1f}s later; tool "
           f"failure frequency {fail_freq}; training finished (exit 0), all {MAX_STEPS} steps logged once; "
           "last 3 steps: tools called, no failures")
