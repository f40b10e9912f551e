"""Experiment trackers (trainer.core.trackers, REPORT_TO) on a real 2-step CPU run against a real echo server, all four on
at once: trackio holds the run's reward series and rollout tables, W&B's offline run (no network) and MLflow's file
store hold the same rewards, TensorBoard's cards start with the reward and show trackio's keys; a tracker name that
does not exist, or one not installed, stops the run with the fix."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from contract import tracker_names
from contract.config import ENV_VARS
from tests.trainer.conftest import ROOT
from trainer.rollouts import traces
from trainer import train
from trainer.core import trackers

RUN = "tracked"


def argv(out, echo_url, *extra):
    return ["--train-mode", "cpu", "--model-name", "{model}", "--output-dir", str(out), "--env-urls", f"echo={echo_url}",
            "--run-name", RUN, "--max-steps", "2", "--per-device-train-batch-size", "4", "--num-generations", "4",
            "--max-completion-length", "64", *extra]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, tiny_model_dir, echo_server):
    """`python -m trainer.train` as the container runs it: its own process (TRL imports trackio, which reads
    TRACKIO_DIR once, at import), TRACKIO_DIR unset so the trainer puts trackio's store on OUTPUT_DIR."""
    out = tmp_path_factory.mktemp("trackers")
    env = {k: v for k, v in os.environ.items() if k not in (*ENV_VARS, "TRACKIO_DIR") and not k.startswith("WANDB_")}
    args = [a.replace("{model}", str(tiny_model_dir)) for a in argv(out, echo_server.url)]
    r = subprocess.run([sys.executable, "-m", "trainer.train", *args, "--report-to", "tensorboard,trackio,wandb,mlflow",
                        "--trace-every", "1", "--trace-samples", "4"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def logged(out) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / RUN / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "step"}


@pytest.fixture(scope="module")
def trackio_logs(tracked_run) -> list[dict]:
    """What trackio's own storage API reads back from the run's store (in a process of its own, for TRACKIO_DIR)."""
    store = tracked_run / tracker_names.TRACKIO_DIR
    assert (store / f"{tracker_names.PROJECT}.db").is_file()  # on the outputs volume, beside the runs
    code = ("import json; from trackio.sqlite_storage import SQLiteStorage; "
            f"print(json.dumps(SQLiteStorage.get_logs({tracker_names.PROJECT!r}, {RUN!r}), default=str))")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TRACKIO_DIR": str(store)},
                       capture_output=True, text=True, timeout=120, check=True)
    return json.loads(r.stdout.splitlines()[-1])


def tensorboard_tags(out) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / RUN / tracker_names.TB_DIR))
    acc.Reload()
    return acc.Tags()["scalars"]


def test_trackio_holds_the_reward_series_of_metrics_jsonl(tracked_run, trackio_logs):
    points = [p for p in trackio_logs if "reward" in p]
    assert [p["step"] for p in points] == [1, 2]
    for p in points:
        assert p["reward"] == pytest.approx(logged(tracked_run)[p["step"]]["reward"], abs=1e-9)
        assert p["reward/echo"] == pytest.approx(logged(tracked_run)[p["step"]]["env/echo/reward_mean"], abs=1e-9)


def test_tensorboard_cards_start_with_reward_and_every_tracker_shows_the_same_keys(tracked_run, trackio_logs):
    tags = sorted(tensorboard_tags(tracked_run))  # TensorBoard's card order
    assert tags[:2] == ["reward", "reward/echo"], tags
    groups = [t.split("/")[0] for t in tags]
    assert groups == sorted(groups, key=["reward", "rollout", "time", "trl"].index), tags
    assert {"rollout/tool_calls_per_episode", "rollout/tool_failures_per_episode", "time/generation_s",
            "time/env_s", "time/training_s", "trl/loss"} <= set(tags)
    trackio_keys = {k for p in trackio_logs for k in p if k not in ("step", "timestamp", "rollouts")}
    assert set(tags) == trackio_keys


