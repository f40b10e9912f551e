"""A trainer on the rendezvous fixture env with the model's turns scripted (tests/trainer/test_tool_rounds.py,
bench/tool_rounds.py). Everything between the trainer and the env server is the stack's own path: the env
learned from /schema, bound by trainer.rollouts.envs_binding, driven by train.py's trainer class (or TRL's, to compare)."""

from __future__ import annotations

import json
import re

from contract.config import CpuMode
from trainer.core import grpo_args


def make_trainer(url: str, model_dir, out_dir, batch: int, *flags: str, stock_loop: bool = False):
    """(trainer, tokenizer) on the env at `url`, `batch` rollouts per generation; `flags` are trainer.train's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.run import preflight
    from contract.config import RunConfig
    from trainer.rollouts.envs_binding import build_factories
    from trainer.run.dataset import build_dataset
    from trainer.run.grpo_trainer import make_trainer_class

    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(model_dir), "--output-dir", str(out_dir),
                          "--env-name", "rendezvous", "--env-urls", f"rendezvous={url}", "--num-generations", "2",
                          "--per-device-train-batch-size", str(batch), "--max-completion-length", "256",
                          "--dataset-size", "8", *flags])
    specs = preflight.resolve_envs(cfg).specs
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if stock_loop:
        from trl import GRPOTrainer as trainer_class
    else:
        trainer_class = make_trainer_class()
    trainer = trainer_class(
        model=AutoModelForCausalLM.from_pretrained(model_dir), args=grpo_args.grpo_config(cfg.resolved(CpuMode())),
        train_dataset=build_dataset(cfg, specs), processing_class=tokenizer,
        environment_factory=build_factories(cfg, specs))
    if not stock_loop:
        trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency)
    return trainer, tokenizer


def script(trainer, tokenizer, texts: list[str], rounds: int = 1) -> None:
    """Rollout k calls meet(texts[k]) on its first `rounds` turns, then answers."""

    def turn(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    def meet(text: str) -> list[int]:
        return turn('<tool_call>\n' + json.dumps({"name": "meet", "arguments": {"text": text}}) + '\n</tool_call>')

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        out = []
        for k, ids in enumerate(prompt_ids):
            prompt = tokenizer.decode(ids)
            done = prompt.count("<|im_start|>assistant") - 1  # assistant turns so far
            if done == 0:
                out.append(meet(texts[k]))  # the first turn sees the whole batch, in order
            elif done < rounds:
                out.append(meet(re.findall(r"met (\S+)", prompt)[-1]))
            else:
                out.append(turn("Done."))
        return out, None

    trainer._generate_single_turn = generate


def run_batch(trainer) -> tuple:
    """One generation batch of the first dataset row through TRL's scoring path; what the tool loop returned."""
    returned = []
    original = trainer._tool_call_loop

    def recording(*args):
        returned.append(original(*args))
        return returned[-1]

    trainer._tool_call_loop = recording
    batch = trainer.args.per_device_train_batch_size
    trainer._generate_and_score_completions([dict(trainer.train_dataset[0])] * batch)
    trainer._tool_call_loop = original
    return returned[0]
