"""trainer.train against real env-server processes on loopback (no containers): multi-env routing,
per-env metrics, SIGTERM checkpoint + resume, fresh restarts, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer import train
from trainer.run.dataset import build_dataset
from trainer.run.resume import prepare_run_dir
from contract.config import RunConfig
from trainer.core.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def base_argv(model_dir, out, urls: dict[str, str], *extra: str) -> list[str]:
    return ["--train-mode", "cpu", "--model-name", str(model_dir), "--output-dir", str(out),
            "--env-name", ",".join(urls), "--env-urls", ",".join(f"{k}={v}" for k, v in urls.items()),
            "--max-completion-length", "96", *extra]


def test_multi_env_routes_rows_and_logs_reward_per_env(tmp_path, tiny_model_dir, env_server_factory, capsys):
    echo, catch = env_server_factory("echo"), env_server_factory("catch")
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo.url, "catch": catch.url}, "--max-steps", "2",
                     "--per-device-train-batch-size", "8", "--num-generations", "2", "--dataset-size", "16")
    cfg = RunConfig.load(argv)
    from envs import registry

    ds = build_dataset(cfg, {n: registry.get(n) for n in cfg.env_names})
    assert sorted(set(ds["environment"])) == ["catch", "echo"] and len(ds) == 32
    assert set(ds.column_names) == {"prompt", "env_row", "environment"}

    assert train.main(argv) == 0
    rows = read_metrics(tmp_path / "echo+catch")
    assert [r["step"] for r in rows] == [1, 2]
    keys = set().union(*rows)
    assert {"env/echo/reward_mean", "env/catch/reward_mean", "rewards/EchoTool/mean", "rewards/CatchTool/mean"} <= keys
    # OFF_POLICY_CORRECTION's figures, every step: the CPU profile samples with the policy it trains (ratio 1, nothing
    # clipped, sync's default sequence_mask with its cap 3 x delta 4 logged beside the weights it bounds)
    assert all(r["off_policy/ratio_max"] == 1.0 and r["off_policy/clipped_share"] == 0.0 and r["off_policy/weight_max"]
               == 1.0 and r["off_policy/weight_cap"] == 12.0 and r["off_policy/staleness_max"] == 0 for r in rows), rows
    out = capsys.readouterr().out
    # both servers served sessions (the run's spread, printed while TRL's pool was open); all closed at the end
    assert re.search(r"env echo: [1-9]\d* sessions over", out) and re.search(r"env catch: [1-9]\d* sessions over", out)
    assert echo.health()["active_sessions"] == 0 and catch.health()["active_sessions"] == 0
    assert "[preflight] ok: env echo" in out and "[preflight] ok: env catch" in out
    assert "WARNING: env catch: MAX_COMPLETION_LENGTH=96 is below" in out


# Deadlines that only stop a hang: each wait ends on an event (a step in metrics.jsonl, the process's exit),
# however long start-up and steps take on a slow, busy machine (two processes load the model twice).
GUARD_S = 1800


def _wait_for_step(run_dir: Path, step: int, proc) -> int:
    """Until metrics.jsonl holds `step`; fails at once if the trainer exits first."""
    deadline = time.monotonic() + GUARD_S
    while True:
        rows = read_metrics(run_dir)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]["step"]
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited early: {proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no step {step} in {GUARD_S} s: {proc.communicate()[0][-3000:]}")
        time.sleep(0.2)


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_saves_a_checkpoint_then_resume_continues(tmp_path, tiny_model_dir, echo_server, processes):
    """`docker stop`: SIGTERM to the trainer container's process. With 2 processes that is the launcher, which
    passes it to both ranks; they stop after the same step (else one would wait for the other in a collective),
    and the launcher gives them WORKER_STOP_GRACE_S, not torchrun's 30 s, to save."""
    argv = base_argv(tiny_model_dir, tmp_path, {"echo": echo_server.url}, "--max-steps", "500",
                     "--save-steps", "1000", "--run-name", "term", "--trainer-processes", str(processes))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "trainer.launch", *argv], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    run_dir = tmp_path / "term"
    _wait_for_step(run_dir, 1, proc)  # a step done, 500 to go: the stop saves after the step in progress
    proc.send_signal(signal.SIGTERM)  # what `docker stop` sends
    out, _ = proc.communicate(timeout=GUARD_S)  # until it exits: the step, the save
    if processes == 1:
        assert proc.returncode == 143, out[-3000:]
    assert "SIGTERM: saving a checkpoint after this step" in out, out[-3000:]
    ckpts = sorted(run_dir.glob("checkpoint-*"))
    assert len(ckpts) == 1  # SAVE_STEPS=1000 never fired: this one is the SIGTERM save
    stopped_at = int(ckpts[0].name.split("-")[1])
    marked = json.loads((ckpts[0] / "checkpoint-complete.json").read_text())["files"]  # sealed after every rank saved
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(marked) if processes == 2 else "rng_state.pth" in marked
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped_at + 1))

    argv[argv.index("--max-steps") + 1] = str(stopped_at + 2)
    res = subprocess.run([sys.executable, "-m", "trainer.launch", *argv], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=GUARD_S)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert f"resuming from {run_dir}/checkpoint-{stopped_at} (step {stopped_at} of {stopped_at + 2})" in res.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, stopped_at + 3))
    state = json.loads((run_dir / f"checkpoint-{stopped_at + 2}" / "trainer_state.json").read_text())
    assert state["global_step"] == stopped_at + 2


def test_killed_mid_save_checkpoint_is_ignored_and_metrics_deduped(tmp_path, capsys):
    run = tmp_path / "r"
    good = run / "checkpoint-4"
    good.mkdir(parents=True)
    (good / "model.safetensors").write_bytes(b"x")
    (good / "trainer_state.json").write_text(json.dumps({"global_step": 4}))
    (run / "checkpoint-6").mkdir()  # weights written, trainer_state.json not yet: killed mid-save
    (run / "checkpoint-6" / "model.safetensors").write_bytes(b"x")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"kind": "step", "step": s}) + "\n" for s in range(1, 8)))
    cfg = RunConfig.load(["--output-dir", str(tmp_path), "--run-name", "r", "--max-steps", "10"])
    ckpt, step = prepare_run_dir(cfg)
    assert (ckpt, step) == (str(good), 4)
    assert not (run / "checkpoint-6").exists()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    out = capsys.readouterr().out
    assert "removing incomplete checkpoint-6" in out and "dropped 3 metric records" in out

    fresh = RunConfig.load(["--output-dir", str(tmp_path), "--run-name", "r", "--resume", "fresh"])
    assert prepare_run_dir(fresh) == (None, 0)
    assert list(run.iterdir()) == []
    assert "RESUME=fresh: deleting" in capsys.readouterr().out


def test_exit_codes_for_bad_config_and_failed_preflight(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    bad = subprocess.run([sys.executable, "-m", "trainer.train"], cwd=ROOT, env={**env, "ENV_NAME": "No-Pe"},
                         capture_output=True, text=True)
    assert bad.returncode == 2
    assert "ENV_NAME: 'no-pe' is not an env name: lowercase letters, digits and '_'" in bad.stderr
    down = subprocess.run([sys.executable, "-m", "trainer.train", "--train-mode", "cpu", "--output-dir", str(tmp_path),
                           "--env-urls", "echo=http://env-echo.invalid:8000"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=GUARD_S)
    assert down.returncode == 3, down.stdout + down.stderr
    assert "[preflight] FAILED:" in down.stderr and "env echo: cannot resolve 'env-echo.invalid'" in down.stderr