def wandb_records(path):
    """The protobuf records of a W&B run file (wandb 0.31 reads them in Go only): a 7-byte header, then LevelDB's log
    format, 32 KiB blocks of chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            yield record


def test_wandb_offline_and_mlflow_file_store_hold_the_same_rewards(tracked_run, monkeypatch):
    """WANDB_MODE=offline (the default) writes the run under OUTPUT_DIR/<run>/wandb with no network; MLflow's default
    store is OUTPUT_DIR/mlruns. Each read back with its own library."""
    import mlflow

    want = {step: r["reward"] for step, r in logged(tracked_run).items()}
    [run_file] = (tracked_run / RUN / "wandb").glob("offline-run-*/run-*.wandb")
    history = {}
    for record in wandb_records(run_file):
        if record.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[items["_step"]] = items
    assert {step: h["reward"] for step, h in history.items()} == pytest.approx(want, abs=1e-9)
    assert history[2]["reward/echo"] == pytest.approx(logged(tracked_run)[2]["env/echo/reward_mean"], abs=1e-9)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its (frozen) file store behind this switch
    client = mlflow.MlflowClient(tracking_uri=f"file:{tracked_run / 'mlruns'}")
    experiment = client.get_experiment_by_name(tracker_names.PROJECT)
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == RUN and run.info.status == "FINISHED"
    series = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward")}
    assert series == pytest.approx(want, abs=1e-9)
    assert client.get_metric_history(run.info.run_id, "reward.echo")  # a file store's `/` is `.` (trainer/trackers)


def test_rollout_traces_reach_trackio_as_tables(tracked_run, trackio_logs):
    traced = traces.read(tracked_run / RUN / traces.ROLLOUTS_FILE)
    tables = {p["step"]: p["rollouts"] for p in trackio_logs if "rollouts" in p}
    assert sorted(tables) == [1, 2]
    for step, table in tables.items():
        rows = table["_value"]
        assert [r["reward"] for r in rows] == [r["reward"] for r in traced if r["step"] == step]
        assert all(r["env"] == "echo" and r["step"] == step for r in rows)


def test_a_tracker_name_that_does_not_exist_is_refused(tmp_path, capsys):
    assert train.main(["--train-mode", "cpu", "--output-dir", str(tmp_path), "--report-to", "tensorboard,wandbb"]) == 2
    err = capsys.readouterr().err
    assert "REPORT_TO: unknown tracker 'wandbb'; write a comma list of tensorboard, trackio, wandb, mlflow" in err


def test_a_tracker_not_installed_stops_the_run_at_preflight(tmp_path, tiny_model_dir, echo_server, monkeypatch, capsys):
    monkeypatch.setitem(tracker_names.MODULES, "mlflow", "mlflow_not_installed_here")
    args = [a.replace("{model}", str(tiny_model_dir)) for a in argv(tmp_path, echo_server.url)]
    assert train.main([*args, "--report-to", "tensorboard,mlflow"]) == 3
    err = capsys.readouterr().err
    assert "REPORT_TO names mlflow, not installed in this trainer image" in err and "`make build`" in err
    assert not (tmp_path / RUN / "metrics.jsonl").exists()


def test_view_per_env_failures_per_episode_and_trl_counters_last():
    record = {"kind": "step", "step": 3, "time": 1.0, "mode": "cpu", "loss": 0.5, "reward": 0.4,
              "tools/call_frequency": 2.0, "tools/failure_frequency": 0.25, "clip_ratio/low_mean": 0.0,
              "env/echo/episodes": 2, "env/echo/reward_mean": 0.5, "env/echo/episode_length": 1.0,
              "env/echo/tool_failure_frequency": 0.5, "env/wordle/episodes": 2, "env/wordle/reward_mean": 0.3,
              "env/wordle/episode_length": 3.0, "env/wordle/tool_failure_frequency": 0.0, "time/generation_s": 1.5,
              "entropy": float("nan")}
    v = trackers.view(record)
    assert list(v)[:3] == ["reward", "reward/echo", "reward/wordle"]
    assert v["rollout/tool_failures_per_episode"] == 0.5 and v["rollout/tool_failures_per_episode/echo"] == 0.5
    assert v["rollout/tool_calls_per_episode/wordle"] == 3.0 and v["rollout/episodes/wordle"] == 2
    assert list(v)[-2:] == ["trl/loss", "trl/clip_ratio/low_mean"] and "trl/entropy" not in v  # NaN: not logged
    assert not any(k.startswith(("trl/env/", "trl/time/", "trl/reward")) for k in v)
