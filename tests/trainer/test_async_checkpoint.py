"""An async run's folder (ROLLOUTS=async) through `make export` and `make report`, in fresh processes: its
checkpoint was saved from a model TRL's AsyncGRPOTrainer loads with the `tree_fa3` attention and a fused LM head, and
carries TRL's rollout_state.json; neither leaks into what export writes (it loads with no tree attention
registered, and computes what the trained model computes), and the report reads the async metric records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from contract.config import AsyncRollouts, GpuMode
from trainer.core import trackers
from trainer.run import checkpoints
from trainer.core.metrics import MetricsCallback, read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def async_run(tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.trainer.utils import add_fused_lm_head

    from tests.trainer.test_async_metrics import ASYNC_LOGS
    from trainer.async_grpo import tree_attention

    outputs = tmp_path_factory.mktemp("outputs")
    run = outputs / "asyncrun"
    ckpt = run / "checkpoint-2"
    tree_attention.install()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=tree_attention.TREE_ATTENTION,
                                                 dtype=torch.float32)  # as AsyncGRPOTrainer loads it
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # "trained": differs from the base model
    model.save_pretrained(ckpt)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(ckpt)
    (ckpt / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (ckpt / "rollout_state.json").write_text(json.dumps({"prompt_index": 3, "model_version": 2}))
    checkpoints.seal(ckpt, 2)
    (run / "run.json").write_text(json.dumps({"base_model": str(tiny_model_dir), "mode": "gpu", "envs": ["echo"],
                                              "learning_rate": 1e-5, "base_dtype": None,
                                              "settings": {"rollouts": "async", "max_staleness": 4}}))
    cb = MetricsCallback(str(run), mode=GpuMode(), print_fn=lambda line: None, rollouts=AsyncRollouts(),
                         trackers=trackers.Trackers([], trackers.RunInfo(str(run), run.name, str(outputs))))
    for step in (1, 2):
        state = SimpleNamespace(global_step=step, is_world_process_zero=True)
        cb.on_step_begin(None, state, None)
        cb.on_step_end(None, state, None)
        cb.on_log(SimpleNamespace(max_steps=2), state, None, logs=dict(ASYNC_LOGS, reward=0.25 * step))
    return outputs, run, model


def python(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_export_writes_a_plain_model_that_computes_what_the_async_trained_one_did(async_run):
    from transformers import AutoModelForCausalLM

    outputs, run, trained = async_run
    done = python("-m", "trainer.export", "--outputs", str(outputs), "--run", run.name)
    assert done.returncode == 0, done.stderr
    out = run / "export"
    assert not (out / "rollout_state.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert not any("attn" in key for key in config), config  # tree_fa3 stays with the trainer
    assert "| rollouts | async |" in (out / "README.md").read_text()
    check = ("import sys, torch; from transformers import AutoModelForCausalLM as M; "
             "m = M.from_pretrained(sys.argv[1]); print(m.config._attn_implementation); "
             "print(m(torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1, :4].tolist())")
    fresh = python("-c", check, str(out))  # a process where no tree attention was ever registered
    assert fresh.returncode == 0, fresh.stderr
    lines = fresh.stdout.strip().splitlines()
    assert lines[-2] in ("sdpa", "eager")
    reference = AutoModelForCausalLM.from_pretrained(run / "checkpoint-2", attn_implementation="sdpa")
    expected = reference(torch.tensor([[1, 2, 3, 4, 5]])).logits[0, -1, :4].tolist()
    assert json.loads(lines[-1]) == pytest.approx(expected, abs=1e-5)


def test_report_reads_an_async_runs_records(async_run):
    outputs, run, _ = async_run
    assert [r["rollouts"] for r in read_metrics(run)] == ["async", "async"]
    done = python("-m", "trainer.report", "--outputs", str(outputs), "--run", run.name)
    assert done.returncode == 0, done.stderr
    assert (run / "report.png").stat().st_size > 0
    assert "reward: 0.375 (first 2 steps) -> 0.375" in done.stdout and "step time 2.50s on average: generation 0.70s" in done.stdout
