"""Checkpoints are complete or not there (#33 item 6): a checkpoint counts only once its marker is written, after its
files were synced; one whose trainer_state.json is empty (a full disk, a host crash mid-save) is skipped by resume,
eval and export with one line, back to the previous readable one; a save that would not fit stops the run first.

The folders are real (as HF's Trainer lays them out); the save is a real transformers Trainer save of the tiny model
with the trainer's own RunControl callback."""

from __future__ import annotations

import json
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from trainer.run import checkpoints
from trainer.run.control import make_control_callback
from trainer.run.resume import prepare_run_dir
from trainer.run.checkpoints import MARKER
from contract.config import RunConfig


def checkpoint(run: Path, step: int, marked: bool = True, state: str | None = None) -> Path:
    path = run / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"x" * 10)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}) if state is None else state)
    if marked:
        (path / MARKER).write_text("{}")
    return path


def test_an_empty_trainer_state_falls_back_to_the_previous_checkpoint(tmp_path, capsys):
    run = tmp_path / "r"
    good = checkpoint(run, 4)
    checkpoint(run, 6, state="")  # marked, then the disk filled: what a crash after a non-atomic write leaves
    assert checkpoints.pick(run, None) == (good, 4)
    assert "[checkpoints] skipping checkpoint-6 of run r: its trainer_state.json is empty or unreadable" \
        in capsys.readouterr().err
    with pytest.raises(checkpoints.CheckpointError, match="checkpoint-6 of run r is incomplete: its trainer_state"):
        checkpoints.pick(run, "6")

    cfg = RunConfig.load(["--output-dir", str(tmp_path), "--run-name", "r", "--max-steps", "10"])
    assert prepare_run_dir(cfg) == (str(good), 4)
    out = capsys.readouterr().out
    assert "removing incomplete checkpoint-6: its trainer_state.json is empty or unreadable" in out
    assert "resuming from" in out and not (run / "checkpoint-6").exists()


def test_unmarked_checkpoints_count_by_the_old_rule_only_before_the_first_marked_one(tmp_path):
    run = tmp_path / "r"
    old = checkpoint(run, 2, marked=False)  # saved before markers existed
    checkpoint(run, 4, marked=True)
    checkpoint(run, 6, marked=False)  # its files are there but were never synced and marked: a crash mid-save
    assert checkpoints.is_complete(old)
    assert checkpoints.why_incomplete(run / "checkpoint-6") == "it was cut short while saving (no completion marker)"
    assert checkpoints.last_complete(run)[:2] == (run / "checkpoint-4", 4)
    (run / "checkpoint-2" / "trainer_state.json").write_text("")
    assert not checkpoints.is_complete(old)  # the old rule parses it too


def test_too_little_disk_is_one_line_with_what_is_needed_and_free(tmp_path, monkeypatch):
    run = tmp_path / "r"
    checkpoint(run, 2)
    assert checkpoints.save_estimate(run, 10**9) == checkpoints.size_of(run / "checkpoint-2")  # the last one's size
    assert checkpoints.save_estimate(tmp_path / "none", 1000) == 3000  # no checkpoint yet: params + AdamW's two
    assert checkpoints.save_estimate(tmp_path / "none", 1000, save_only_model=True) == 1000
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: Usage(10 * 2**30, 9 * 2**30, 2**29))
    with pytest.raises(checkpoints.CheckpointError) as err:
        checkpoints.check_free_space(run, 3 * 2**30)
    assert "needs about 3.00 GiB, 0.50 GiB is free" in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------------- a real transformers save
def tiny_trainer(tiny_model_dir, out: Path, max_steps: int, callbacks: list):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = tokenizer("the checkpoint is complete or not there")["input_ids"]
    data = Dataset.from_list([{"input_ids": ids, "labels": ids}] * 4)
    args = TrainingArguments(output_dir=str(out), max_steps=max_steps, save_steps=1, per_device_train_batch_size=1,
                             report_to=[], use_cpu=True, logging_steps=100, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)


def test_a_real_save_is_marked_only_after_its_files_are_written(tiny_model_dir, tmp_path):
    from transformers import TrainerCallback

    seen = {}

    class BeforeRunControl(TrainerCallback):  # runs between HF's save and RunControl's on_save
        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            seen[state.global_step] = ((folder / "trainer_state.json").exists(), (folder / MARKER).exists())

    tiny_trainer(tiny_model_dir, tmp_path, 2, [BeforeRunControl(), make_control_callback()]).train()
    assert seen == {1: (True, False), 2: (True, False)}  # every file saved, no marker yet
    for step in (1, 2):
        folder = tmp_path / f"checkpoint-{step}"
        marker = json.loads((folder / MARKER).read_text())
        assert marker["global_step"] == step
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(marker["files"])
        assert checkpoints.is_complete(folder)
    assert checkpoints.last_complete(tmp_path)[:2] == (tmp_path / "checkpoint-2", 2)


def test_a_save_that_would_not_fit_stops_training_before_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda p: Usage(2**30, 2**30 - 4096, 4096))
    control = make_control_callback()
    trainer = tiny_trainer(tiny_model_dir, tmp_path, 3, [control])
    trainer.train()
    assert trainer.state.global_step == 1  # stopped at the first save, not after three steps
    assert not list(tmp_path.glob("checkpoint-*"))
    assert control.disk_short.startswith(f"not enough disk for the next checkpoint in {tmp_path}: it needs about")
    assert "0.00 GiB is free" in control.disk_short
