"""How far a bf16 forward lands from an fp32 one on the weight-land check's perturbed weights (#42 item 10).

    python bench/weight_check_tolerance.py [--layers 28] [--hidden 256] [--prompts 4] [--init-std 0.02 0.1]

`make nccl-check FULL=1` (trainer.gpu.weight_check.check_weights_land) scales every weight by a seeded factor in
[0.5, 1.5], pushes, and requires vLLM's logprobs (served in bf16) to match the trainer's own forward (fp32 master
weights) within MATCH_MAX_NATS. This measures that gap on the CPU: a Qwen3-shaped model (28 layers, Qwen3-0.6B's head
layout scaled down to `--hidden`, its full vocabulary), random init at each `--init-std` (0.02 is transformers'
default; larger ones give peakier, more trained-like logits), perturbed with the check's own `perturb_`; then the
check's own `own_forward` on a bf16 copy of the same weights (what vLLM serves) against the fp32 weights, plain and under
bf16 autocast (what training computes on a GPU, and what the check compares), over `--prompts` prompts of random token
ids plus 16 greedy tokens (the probe's shape); and, for scale, a bf16 copy whose middle layer kept its unperturbed
tensors (the failure the check exists to catch). Prints mean and max |logprob difference| per setting and overall
(for the stale layer the smallest mean is what matters: it must stay far above the tolerance).
Transformers' bf16 CPU kernels stand in for vLLM's CUDA ones: the same rounding, other accumulation orders.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def qwen3_shape(layers: int, hidden: int, init_std: float):
    from transformers import Qwen3Config

    heads = max(2, hidden // 64)
    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
                       max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, initializer_range=init_std, bos_token_id=None)


def measure(layers: int, hidden: int, init_std: float, prompts: int, prompt_len: int,
            seed: int) -> tuple[dict[str, list[float]], float]:
    import torch
    from transformers import Qwen3ForCausalLM

    from trainer.gpu import weight_check

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_shape(layers, hidden, init_std)).eval()
    originals = weight_check.perturb_(model)  # the check's perturbation, in fp32
    half = Qwen3ForCausalLM(model.config).eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)  # the served copy: the same perturbed weights rounded to bf16
    # what the check must still catch: a push where one layer (the middle one) kept its old tensors, served in bf16
    stale = Qwen3ForCausalLM(model.config).eval()
    stale.load_state_dict(model.state_dict())
    middle = f"model.layers.{layers // 2}."
    with torch.no_grad():
        for name, p in stale.named_parameters():
            if name.startswith(middle):
                p.copy_(originals[name])
    stale = stale.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    diffs: dict[str, list[float]] = {"fp32 vs bf16": [], "autocast vs bf16": [],
                                   "fp32 vs bf16 with a stale layer": []}
    greedy: list[float] = []  # fp32 logprobs of the greedy tokens: how peaked the model's distributions are
    for _ in range(prompts):
        ids = torch.randint(0, model.config.vocab_size, (prompt_len,), generator=gen).tolist()
        with torch.no_grad():
            out = half.generate(torch.tensor([ids]), max_new_tokens=weight_check.PROBE_TOKENS, do_sample=False,
                                pad_token_id=0)
        tokens = out[0, prompt_len:].tolist()  # the served (bf16) greedy tokens, as the check scores them
        full = weight_check.own_forward(model, ids, tokens, autocast=False).logprobs
        mixed = weight_check.own_forward(model, ids, tokens, autocast=True).logprobs  # training's forward on a GPU
        bf16 = weight_check.own_forward(half, ids, tokens).logprobs
        diffs["fp32 vs bf16"] += [abs(a - b) for a, b in zip(full, bf16)]
        diffs["autocast vs bf16"] += [abs(a - b) for a, b in zip(mixed, bf16)]
        stale_lps = weight_check.own_forward(stale, ids, tokens).logprobs
        diffs["fp32 vs bf16 with a stale layer"] += [abs(a - b) for a, b in zip(full, stale_lps)]
        greedy += full[prompt_len - 1:]
    return diffs, sum(greedy) / len(greedy)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--init-std", type=float, nargs="+", default=[0.02, 0.1])
    p.add_argument("--seeds", type=int, default=2)
    args = p.parse_args()
    worst = dict.fromkeys(("fp32 vs bf16", "autocast vs bf16", "fp32 vs bf16 with a stale layer"), 0.0)
    for std in args.init_std:
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            diffs, greedy = measure(args.layers, args.hidden, std, args.prompts, args.prompt_len, seed)
            parts = []
            for kind, d in diffs.items():
                worst[kind] = max(worst[kind], max(d))
                parts.append(f"{kind}: mean {sum(d) / len(d):.4f}, max {max(d):.4f}")
            print(f"layers {args.layers}, hidden {args.hidden}, init std {std:g}, seed {seed}: "
                  f"{len(diffs['fp32 vs bf16'])} logprobs; " + "; ".join(parts) + f" nats; greedy tokens' mean logprob "
                  f"{greedy:.2f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print("max over all: " + ", ".join(f"{kind} {w:.4f} nats" for kind, w in worst.items()), flush=True)

if __name__ == "__main__":
    main()
