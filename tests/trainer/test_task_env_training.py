"""#66 items 2 and 1: a real CPU run (the tiny model, TRL's trainer, the stack's rollout loop) on an env that publishes
its own tasks (tests/fixtures/envs/sums, OpenEnv 0.10's Task API, served in this process): every episode resets with a
task of the train split, a GRPO group's members with the same one; the user message is the task's prompt; the
held-out evaluation every EVAL_EVERY steps plays the test split; the traces show split and index."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.envs.inprocess import ThreadServer
from trainer import train
from trainer.core.metrics import read_metrics

BATCH = 4  # PER_DEVICE_TRAIN_BATCH_SIZE = NUM_GENERATIONS: one group (one task) a step
APP = Path(__file__).resolve().parents[1] / "fixtures" / "envs" / "sums" / "app.py"


@pytest.fixture(scope="module")
def task_run(tmp_path_factory, tiny_model_dir):
    found = importlib.util.spec_from_file_location("fixture_sums_training", APP)
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
    out = tmp_path_factory.mktemp("tasks")
    printed = io.StringIO()
    with ThreadServer("sums", app=module.app) as server, contextlib.redirect_stdout(printed):
        code = train.main(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(out),
                           "--env-name", "sums", "--env-urls", f"sums={server.url}", "--run-name", "t",
                           "--max-steps", "2", "--save-steps", "2", "--per-device-train-batch-size", str(BATCH),
                           "--num-generations", str(BATCH), "--max-completion-length", "48", "--trace-every", "1",
                           "--eval-every", "2", "--eval-episodes", "3"])
    print(printed.getvalue())
    assert code == 0
    return SimpleNamespace(run_dir=out / "t", printed=printed.getvalue(), tasks=module.TASKS)


def test_each_group_plays_one_train_task_whose_prompt_is_the_user_message(task_run):
    rows = [json.loads(line) for line in (task_run.run_dir / "rollouts.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * BATCH
    for step in (1, 2):
        group = [r for r in rows if r["step"] == step]
        kwargs = {json.dumps(r["reset"]["reset_kwargs"], sort_keys=True) for r in group}
        assert len(kwargs) == 1, kwargs  # every member of the group resets with the same split and index
        task = json.loads(kwargs.pop())
        assert task["split"] == "train" and 0 <= task["index"] < 12
        question = task_run.tasks["train"][task["index"]]["question"]
        user = [m for m in group[0]["prompt"] if m["role"] == "user"][-1]["content"]
        assert user == f"question: {question}", user  # the task's prompt as the env's reset gives it


def test_the_run_says_what_it_trains_and_evaluates_on_and_evaluates_the_test_split(task_run):
    assert "serves its own tasks (OpenEnv's Task API): train (train) 12 tasks, test (test) 4 tasks; trains on " \
           "'train'" in task_run.printed
    assert "held-out evaluation on 'test'" in task_run.printed and "tasks of sums 'test' split" in task_run.printed
    [evaluated] = [r for r in read_metrics(task_run.run_dir) if "eval/sums/episodes" in r]
    assert evaluated["step"] == 2 and evaluated["eval/sums/episodes"] == 3 and evaluated["eval/sums/infra_failures"] == 0
