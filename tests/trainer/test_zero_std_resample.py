"""ZERO_STD_GROUPS=resample (issue 65 item 4), both modes: flat groups (every completion scored alike, advantage 0) are
replaced by informative ones from extra generation, within ZERO_STD_RESAMPLE_MAX.

Sync: the stack's trainer class (TRL 1.16's GRPOTrainer with the stack's rollout loop) against a real echo server, the
model's turns scripted (the one stand-in): the first batch calls echo_message with "hello" everywhere (every group
flat: all PARTIAL), an extra batch says the target word on every other rollout (every group informative). Async: the
rollout worker's bound (trainer.rollouts.zero_variance.WorkerResample), then TRL's real rollout loop."""

from __future__ import annotations

import json
import math

import pytest
import torch

from contract.config import CpuMode
from trainer.core import grpo_args
from trainer.rollouts import zero_variance
from trainer.rollouts.zero_variance import WorkerResample

CALL = '<tool_call>\n{{"name": "echo_message", "arguments": {{"message": "{}"}}}}\n</tool_call>'


def sync_trainer(tmp_path, tiny_model_dir, url, mode: str, informative_from_round: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from contract.config import RunConfig
    from envs import registry
    from trainer.rollouts.envs_binding import build_factories
    from trainer.run.dataset import build_dataset
    from trainer.run.grpo_trainer import make_trainer_class

    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--output-dir", str(tmp_path),
                          "--env-name", "echo", "--env-urls", f"echo={url}", "--num-generations", "2",
                          "--per-device-train-batch-size", "4", "--max-completion-length", "96",
                          "--dataset-size", "8", "--zero-std-groups", mode])
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    specs = {"echo": registry.get("echo")}
    dataset = build_dataset(cfg, specs)
    trainer = make_trainer_class()(model=AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                   args=grpo_args.grpo_config(cfg.resolved(CpuMode())), train_dataset=dataset,
                                   processing_class=tokenizer, environment_factory=build_factories(cfg, specs))
    trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency)
    trainer.zero_std_groups, trainer.zero_std_resample_max = cfg.zero_std_groups, cfg.zero_std_resample_max
    answer = tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id]
    rounds = []

    def scripted_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        texts = [tokenizer.decode(ids) for ids in prompt_ids]
        if any("<tool_response>" in t for t in texts):
            return [list(answer) for _ in prompt_ids], None
        rounds.append(len(prompt_ids))
        out = []
        for k, text in enumerate(texts):
            target = text.rsplit("say the word: ", 1)[1].split("<")[0].strip()
            word = target if len(rounds) >= informative_from_round and k % 2 == 0 else "hello"
            out.append(tokenizer.encode(CALL.format(word), add_special_tokens=False) + [tokenizer.eos_token_id])
        return out, None

    trainer._generate_single_turn = scripted_turn
    inputs = [dict(dataset[0])] * 2 + [dict(dataset[1])] * 2
    trainer.model.train()
    return trainer, inputs, rounds, tokenizer


def test_sync_resample_puts_informative_groups_in_the_flat_groups_places(tmp_path, tiny_model_dir, echo_server):
    trainer, inputs, rounds, tokenizer = sync_trainer(tmp_path, tiny_model_dir, echo_server.url, "resample", 2)
    out = trainer._generate_and_score_completions(inputs)
    assert rounds == [4, 4]  # the batch, then one extra batch of the same shape
    advantages = out["advantages"].view(-1)
    assert all(abs(a) > 0.1 for a in advantages.tolist()), advantages  # every group now teaches
    assert trainer._metrics["train"][zero_variance.EXTRA_GENERATION] == [1.0]
    assert trainer._metrics["train"][zero_variance.METRIC] == [1.0, 0.0]  # each batch generated, as generated
    loss_mask = out["completion_mask"] * out["tool_mask"]
    assert int(out["num_items_in_batch"]) == int(loss_mask.sum())  # the normaliser counts what is trained
    for row in range(4):  # each row whole: its prompt (left-padded), its completion (right-padded), its masks
        prompt = tokenizer.decode(out["prompt_ids"][row][out["prompt_mask"][row].bool()])
        completion = tokenizer.decode(out["completion_ids"][row][out["completion_mask"][row].bool()])
        word = json.loads(completion.split("<tool_call>")[1].split("</tool_call>")[0])["arguments"]["message"]
        target = prompt.rsplit("say the word: ", 1)[1].split("<")[0].strip()
        assert (word == target) == (row % 2 == 0), (row, word, target)
        assert (advantages[row] > 0) == (word == target)


def test_sync_resample_stops_at_its_bound_and_trains_what_is_left_as_keep(tmp_path, tiny_model_dir, echo_server):
    trainer, inputs, rounds, _ = sync_trainer(tmp_path, tiny_model_dir, echo_server.url, "resample", 99)
    out = trainer._generate_and_score_completions(inputs)
    assert rounds == [4, 4]  # ZERO_STD_RESAMPLE_MAX=1: one extra batch, then no more
    assert out["advantages"].abs().max().item() == 0.0  # still flat: kept, advantage 0 (as keep)
    assert int(out["num_items_in_batch"]) == int((out["completion_mask"] * out["tool_mask"]).sum()) > 0
    assert trainer._metrics["train"][zero_variance.EXTRA_GENERATION] == [1.0]


def test_sync_keep_generates_once(tmp_path, tiny_model_dir, echo_server):
    trainer, inputs, rounds, _ = sync_trainer(tmp_path, tiny_model_dir, echo_server.url, "keep", 2)
    trainer._generate_and_score_completions(inputs)
    assert rounds == [4] and zero_variance.EXTRA_GENERATION not in trainer._metrics["train"]


# ---------------------------------------------------------------------------- async: the worker's bound
def test_the_worker_leaves_flat_groups_out_within_the_bound_then_trains_them():
    worker = WorkerResample("resample", bound=0.5, step_groups=2)
    assert [worker.leave_out(True) for _ in range(2)] == [True, False]  # 0.5 x (0 trained + 2 a step) = 1
    worker.trained += 4
    assert worker.leave_out(True) and worker.leave_out(True) and not worker.leave_out(True)  # 0.5 x 6 = 3
    assert not worker.leave_out(False)  # an informative group is never left out
    drop = WorkerResample("drop", bound=0.5, step_groups=2)
    assert all(drop.leave_out(True) for _ in range(10))  # drop: no bound
    assert not WorkerResample("keep", 1.0, 2).leave_out(True)
    with pytest.raises(ValueError, match="ZERO_STD_GROUPS='refill'"):
        WorkerResample("refill", 1.0, 2)


def test_async_resample_logs_its_extra_generation_and_keeps_flat_groups_past_the_bound(tmp_path, tiny_model_dir,
                                                                                        echo_server):
    from tests.trainer.test_zero_variance import async_loop, run_groups

    loop = async_loop(tmp_path, tiny_model_dir, echo_server.url, "resample", False)  # every group flat
    loop._zero_std.bound, loop._zero_std.step_groups = 1.0, 1
    samples, reduced = run_groups(loop, 4)
    # 1 x (0 trained + 1 a step): the first flat group is left out, the next trained (advantage 0), and so on
    assert samples and all(s.advantage == 0.0 for s in samples)
    worker = loop._zero_std
    assert worker.left_out >= 1 and worker.trained >= 1
    assert worker.left_out <= 1.0 * (worker.trained + 1)  # the bound: ZERO_STD_RESAMPLE_MAX x (trained + a step's)
    assert math.isclose(reduced[zero_variance.EXTRA_GENERATION], worker.left_out / worker.trained)
