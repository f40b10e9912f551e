"""CPU training in containers, on the real compose.yaml: model-init -> trainer-cpu against env-echo.

One project for the module (model-init runs once; its `models` volume is reused):
  * smoke: a few GRPO steps; from metrics.jsonl, tools were called (> 0 per episode) and paid a reward
    (> 0); a checkpoint and TensorBoard events are written; `trainer.report` renders a PNG;
  * `make gpu-smoke`'s verdict table on the CPU profile, on this project's stack;
  * kill and resume, with 2 trainer processes: SIGKILL mid-run, run again: it says it resumes from the last
    checkpoint (dropping the records logged after it), and every step appears exactly once in metrics.jsonl with
    global_step == MAX_STEPS (one process killed and resumed: the sync chaos test, tests/reliability/test_chaos.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import requests

from tests.helpers import ROOT, build_images, compose_file_args, compose_stack, service_url

pytestmark = [pytest.mark.docker, pytest.mark.slow]

RUN = "smoke"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Project:
    def __init__(self, stack, env_file):
        self.stack, self.env_file = stack, env_file
        self.base = ["docker", "compose", *compose_file_args(stack.files), "--env-file", str(env_file)]

    def compose(self, *args, check=True, timeout=1800, env=None) -> subprocess.CompletedProcess:
        # shell variables win over --env-file values in compose interpolation. The timeout is a hang guard only: the
        # real model-init's warm-start took more than 600 s at load 20-29 (2026-12-07; its 6 epochs ~100 s each)
        res = subprocess.run([*self.base, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                             env=dict(os.environ, **(env or {})))
        if check and res.returncode != 0:
            raise AssertionError(f"compose {' '.join(args)} -> {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}")
        return res

    def train(self, *flags: str, check=True, env=None) -> subprocess.CompletedProcess:
        return self.compose("run", "--rm", "trainer-cpu", "python", "-m", "trainer.train", *flags, check=check, env=env)

    def read(self, path: str) -> str:
        res = self.compose("run", "--rm", "--no-deps", "--entrypoint", "cat", "trainer-cpu", path, check=False)
        return res.stdout if res.returncode == 0 else ""

    def metrics(self, run: str = RUN) -> list[dict]:
        rows = [json.loads(line) for line in self.read(f"/outputs/{run}/metrics.jsonl").splitlines() if line.strip()]
        return [r for r in rows if r.get("kind") == "step"]

    def kill_mid_run(self, name: str, run: str, after_step: int, timeout_s: float = 600) -> int | None:
        """SIGKILL the detached trainer container `name` once its run logged `after_step`; the last step
        logged before it died (None when it could not be caught mid-run)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            res = subprocess.run(["docker", "exec", name, "sh", "-c", f"cat /outputs/{run}/metrics.jsonl 2>/dev/null"],
                                 capture_output=True, text=True)
            steps = [json.loads(x)["step"] for x in res.stdout.splitlines() if '"kind": "step"' in x]
            if steps and steps[-1] >= after_step:
                # frozen first (one docker call after the read), then killed: the run cannot race ahead
                # to its end while the kill is on its way, however fast this machine is
                subprocess.run(["docker", "pause", name], capture_output=True)
                subprocess.run(["docker", "kill", "--signal", "KILL", name], capture_output=True)
                subprocess.run(["docker", "wait", name], capture_output=True, timeout=60)
                # a step may be logged between that read and the freeze: the file on the volume, read
                # after the process is dead, is what the resume must reconcile
                return max(r["step"] for r in self.metrics(run))
            if res.returncode != 0 and "is not running" in res.stderr:
                return None
            time.sleep(0.2)
        return None

    def ls(self, path: str) -> list[str]:
        res = self.compose("run", "--rm", "--no-deps", "--entrypoint", "ls", "trainer-cpu", path, check=False)
        return res.stdout.split()


