"""Rollout traces (trainer.rollouts.traces) on a real CPU run against a real echo server: every traced row fits the
schema, holds the episode's tool calls and results, and its rewards are the ones the run logged."""

from __future__ import annotations

import json

import pytest

from trainer.rollouts import traces
from trainer import train


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory, tiny_model_dir, echo_server):
    out = tmp_path_factory.mktemp("traced")
    argv = ["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(out),
            "--env-urls", f"echo={echo_server.url}", "--run-name", "traced", "--max-steps", "2",
            "--per-device-train-batch-size", "4", "--num-generations", "4", "--max-completion-length", "64",
            "--trace-every", "2", "--trace-samples", "4"]
    assert train.main(argv) == 0
    return out


def test_every_traced_row_fits_the_schema_and_holds_its_episode(traced_run):
    rows = traces.read(traced_run / "traced" / traces.ROLLOUTS_FILE)
    # the first step, then every TRACE_EVERY=2 steps: the whole batch of 4 each time
    assert [r["step"] for r in rows] == [1] * 4 + [2] * 4
    for row in rows:
        assert traces.problems(row) == [], row
        assert row["env"] == "echo" and row["prompt"][-1]["role"] == "user"
        assert row["rewards"]["EchoTool"] == row["env_reward"]  # the env's own reward, as TRL scored it
        for call in row["tool_calls"]:
            assert call["tool"] in ("echo_message", "echo_with_length"), call
            assert isinstance(call["result"], str)
    assert any(row["tool_calls"] for row in rows), "no traced rollout called a tool"


def test_traced_rewards_are_the_logged_ones(traced_run):
    rows = traces.read(traced_run / "traced" / traces.ROLLOUTS_FILE)
    logged = {r["step"]: r for r in map(json.loads, (traced_run / "traced" / "metrics.jsonl").read_text().splitlines())
              if r.get("kind") == "step"}
    for step in (1, 2):
        traced = [r["reward"] for r in rows if r["step"] == step]
        assert sum(traced) / len(traced) == pytest.approx(logged[step]["reward"], abs=1e-5)


def test_the_first_step_is_traced_as_well_as_every_trace_every_steps():
    """A 5-step first run with TRACE_EVERY=10 must still show what the model did (issue #66)."""
    assert [step for step in range(1, 31) if traces.traced(step, 10)] == [1, 10, 20, 30]
    assert [step for step in range(1, 6) if traces.traced(step, 1)] == [1, 2, 3, 4, 5]
    assert not any(traces.traced(step, 0) for step in range(1, 6))  # TRACE_EVERY=0: never


def test_make_rollouts_prints_them_readably(traced_run, capsys):
    assert traces.main(["--outputs", str(traced_run), "--run", "traced"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("run traced, step 2: 4 rollout(s) (traced steps: 1, 2)")
    assert out.count("── step 2 · env echo · reward") == 4
    assert traces.main(["--outputs", str(traced_run), "--run", "traced", "--step", "7"]) == 1
