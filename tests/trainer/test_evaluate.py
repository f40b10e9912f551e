"""make eval (trainer.evaluate) after a real 2-step CPU run against a real echo server: eval.json holds a base and a
trained row for echo, built from real episodes on seeds training never used, with consistent numbers; the table
printed holds both rows; a bad run or a missing checkpoint is one clear line and a non-zero exit."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from contract.config import CpuMode
from envs import registry
from contract import eval_report
from trainer import train
from trainer.after import evaluate

TASKS, GENERATIONS = 4, 2  # NUM_GENERATIONS 2: not the default (4)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, tiny_model_dir, echo_server):
    """Train 2 steps, then evaluate; every make_dataset call of each phase is recorded (n, seed)."""
    out = tmp_path_factory.mktemp("evaluated")
    where = ["--train-mode", "cpu", "--output-dir", str(out), "--env-urls", f"echo={echo_server.url}"]
    run = ["--model-name", str(tiny_model_dir), "--run-name", "ev", "--per-device-train-batch-size", "4",
           "--num-generations", str(GENERATIONS), "--max-completion-length", "64", "--max-steps", "2",
           "--trace-every", "0"]
    calls: dict[str, list[tuple[int, int]]] = {"train": [], "eval": []}
    phase = "train"
    original = registry.EnvSpec.make_dataset

    def spy(self, n, seed):
        calls[phase].append((n, seed))
        return original(self, n, seed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry.EnvSpec, "make_dataset", spy)
        assert train.main([*where, *run]) == 0
        phase = "eval"
        before = echo_server.health()["episodes_started"]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            # the model, NUM_GENERATIONS and the batch come from the run's run.json (the defaults differ)
            rc = evaluate.main([*where, "--run", "ev", "--tasks", str(TASKS)])
        assert rc == 0, printed.getvalue()[-3000:]
    return {"out": out, "model": tiny_model_dir, "data": eval_report.read(out / "ev"), "calls": calls,
            "printed": printed.getvalue(),
            "episodes": echo_server.health()["episodes_started"] - before}


def test_both_models_are_scored_on_held_out_seeds(evaluated):
    data, calls = evaluated["data"], evaluated["calls"]
    assert data["run"] == "ev" and data["checkpoint"] == "checkpoint-2" and data["step"] == 2
    assert data["base_model"] == str(evaluated["model"])  # the run's MODEL_NAME, from its run.json
    assert sorted((r["model"], r["env"]) for r in data["rows"]) == [("base", "echo"), ("trained", "echo")]
    seeds = data["seeds"]["echo"]
    assert len(seeds) == len(set(seeds)) == TASKS
    assert calls["eval"] == [(1, s) for s in seeds]  # each held-out task is its own seed's row
    training = {seed for _, seed in calls["train"]}
    assert training and not training & set(seeds), (training, seeds)


def test_the_numbers_are_real_episodes_and_consistent(evaluated):
    data = evaluated["data"]
    assert evaluated["episodes"] == 2 * TASKS * GENERATIONS  # every episode reset a real session on the server
    assert data["ks"] == list(range(1, GENERATIONS + 1)) and data["episodes_per_env"] == TASKS * GENERATIONS
    for row in data["rows"]:
        assert set(row) == set(eval_report.ROW_KEYS)
        assert row["episodes"] == TASKS * GENERATIONS
        assert 0.0 <= row["mean_reward"] <= 1.0 and 0.0 <= row["success_rate"] <= 1.0
        passes = [row["pass_at_k"][str(k)] for k in data["ks"]]
        assert passes[0] == pytest.approx(row["success_rate"])  # pass@1 is the success rate
        assert passes == sorted(passes) and all(0.0 <= p <= 1.0 for p in passes)
        # echo pays 1.0 (success) or 0.2 (another word) per calling episode, 0 without a call
        assert row["mean_reward"] >= row["success_rate"] - 1e-9
        assert 0 <= row["tool_failures_per_episode"] <= row["tool_calls_per_episode"]
        assert row["tokens_per_episode"] > 0
        assert row["infra_failures"] == 0  # a healthy server: every episode scored
    assert any(row["tool_calls_per_episode"] > 0 for row in data["rows"]), "no episode called a tool"


def test_the_table_is_printed_with_both_rows(evaluated):
    printed = evaluated["printed"]
    assert eval_report.markdown_table(evaluated["data"]) in printed
    assert "| echo | base |" in printed and "| echo | trained |" in printed
    assert f"[eval] trained echo: {TASKS * GENERATIONS}/{TASKS * GENERATIONS} episodes" in printed  # progress
    assert json.loads((evaluated["out"] / "ev" / eval_report.EVAL_FILE).read_text()) == evaluated["data"]


def test_a_bad_run_or_no_checkpoint_is_one_clear_line(evaluated, capsys):
    out = evaluated["out"]
    assert evaluate.main(["--train-mode", "cpu", "--outputs", str(out), "--run", "nope"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no run 'nope'" in err and "ev" in err
    (out / "fresh" / "checkpoint-3").mkdir(parents=True)  # cut short while saving: not complete
    assert evaluate.main(["--train-mode", "cpu", "--outputs", str(out), "--run", "fresh"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no complete checkpoint" in err
    assert evaluate.main(["--train-mode", "cpu", "--outputs", str(out), "--run", "ev", "--checkpoint", "9"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "checkpoint-2" in err


# ------------------------------------------------------------------ GPU hosts: free memory before vLLM loads
def test_gpu_memory_verdict_fits_when_vllms_share_and_the_model_are_free():
    from trainer.after.evaluate import gpu_memory_verdict

    gb = 10**9
    assert gpu_memory_verdict(30 * gb, 80 * gb, 0.3, 2 * gb) is None  # needs 24 + 2
    assert gpu_memory_verdict(26 * gb, 80 * gb, 0.3, 2 * gb) is None  # exactly enough


def test_gpu_memory_verdict_held_by_training_is_one_line_saying_what_to_do():
    from trainer.after.evaluate import gpu_memory_verdict

    gb = 10**9
    line = gpu_memory_verdict(5 * gb, 80 * gb, 0.3, 2 * gb, "GPU 0 (H100)")
    assert line is not None and "\n" not in line
    assert line.startswith("GPU 0 (H100): 5.0 of 80.0 GB free, and the eval needs 26.0 GB")
    assert "training" in line and "`make down`" in line and "`make eval` again" in line


def test_no_gpu_check_where_the_trainer_runs_on_cpu(tmp_path):
    from contract.config import RunConfig
    from trainer.after.evaluate import check_gpu_memory, weights_bytes

    assert check_gpu_memory(RunConfig.load([]).resolved(CpuMode()), [str(tmp_path)]) is None  # no child process, no CUDA asked
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    assert weights_bytes(tmp_path) == 1000 and weights_bytes(tmp_path / "missing") == 0


# ------------------------------------------------------------------ #33 item 4: episodes the env side ended
def test_an_episode_the_env_side_ended_is_left_out_of_every_figure_and_counted():
    from trainer.after.evaluate import Episode, summarize

    lost = "reset failed: connection lost: ConnectionError: Cannot reach env server"
    episodes = [Episode(0, 1.0, 1, 0, 10), Episode(0, 0.0, 0, 1, 30, lost),  # task 0: one scored, one lost
                Episode(1, 0.2, 1, 0, 10), Episode(1, 1.0, 1, 0, 20)]
    row = summarize("trained", "echo", episodes, 2, 0.5)
    assert row["episodes"] == 3 and row["infra_failures"] == 1
    assert row["mean_reward"] == pytest.approx((1.0 + 0.2 + 1.0) / 3)  # not (... + 0) / 4: the lost one is not a 0
    assert row["success_rate"] == pytest.approx(2 / 3)
    assert row["tokens_per_episode"] == pytest.approx(40 / 3) and row["tool_failures_per_episode"] == 0
    assert row["pass_at_k"]["1"] == pytest.approx((1.0 + 0.5) / 2)  # task 0 over its one scored episode
    assert row["pass_at_k"]["2"] == pytest.approx(1.0)  # only task 1 has two scored episodes
    assert set(row) == set(eval_report.ROW_KEYS)


def test_an_env_that_lost_every_episode_shows_no_figure_and_says_how_many():
    from trainer.after.evaluate import Episode, summarize

    row = summarize("base", "echo", [Episode(0, 0.0, 0, 1, 5, "no reply"), Episode(0, 0.0, 0, 1, 5, "no reply")],
                    2, 0.5)
    assert row["episodes"] == 0 and row["infra_failures"] == 2 and row["mean_reward"] is None
    data = {"threshold": 0.5, "ks": [1, 2], "rows": [row]}
    table = eval_report.markdown_table(data)
    assert "env-ended (left out)" in table.splitlines()[0]
    assert table.splitlines()[-1] == "| echo | base | 0 | n/a | n/a | n/a | n/a | n/a | n/a | n/a | 2 |"
