"""LORA_R under TRAINER_SHARDING=fsdp (FSDP2), 2 CPU processes (gloo): both of TRL's LoRA syncs on sharded adapters;
used by test_master_weights.py (in master_weights.py's launch, after its runs: one start-up for both).

    python -m torch.distributed.run --nproc_per_node 2 tests/gpu_path/fsdp2_lora.py MODEL_DIR OUT_DIR

The model is the GPU path's (trainer.modeling.model, fp32 master weights) wrapped with the run's LoraConfig
(trainer.modeling.lora.peft_config) and prepared by accelerate's own FSDP2 preparation, forced on CPU as in
master_weights.py (accelerate keeps FSDP for GPU-type backends). One optimizer step moves the adapter, then:
  * sync (ROLLOUTS=sync): TRL's own VLLMGeneration.sync_weights in server mode merges the sharded adapter, streams
    every base weight (client recorded: test double for the NCCL broadcast) and unmerges;
  * async (ROLLOUTS=async): TRL's own save_lora_adapter, called on every rank as its AsyncGRPOTrainer does, gathers
    the sharded adapter and rank 0 writes the folder vLLM loads.
Rank 0 prints one JSON line: what was sent and written, against the merge computed from the gathered tensors.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torch.distributed.run
    sys.path.insert(0, str(ROOT))

from contract.config import GpuMode
from tests.gpu_path.master_weights import batch, fsdp2_accelerator, run_config  # noqa: E402

LORA_R, LORA_ALPHA = 8, 16


class KeepingClient:
    """Stands in for TRL's VLLMClient (test double for the NCCL broadcast): keeps each tensor update_named_params
    sends, as the served model would receive it."""

    def __init__(self) -> None:
        self.sent: dict = {}

    def update_named_params(self, metadata, named_params):
        self.sent = {name: t.detach().cpu().clone() for name, t in named_params}

    def reset_prefix_cache(self):
        pass


def main(model_dir: Path, out: Path) -> None:
    import torch
    import torch.distributed as dist
    from peft import get_peft_model
    from safetensors.torch import load_file
    from torch.distributed.fsdp import FSDPModule
    from trl.experimental.async_grpo.async_grpo_trainer import save_lora_adapter
    from trl.generation.vllm_generation import VLLMGeneration

    from trainer.modeling import lora
    from trainer.modeling.model import load_model_and_tokenizer

    cfg = run_config(model_dir).model_copy(update={"lora_r": LORA_R, "lora_alpha": LORA_ALPHA})
    base, _ = load_model_and_tokenizer(cfg.resolved(GpuMode()))
    model = get_peft_model(base, lora.peft_config(cfg))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    accelerator, _, _ = fsdp2_accelerator()
    model, opt = accelerator.prepare(model, opt)
    ids = batch(model.config.vocab_size, seed=accelerator.process_index)
    loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()

    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # a collective: every rank
    gen = object.__new__(VLLMGeneration)  # TRL's own sync_weights in server mode, the client kept
    gen.__dict__.update(model=model, mode="server", enable_sleep_mode=False, _weight_metadata=None,
                        vllm_client=KeepingClient(),
                        _dist=SimpleNamespace(is_fsdp=True, fsdp_version=2, gather_params=lambda params: nullcontext()),
                        accelerator=SimpleNamespace(is_main_process=dist.get_rank() == 0, device=torch.device("cpu")))
    gen.sync_weights()
    after_sync = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    adapter_dir = out / "trl-policy-v1"
    save_lora_adapter(accelerator.unwrap_model(model), accelerator, "default", str(adapter_dir))
    dist.barrier()
    if dist.get_rank() == 0:
        scale = LORA_ALPHA / LORA_R
        merged_off, targets = 0.0, 0
        for name, weight in full.items():
            if not name.endswith(".base_layer.weight"):
                continue
            layer = name.removesuffix(".base_layer.weight")
            a, b = full[f"{layer}.lora_A.default.weight"], full[f"{layer}.lora_B.default.weight"]
            served = gen.vllm_client.sent[layer.removeprefix("base_model.model.") + ".weight"]
            merged_off = max(merged_off, float((served - (weight + scale * b @ a)).abs().max()))
            targets += 1
        written = load_file(str(adapter_dir / "adapter_model.safetensors"))
        lora_full = {n: t for n, t in full.items() if ".lora_" in n}
        written_off = max(float((written[n.replace(".default", "")] - t).abs().max()) for n, t in lora_full.items())
        print(json.dumps({
            "fsdp_module": isinstance(model, FSDPModule),
            "sharded": sum(p.to_local().numel() != p.numel() for p in model.parameters()),
            "lora_b_moved": max(float(t.abs().max()) for n, t in lora_full.items() if "lora_B" in n),
            "sent": sorted(gen.vllm_client.sent), "base_names": sorted(base_names(model_dir)),
            "targets": targets, "merged_max_abs_error": merged_off,
            "delta_max": max(float((scale * full[n.replace("base_layer", "lora_B.default")]
                                    @ full[n.replace("base_layer", "lora_A.default")]).abs().max())
                             for n in full if n.endswith(".base_layer.weight")),
            "after_sync_max_abs_change": max(float((full[n] - after_sync[n]).abs().max()) for n in full),
            "written": len(written), "lora_tensors": len(lora_full), "written_max_abs_error": written_off,
            "adapter_config": (adapter_dir / "adapter_config.json").exists()}), flush=True)
    dist.destroy_process_group()


def base_names(model_dir: Path) -> list[str]:
    """The served model's tensor names (what a push must cover, no lora_A/B)."""
    from transformers import AutoModelForCausalLM

    return [n for n, _ in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()]


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
