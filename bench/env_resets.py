"""Reset seconds per step: TRL's sequential env resets against the stack's resets at once (trainer/rollouts/rollout_loop.py).

    .venv/bin/python bench/env_resets.py [--batches 8,64] [--delay 0.25] [--concurrency N] [--model DIR]

For each batch size, one generation batch runs through TRL's scoring path (`_generate_and_score_completions`)
twice, with TRL's GRPOTrainer and with the stack's trainer class, on an in-process env whose reset takes --delay
seconds (a stand-in for an env server's reset round trip). Reset seconds = time from entering the scoring path to
its first generation call, which is the reset loop plus TRL's small per-batch set-up. A benchmark, not a test: it
prints. Issue #31 item 9: a 250 ms reset costs TRL 16 s at batch 64.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def slow_env(delay: float) -> type:
    class SlowReset:
        def reset(self, **row) -> str:
            time.sleep(delay)  # the simulated latency of a reset, not a synchronisation
            return " Board ready."

        def look(self, text: str) -> str:
            """
            Look.

            Args:
                text: Ignored.
            """
            return "nothing"

        def get_reward(self) -> float:
            return 0.0

    return SlowReset


def reset_seconds(trainer_cls, model_dir: Path, out_dir: Path, batch: int, delay: float,
                  concurrency: int | None) -> float:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Case {k}."}]} for k in range(batch // 2)]
    args = GRPOConfig(output_dir=str(out_dir), use_cpu=True, bf16=False, per_device_train_batch_size=batch,
                      num_generations=2, max_completion_length=8, report_to=[],
                      chat_template_kwargs={"enable_thinking": False})
    trainer = trainer_cls(model=AutoModelForCausalLM.from_pretrained(model_dir), args=args,
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
                          environment_factory=slow_env(delay))
    if hasattr(trainer, "configure_rollouts"):
        trainer.configure_rollouts(None, concurrency)
    first_generation = []

    def generate(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        first_generation.append(time.perf_counter())
        out = [tokenizer.encode("Done.", add_special_tokens=False) + [tokenizer.eos_token_id] for _ in prompt_ids]
        return out, [[-0.5] * len(ids) for ids in out]

    trainer._generate_single_turn = generate
    inputs = [dict(r) for r in rows for _ in range(2)]
    trainer._generate_and_score_completions(inputs)  # warm: the pool's instances exist, as from step 2 on
    first_generation.clear()
    start = time.perf_counter()
    trainer._generate_and_score_completions(inputs)
    return first_generation[0] - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="8,64", help="rollouts per generation batch (default 8,64)")
    p.add_argument("--delay", type=float, default=0.25, help="seconds each reset takes (default 0.25)")
    p.add_argument("--concurrency", type=int, default=None, help="TOOL_CONCURRENCY (default: the whole batch)")
    p.add_argument("--model", default=None, help="a tiny model already built (default: build one)")
    args = p.parse_args()
    from trl import GRPOTrainer

    from trainer.run.grpo_trainer import make_trainer_class

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "tiny"
        if not args.model:
            print("[bench] building the tiny model", flush=True)
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            stock = reset_seconds(GRPOTrainer, model, Path(tmp) / f"stock{batch}", batch, args.delay, None)
            ours = reset_seconds(make_trainer_class(), model, Path(tmp) / f"ours{batch}", batch, args.delay,
                                 args.concurrency)
            print(f"[bench] batch {batch}: stock {stock:.2f} s, ours {ours:.2f} s", flush=True)
            rows.append((batch, stock, ours))
    print(f"\nReset seconds per step, reset {args.delay:g} s, TOOL_CONCURRENCY {args.concurrency or 'whole batch'}")
    print(f"{'batch':>6} {'stock TRL':>10} {'ours':>8} {'speed-up':>9}")
    for batch, stock, ours in rows:
        print(f"{batch:>6} {stock:>9.2f}s {ours:>7.2f}s {stock / ours:>8.1f}x")


if __name__ == "__main__":
    main()
