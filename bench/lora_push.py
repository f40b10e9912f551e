"""What a weight push costs with LoRA against full fine-tuning (#32 item 2): the trainer's side of TRL 1.16's sync.

    python bench/lora_push.py [--model Qwen3-0.6B] [--rank 16] [--repeats 3]

Builds the model from its published shape (random weights, fp32 master weights as the trainer keeps them, on CPU)
and times TRL's own push iterator, `VLLMGeneration._iter_named_params` (what server mode streams over NCCL and
colocate loads), read to the end with each tensor cast to bf16 as `trainer.gpu.push_in_served_dtype` does:
full weights, LoRA (TRL merges the adapter into the base, reads, unmerges), and QLoRA's path
(`trainer.modeling.lora.merged_weights`: base + B·A per layer, no merge). Bytes on the wire are the same for all three: every
base weight, merged, in vLLM's dtype; the adapter-only sync of the async trainer sends only the adapter (printed
beside). Figures from one run, side by side; the NCCL transfer itself is not measured here (no GPU).

ROLLOUTS=async with LORA_R pushes the adapter alone (TRL's `_sync_weight_lora`): it writes the adapter with TRL's own
`save_lora_adapter` (timed here always) and has vLLM load it by `/v1/load_lora_adapter`. With `--vllm URL --shared
HOST_DIR[:SERVER_DIR]` (a vLLM, e.g. the CPU twin, started with `--enable-lora --max-lora-rank R`,
VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, serving this `--model-dir` and mounting HOST_DIR at SERVER_DIR) it also times
that load, and the full push `make rehearse` makes instead (trainer.gpu.trl_hooks.reload_weights: write every
merged weight in bf16, vLLM reloads them): the two pushes end to end on the same server.

    python bench/lora_push.py --model tiny --model-dir DIR --vllm http://127.0.0.1:PORT --shared /tmp/x:/push
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
        for _, tensor in iterate():
            sent += tensor.to(torch.bfloat16).numel() * 2
        best = min(best, time.perf_counter() - t0)
    return best, sent


def adapter_write_seconds(peft_model, dest_root, repeats: int) -> tuple[float, int]:
    """TRL's save_lora_adapter (what each async LoRA sync writes), best of `repeats`; bytes of the written folder."""
    import os
    from types import SimpleNamespace

    import torch
    from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter

    accelerator = SimpleNamespace(device=torch.device("cpu"), is_main_process=True)
    best = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        save_lora_adapter(peft_model, accelerator, "default", os.path.join(dest_root, f"bench-v{i}"))
        best = min(best, time.perf_counter() - t0)
    folder = os.path.join(dest_root, f"bench-v{repeats - 1}")
    return best, sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def served_pushes(url: str, host_dir: str, server_dir: str, peft_model, repeats: int) -> dict[str, float]:
    """End to end against a vLLM server: the adapter (write + /v1/load_lora_adapter) and the merged full push by
    reload (write + /collective_rpc reload_weights), best of `repeats` each."""
    import os

    import requests
    import torch

    from trainer.gpu.trl_hooks import reload_weights
    from trainer.modeling.lora import merged_weights

    url = url.rstrip("/")
    adapter = full = float("inf")
    for i in range(repeats):
        t0 = time.perf_counter()
        _, _ = adapter_write_seconds(peft_model, os.path.join(host_dir, f"round{i}"), 1)
        r = requests.post(f"{url}/v1/load_lora_adapter", timeout=600, json={
            "lora_name": f"bench-{i}", "lora_path": f"{server_dir}/round{i}/bench-v0", "load_inplace": False})
        if r.status_code != 200:
            raise SystemExit(f"/v1/load_lora_adapter answered {r.status_code}: {r.text[:300]}")
        adapter = min(adapter, time.perf_counter() - t0)
        requests.post(f"{url}/v1/unload_lora_adapter", timeout=600, json={"lora_name": f"bench-{i}"})
        t0 = time.perf_counter()
        weights = ((n, t.to(torch.bfloat16)) for n, t in merged_weights(peft_model))
        reload_weights(url, os.path.join(host_dir, "full"), weights, 600) if server_dir == host_dir else \
            _reload_at(url, host_dir, server_dir, weights)
        full = min(full, time.perf_counter() - t0)
    return {"adapter": adapter, "full": full}


def _reload_at(url: str, host_dir: str, server_dir: str, weights) -> None:
    """reload_weights where the server sees the folder under another path (a container's mount)."""
    import os

    import requests
    from safetensors.torch import save_file

    target = os.path.join(host_dir, "full")
    os.makedirs(target, exist_ok=True)
    save_file({n: t.contiguous() for n, t in weights}, os.path.join(target, "model.safetensors"))
    r = requests.post(f"{url}/collective_rpc", timeout=600, json={
        "method": "reload_weights", "kwargs": {"weights_path": f"{server_dir}/full"}})
    r.raise_for_status()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model-dir", help="a saved model to load instead of --model's random shape (the served one)")
    p.add_argument("--vllm", help="a vLLM serving --model-dir with --enable-lora: time the pushes end to end")
    p.add_argument("--shared", help="HOST_DIR[:SERVER_DIR]: a folder the vLLM server reads at SERVER_DIR")
    args = p.parse_args()

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.generation.vllm_generation import VLLMGeneration

    from trainer.modeling import lora
    from contract import memory

    torch.manual_seed(0)
    if args.model_dir:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        config = {k: v for k, v in memory.qwen3_config(args.model).items() if k != "model_type"}
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
    import tempfile

    with torch.no_grad():  # a trained adapter, not peft's zero B: what a sync after a step writes
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 1e-3)
    with tempfile.TemporaryDirectory() as tmp:
        write_s, written = adapter_write_seconds(peft_model, tmp, args.repeats)
    print(f"  adapter write (TRL save_lora_adapter) {write_s:7.3f} s  {written / 1e6:6.2f} MB on disk (fp32)")
    if args.vllm and args.shared:
        host_dir, _, server_dir = args.shared.partition(":")
        served = served_pushes(args.vllm, host_dir, server_dir or host_dir, peft_model, args.repeats)
        print(f"  end to end on {args.vllm} (best of {args.repeats}):")
        print(f"    adapter: write + /v1/load_lora_adapter      {served['adapter']:7.3f} s")
        print(f"    full: merged bf16 write + reload_weights    {served['full']:7.3f} s "
              f"({served['full'] / served['adapter']:.1f}x the adapter)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
