"""One trainer per run (#33 item 7): two real processes on one run folder. The second `python -m trainer.train`
(RESUME=fresh, the dangerous case) stops at once with exit code 4 and one line naming the holder, before it deletes
anything; once the holder exits (killed: no clean-up of its own), the lock is free again."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from tests.helpers import ROOT
from trainer.run import run_lock

HOLD = ("import sys; from trainer.run import run_lock; run_lock.acquire(sys.argv[1], sys.argv[2]); print('held', "
        "flush=True); sys.stdin.read()")


def holder(out, run: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(out), run], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.stdout.readline() == "held\n"  # it holds the lock now (an event, not a wait)
    return proc


def test_a_second_trainer_on_the_same_run_stops_with_one_line_naming_the_holder(tmp_path):
    run = tmp_path / "r"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "checkpoint-2" / "model.safetensors").write_bytes(b"x")
    first = holder(tmp_path, "r")
    try:
        second = subprocess.run([sys.executable, "-m", "trainer.train", "--train-mode", "cpu", "--output-dir",
                                 str(tmp_path), "--run-name", "r", "--resume", "fresh"], cwd=ROOT,
                                capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        assert second.returncode == 4, second.stderr[-2000:]
        lines = [line for line in second.stderr.splitlines() if line.startswith("[train]")]
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith("[train] run r is in use by another trainer (host ")
        assert f"{socket.gethostname()}" in lines[0] and f"pid {first.pid}," in lines[0]
        assert "`make down`" in lines[0] and "another RUN_NAME" in lines[0]
        assert (run / "checkpoint-2" / "model.safetensors").exists()  # RESUME=fresh deleted nothing
        info = json.loads(run_lock.lock_path(str(tmp_path), "r").read_text())
        assert info["pid"] == first.pid and info["host"] == socket.gethostname()
    finally:
        first.kill()  # dies without releasing anything itself: the kernel drops the lock
        first.wait()
    second_holder = holder(tmp_path, "r")  # a new trainer gets it
    second_holder.kill()
    second_holder.wait()


def test_other_runs_and_the_holder_itself_are_not_blocked(tmp_path):
    first = holder(tmp_path, "a")
    try:
        assert run_lock.acquire(str(tmp_path), "b") == tmp_path / ".b.lock"  # another RUN_NAME: free
        assert run_lock.acquire(str(tmp_path), "b") == tmp_path / ".b.lock"  # this process again: still its own
    finally:
        first.kill()
        first.wait()