@pytest.fixture(scope="module")
def project(docker, tmp_path_factory):
    build_images("env-server", "trainer-cpu")
    tmp = tmp_path_factory.mktemp("cpu-train")
    overrides = {"RUN_NAME": RUN, "MAX_CONCURRENT_ENVS": "16", "TRAIN_MODE": "cpu", "SAVE_STEPS": "2",
                 "DASHBOARD_PORT": str(free_port()), "TRACE_EVERY": "3"}
    with compose_stack(tmp, ["cpu", "echo"], services=["env-echo"], overrides=overrides) as stack:
        env_file = tmp / f"{stack.project}.env"
        proj = Project(stack, env_file)
        proj.dashboard_port = int(overrides["DASHBOARD_PORT"])
        # the init job, as compose runs it for trainer-cpu (service_completed_successfully)
        init = proj.compose("run", "--rm", "model-init")
        assert "wrote /models/tiny-qwen3" in init.stdout, init.stdout
        again = proj.compose("run", "--rm", "model-init")
        assert "already complete; nothing to do" in again.stdout  # idempotent
        yield proj


def test_cpu_smoke_tools_called_and_rewarded(project, tmp_path):
    res = project.train("--max-steps", "6", "--resume", "fresh")
    out = res.stdout
    assert "TRAIN_MODE=cpu: CPU profile with the tiny local model /models/tiny-qwen3" in out
    assert "[preflight] ok: env echo: 1 replica(s) healthy" in out
    rows = project.metrics()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    call_freq = sum(r["tools/call_frequency"] for r in rows) / len(rows)
    reward = sum(r["reward"] for r in rows) / len(rows)
    print(f"smoke: tool calls/episode {call_freq:.2f}, reward {reward:.3f}, "
          f"step time {sum(r['time/step_s'] for r in rows) / len(rows):.2f}s")
    assert call_freq > 0, "the model never called a tool"
    assert reward > 0, "tools were called but no reward came back"
    assert all(r["env/echo/episodes"] > 0 for r in rows)
    assert {"time/generation_s", "time/env_s", "time/training_s"} <= set(rows[-1])
    assert "checkpoint-6" in project.ls(f"/outputs/{RUN}")
    assert "model.safetensors" in project.ls(f"/outputs/{RUN}/checkpoint-6")
    assert any(n.startswith("events.out.tfevents") for n in project.ls(f"/outputs/{RUN}/tensorboard"))

    # make report: PNG of reward/tool curves, written as the host user into a folder only it can write (Makefile)
    tmp_path.chmod(0o755)
    rep = project.compose("run", "--rm", "--no-deps", "--user", f"{os.getuid()}:{os.getgid()}", "-e", "MPLCONFIGDIR=/tmp",
                          "-v", f"{tmp_path}:/reports", "trainer-cpu",
                          "python", "-m", "trainer.report", "--outputs", "/outputs", "--run", RUN, "--out-dir", "/reports")
    png = tmp_path / f"{RUN}.png"
    assert png.read_bytes()[:4] == b"\x89PNG", rep.stdout
    print(rep.stdout)

    # make rollouts: the host command prints the rollouts traced at steps 1 (the first), 3 and 6 from the outputs volume
    shown = subprocess.run([sys.executable, "-m", "tools", "rollouts", "--run", RUN], cwd=ROOT, capture_output=True,
                           text=True, timeout=600, env=dict(os.environ, STACK_ENV_FILE=str(project.env_file)))
    assert shown.returncode == 0, shown.stdout[-2000:] + shown.stderr[-2000:]
    assert f"run {RUN}, step 6: " in shown.stdout and "(traced steps: 1, 3, 6)" in shown.stdout
    assert "── step 6 · env echo · reward" in shown.stdout

    # make eval, then make export: the host commands, through Compose, on the run in the outputs volume
    host = dict(os.environ, STACK_ENV_FILE=str(project.env_file))
    scored = subprocess.run([sys.executable, "-m", "tools", "eval", "--run", RUN, "--tasks", "2"], cwd=ROOT,
                            capture_output=True, text=True, timeout=900, env=host)
    assert scored.returncode == 0, scored.stdout[-3000:] + scored.stderr[-3000:]
    assert "| echo | base | 8 |" in scored.stdout and "| echo | trained | 8 |" in scored.stdout, scored.stdout[-3000:]
    evaluated = json.loads(project.read(f"/outputs/{RUN}/eval.json"))
    assert evaluated["checkpoint"].endswith("checkpoint-6") and len(evaluated["rows"]) == 2
    exported = ROOT / "exports" / RUN
    try:
        done = subprocess.run([sys.executable, "-m", "tools", "export", "--run", RUN], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env=host)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert {"model.safetensors", "config.json", "tokenizer.json", "README.md"} <= {p.name for p in exported.iterdir()}
        assert exported.stat().st_uid == os.getuid()  # the user's folder, not the container's uid
        assert "| echo | trained | 8 |" in (exported / "README.md").read_text()  # the card holds the eval table
    finally:
        shutil.rmtree(exported, ignore_errors=True)

    # a second `make train` with the same MAX_STEPS has nothing left to do, and says so
    again = project.train("--max-steps", "6")
    assert "already finished: step 6 >= MAX_STEPS=6" in again.stdout


