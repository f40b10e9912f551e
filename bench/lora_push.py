"""What a weight push costs with LoRA against full fine-tuning (#32 item 2): the trainer's side of TRL 1.16's sync.

    python bench/lora_push.py [--model Qwen3-0.6B] [--rank 16] [--repeats 3]

Builds the model from its published shape (random weights, fp32 master weights as the trainer keeps them, on CPU)
and times TRL's own push iterator, `VLLMGeneration._iter_named_params` (what server mode streams over NCCL and
colocate loads), read to the end with each tensor cast to bf16 as `trainer.gpu.push_in_served_dtype` does:
full weights, LoRA (TRL merges the adapter into the base, reads, unmerges), and QLoRA's path
(`trainer.run.lora.merged_weights`: base + B·A per layer, no merge). Bytes on the wire are the same for all three: every
base weight, merged, in vLLM's dtype; the adapter-only sync of the async trainer sends only the adapter (printed
beside). Figures from one run, side by side; the NCCL transfer itself is not measured here (no GPU).
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager


def push_seconds(gen, iterate, repeats: int) -> tuple[float, int]:
    import torch

    best, sent = float("inf"), 0
    for _ in range(repeats):
        t0, sent = time.perf_counter(), 0
        for _name, tensor in iterate():
            sent += tensor.to(torch.bfloat16).numel() * 2
        best = min(best, time.perf_counter() - t0)
    return best, sent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.generation.vllm_generation import VLLMGeneration

    from trainer.run import lora
    from contract import memory

    config = {k: v for k, v in memory.qwen3_config(args.model).items() if k != "model_type"}
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**config)).float()

    class NotSharded:
        is_fsdp, fsdp_version = False, None

        @contextmanager
        def gather_params(self, params):
            yield

    gen = object.__new__(VLLMGeneration)
    gen._dist = NotSharded()
    gen.model = model
    full_s, full_b = push_seconds(gen, gen._iter_named_params, args.repeats)
    peft_model = get_peft_model(model, LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear"))
    gen.model = peft_model
    lora_s, lora_b = push_seconds(gen, gen._iter_named_params, args.repeats)
    qlora_s, qlora_b = push_seconds(gen, lambda: lora.merged_weights(peft_model, gen._fix_param_name_to_vllm),
                                    args.repeats)
    adapter_b = sum(p.numel() * 2 for p in peft_model.parameters() if p.requires_grad)
    print(f"{args.model}, rank {args.rank}, trainer side of one push (best of {args.repeats}, CPU, "
          f"{torch.get_num_threads()} threads):")
    print(f"  full weights                   {full_s:7.2f} s  {full_b / 1e9:6.2f} GB to vLLM")
    print(f"  LoRA, TRL merge/read/unmerge   {lora_s:7.2f} s  {lora_b / 1e9:6.2f} GB to vLLM "
          f"({lora_s / full_s:.2f}x full)")
    print(f"  QLoRA path, base + B·A         {qlora_s:7.2f} s  {qlora_b / 1e9:6.2f} GB to vLLM "
          f"({qlora_s / full_s:.2f}x full)")
    print(f"  adapter alone (async, --enable-lora): {adapter_b / 1e6:.1f} MB ({adapter_b / full_b:.2%} of a full push)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
