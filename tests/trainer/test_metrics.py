"""trainer.core.metrics (JSONL + TensorBoard records, resume dedupe) and trainer.report (PNG)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from contract.config import GpuMode
from trainer.after import report
from trainer.core.metrics import MetricsCallback, RolloutStats, read_metrics, summarize_episodes, truncate_metrics


def state(step, world_zero=True):
    return SimpleNamespace(global_step=step, is_world_process_zero=world_zero)


TRL_LOGS = {"loss": 0.1, "reward": 0.5, "reward_std": 0.2, "tools/call_frequency": 1.0,
            "tools/failure_frequency": 0.25, "completions/mean_length": 30.0, "rewards/EchoTool/mean": 0.5}


def log_step(cb, stats, step, gen=1.0, env=0.2, gas=1.5, step_s=2.0):
    cb.on_step_begin(None, state(step), None)
    stats.add_time("generation", gen)
    stats.add_time("env", env)
    stats.add_time("generate_and_score", gas)
    stats.add_episode("echo", 1.0, 1, 0)
    stats.add_episode("echo", 0.2, 2, 1)
    cb.on_step_end(None, state(step), None)
    cb._step_times[-1] = step_s  # deterministic step time
    cb.on_log(SimpleNamespace(max_steps=10), state(step), None, logs=dict(TRL_LOGS))


def test_summarize_episodes():
    out = summarize_episodes({"echo": [{"reward": 1.0, "tool_calls": 1, "tool_failures": 0},
                                       {"reward": 0.0, "tool_calls": 3, "tool_failures": 1}]})
    assert out == {"env/echo/episodes": 2, "env/echo/reward_mean": 0.5, "env/echo/episode_length": 2.0,
                   "env/echo/tool_failure_frequency": 0.25}


def test_step_record_has_trl_metrics_env_metrics_and_time_split(tmp_path):
    stats, lines = RolloutStats(), []
    cb = MetricsCallback(str(tmp_path), stats, print_fn=lines.append)
    cb.on_train_begin(None, state(0), None)
    log_step(cb, stats, 1)
    [row] = read_metrics(tmp_path)
    assert row["kind"] == "step" and row["step"] == 1 and row["mode"] == "cpu"
    assert row["tools/call_frequency"] == 1.0 and row["rewards/EchoTool/mean"] == 0.5
    assert row["env/echo/episodes"] == 2 and row["env/echo/reward_mean"] == pytest.approx(0.6)
    assert row["env/echo/episode_length"] == 1.5 and row["env/echo/tool_failure_frequency"] == pytest.approx(1 / 3)
    assert row["time/step_s"] == 2.0 and row["time/generation_s"] == 1.0 and row["time/env_s"] == pytest.approx(0.2)
    assert row["time/scoring_s"] == pytest.approx(0.3) and row["time/training_s"] == pytest.approx(0.5)
    assert "time/weight_sync_s" not in row  # CPU: no vLLM
    assert lines and lines[0].startswith("[train] step 1/10 reward 0.500 tool_calls/ep 1.00")
    cb.on_train_end(None, state(1), None)
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_weight_sync_is_split_out_of_generation_on_gpu(tmp_path):
    stats = RolloutStats()
    cb = MetricsCallback(str(tmp_path), stats, mode=GpuMode(), print_fn=lambda s: None)
    stats.add_time("weight_sync", 0.4)  # measured inside TRL's generation call
    log_step(cb, stats, 1, gen=1.4, gas=1.9)
    [row] = read_metrics(tmp_path)
    assert row["time/weight_sync_s"] == pytest.approx(0.4)
    assert row["time/generation_s"] == pytest.approx(1.0)
    assert row["time/training_s"] == pytest.approx(0.1)


def test_summary_record_and_non_main_process(tmp_path):
    stats = RolloutStats()
    cb = MetricsCallback(str(tmp_path), stats, print_fn=lambda s: None)
    cb.on_log(None, state(3, world_zero=False), None, logs=dict(TRL_LOGS))
    assert read_metrics(tmp_path, kind=None) == []
    cb.on_log(None, state(3), None, logs={"train_runtime": 12.0, "train_loss": 0.1})
    assert read_metrics(tmp_path) == []
    assert read_metrics(tmp_path, kind="summary")[0]["train_runtime"] == 12.0


def test_truncate_metrics_on_resume(tmp_path):
    rows = [{"kind": "step", "step": s} for s in (1, 2, 3, 4, 2)] + [{"kind": "summary", "step": 4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"kind": "st')
    assert truncate_metrics(tmp_path, 2) == 3  # steps 3, 4 (after the checkpoint) and the duplicate 2
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert read_metrics(tmp_path, kind="summary") == []


def test_tensorboard_purges_steps_after_resume_point(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    # An event file's name ends in a per-process counter, and the reader orders files by name: late in a long test
    # session the counter crosses a digit (...9 then ...10) and the resumed run's file sorted first. A real resume is a
    # new process (counter from 0, a later second); start both writers' counters at 0 as such a process would.
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))

    stats = RolloutStats()
    cb = MetricsCallback(str(tmp_path), stats, print_fn=lambda s: None)
    for step in (1, 2, 3):
        log_step(cb, stats, step)
    cb.on_train_end(None, state(3), None)
    cb = MetricsCallback(str(tmp_path), stats, resume_step=2, print_fn=lambda s: None)  # killed after 3, ckpt 2
    log_step(cb, stats, 3)
    cb.on_train_end(None, state(3), None)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("reward")] == [1, 2, 3]


def test_report_png_and_summary(tmp_path, capsys):
    run = tmp_path / "outputs" / "echo"
    stats = RolloutStats()
    cb = MetricsCallback(str(run), stats, print_fn=lambda s: None)
    for step in range(1, 8):
        log_step(cb, stats, step)
    assert report.main(["--outputs", str(tmp_path / "outputs"), "--out-dir", str(tmp_path / "reports")]) == 0
    png = tmp_path / "reports" / "echo.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "7 logged steps" in out and "reward: 0.500" in out and "env echo: reward 0.600 -> 0.600" in out


def test_report_errors(tmp_path, capsys):
    assert report.main(["--outputs", str(tmp_path)]) == 1
    assert "no runs with metrics.jsonl" in capsys.readouterr().err
    assert report.main(["--outputs", str(tmp_path), "--run", "nope"]) == 1
    assert "no run 'nope'" in capsys.readouterr().err