def test_smoke_run_on_the_cpu_profile_passes_every_stage_of_this_mode(project):
    """`make gpu-smoke`'s machinery run for real on the CPU profile (`python -m tools smoke`, driven by this module's
    env file as a user's `.env`: its stack and model volume, no second project): the stage lines come from a real
    trainer in a real container, and the verdict table passes every stage this mode has. The GPU-only stages (model
    download, vLLM healthy, rendezvous, weight sync) are checked on recorded logs in
    tests/gpu_path/test_gpu_host_checks.py."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
    r = subprocess.run([sys.executable, "-m", "tools", "smoke"], cwd=ROOT, capture_output=True, text=True,
                       timeout=1200, env=dict(env, STACK_ENV_FILE=str(project.env_file)))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    table = r.stdout.split("[stack] smoke run, mode cpu")[1]
    for title in ("first generation", "first optimizer step", "tool calls per episode"):
        assert f"  pass {title}" in table
    assert "FAIL" not in table and "smoke: PASSED" in table
    assert "training steps with `trainer-cpu` (mode cpu, ROLLOUTS=sync), run smoke-cpu" in r.stdout


def test_two_trainer_processes_train_once_per_step_and_resume_after_a_kill(project):
    """TRAINER_PROCESSES=2: trainer.launch starts two ranks through accelerate (gloo, the CPU stand-in for
    one process per GPU). Both open their own env sessions, rank 0 alone logs and checkpoints, and a
    SIGKILL mid-run is resumed by both from the one checkpoint."""
    two = {"TRAINER_PROCESSES": "2"}  # what a user writes in .env
    first_steps, run = 24, "two-ranks"  # room to catch it mid-run, however fast the machine
    name = f"{project.stack.project}-ranks"
    project.compose("run", "-d", "--name", name, "trainer-cpu", "python", "-m", "trainer.launch", "--max-steps",
                    str(first_steps), "--resume", "fresh", "--save-steps", "2", "--run-name", run, env=two)
    killed_after = project.kill_mid_run(name, run, after_step=3)  # checkpoint-2 is there
    first = subprocess.run(["docker", "logs", name], capture_output=True, text=True)
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    assert killed_after is not None and killed_after < first_steps, first.stdout[-3000:] + first.stderr[-3000:]
    # the resume runs to 3 checkpoints past the kill, not to the first run's 24 (what the checks below need: every
    # step once, and one set of 3 checkpoints, all saved after the resume)
    max_steps = killed_after + killed_after % 2 + 6
    assert "[launch] 2 trainer processes (ddp, gloo) through accelerate" in first.stdout
    # rank 0 counted the sessions of both processes against the server's capacity
    assert ">= 16 this trainer opens (2 trainer processes)" in first.stdout
    # the killed ranks' 16 sessions end with their sockets; the resume needs all 16 slots again
    health = f"{service_url(project.stack, 'env-echo')}/health"
    deadline = time.monotonic() + 120
    while requests.get(health, timeout=5).json()["active_sessions"] and time.monotonic() < deadline:
        time.sleep(0.2)

    res = project.compose("run", "--rm", "trainer-cpu", "python", "-m", "trainer.launch", "--max-steps",
                          str(max_steps), "--save-steps", "2", "--run-name", run, env=two)
    out = res.stdout
    resumed = [line for line in out.splitlines() if f"resuming from /outputs/{run}/checkpoint-" in line]
    assert len(resumed) == 1, out[-3000:]  # decided once, by rank 0
    ckpt_step = int(resumed[0].split("checkpoint-")[1].split()[0])
    assert 2 <= ckpt_step <= killed_after and ckpt_step % 2 == 0
    if killed_after > ckpt_step:  # those steps are re-run; their first records must be gone
        assert f"dropped {killed_after - ckpt_step} metric records logged after that checkpoint" in resumed[0]
    for rank in (0, 1):  # each process opened its own sessions
        assert f"[train] rank {rank}: env echo: 8 sessions over 1 replica(s)" in out
    rows = project.metrics(run)
    assert [r["step"] for r in rows] == list(range(1, max_steps + 1)), "a step was lost or logged twice"
    ckpts = sorted(project.ls(f"/outputs/{run}"))
    assert [c for c in ckpts if c.startswith("checkpoint-")] == sorted(
        f"checkpoint-{s}" for s in range(max_steps - 4, max_steps + 1, 2))  # one set, save_total_limit 3
    state = json.loads(project.read(f"/outputs/{run}/checkpoint-{max_steps}/trainer_state.json"))
    assert state["global_step"] == max_steps
    print(f"two ranks: killed after step {killed_after}, resumed from checkpoint-{ckpt_step}, {max_steps} steps logged "
          "once")


def test_sessions_spread_over_replicas(project):
    two = {"ENV_ECHO_REPLICAS": "2"}  # what a user writes in .env
    project.compose("up", "-d", "--wait", "env-echo", env=two)
    res = project.train("--max-steps", "1", "--resume", "fresh", "--run-name", "replicas", env=two)
    assert "[preflight] ok: env echo: 2 replica(s) healthy" in res.stdout, res.stdout[-3000:]
    [line] = [x for x in res.stdout.splitlines() if "sessions over 2 replica(s)" in x]
    counts = [int(n) for n in re.findall(r"env-echo-\d \([0-9.]+\): (\d+) open", line)]
    assert counts == [4, 4], line  # 8 rollouts (PER_DEVICE_TRAIN_BATCH_SIZE), least-loaded over 2 replicas


def test_dashboard_shows_the_reward_chart(project):
    """The opt-in TensorBoard service, loaded in headless Chromium: the reward chart is rendered.

    Two explicit conditions, each waited for (never a fixed pause): TensorBoard's data endpoint lists
    the run's reward points, then the page (driven by Playwright) has a reward card with its chart.
    """
    import requests
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "Debian's chromium is needed for this test: apt-get install chromium (.ci/provision does)"
    project.compose("--profile", "dashboard", "up", "-d", "dashboard")
    base = f"http://127.0.0.1:{project.dashboard_port}"
    deadline, points = time.monotonic() + 180, []
    while len(points) < 6:  # [wall_time, step, value] per logged step of the smoke run
        try:
            if f"{RUN}/tensorboard" in requests.get(f"{base}/data/runs", timeout=10).json():
                points = requests.get(f"{base}/data/plugin/scalars/scalars", timeout=10,
                                      params={"run": f"{RUN}/tensorboard", "tag": "reward"}).json()
        except (requests.RequestException, ValueError):
            pass
        assert time.monotonic() < deadline, f"TensorBoard did not serve the smoke run's reward points: {points}"
        time.sleep(1)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
            "--disable-component-update", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{base}/?tagFilter=reward#timeseries", timeout=120_000)
            card = page.locator("scalar-card-component", has=page.locator('tb-truncated-path[title="reward"]'))
            chart = card.locator("line-chart canvas").first
            chart.wait_for(state="attached", timeout=180_000)
            cards = page.locator("scalar-card-component").count()
        finally:
            browser.close()
    print(f"dashboard: reward chart rendered ({cards} card(s) on the page)")

