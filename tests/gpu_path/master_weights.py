"""One training step at lr 1e-5 on the model the GPU path builds, in one process or in several under accelerate's
FSDP2 preparation; used by test_master_weights.py.

    python -m torch.distributed.run --nproc_per_node 2 tests/gpu_path/master_weights.py MODEL_DIR bf16,fp32 [LORA_OUT]

The FSDP2 run (2 CPU processes, gloo) prepares the model with accelerate's own `Accelerator.prepare` under
`FullyShardedDataParallelPlugin(fsdp_version=2)` and bf16 mixed precision; accelerate only selects FSDP on GPU-type
backends, so on CPU its distributed type is set to FSDP by hand before `prepare` (the preparation itself is
accelerate's `fsdp2_prepare_model`, unchanged). Rank 0 prints one JSON line per dtype named, each from a model loaded
and an Accelerator made afresh; with LORA_OUT, then fsdp2_lora.py's run (its line last). One launch for all: the
processes' start-up is most of the cost.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script by torch.distributed.run
    sys.path.insert(0, str(ROOT))


def make_model_dir(out: Path) -> Path:
    """A tiny Qwen3 (trainer.tiny_model's shape, random init) saved in bf16, as hub checkpoints (Qwen3-0.6B) are."""
    import torch

    from trainer import tiny_model

    if (out / "config.json").exists():
        return out
    tok = tiny_model.make_tokenizer(["say the word: apple", "the tool answered: banana", "hello world"] * 20, 400)
    model = tiny_model.make_model(tok, seed=0).to(torch.bfloat16)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_config(model_dir: Path):
    from contract.config import RunConfig

    return RunConfig.load([], model_name=str(model_dir), train_mode="gpu")


def load(model_dir: Path, dtype: str):
    """fp32: trainer.train's own load_model_and_tokenizer (the GPU path). bf16: the same model loaded in bf16 (what
    the GPU path loaded before: `dtype=torch.bfloat16`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.modeling.model import load_model_and_tokenizer

    from contract.config import GpuMode

    cfg = run_config(model_dir)
    if dtype == "fp32":
        return load_model_and_tokenizer(cfg.resolved(GpuMode()))[0], cfg
    return AutoModelForCausalLM.from_pretrained(cfg.resolved(GpuMode()).model_path, dtype=torch.bfloat16), cfg


def optimizer(model, cfg):
    """The optimizer HF's Trainer builds from the project's GRPOConfig (AdamW, fused, the GPU learning rate 1e-5)."""
    from transformers import Trainer

    from contract.config import GpuMode
    from trainer.core import grpo_args

    args = grpo_args.grpo_config(cfg.resolved(GpuMode()))
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    return cls([p for p in model.parameters() if p.requires_grad], **kwargs), kwargs


def batch(vocab: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (4, 32), generator=g)
    return ids


def step(model, opt, ids) -> float:
    """One optimizer step with bf16 autocast, as accelerate runs TRL's forward/backward under GRPOConfig(bf16=True)."""
    import torch

    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def fractions(before: dict, after: dict) -> dict:
    """Share of norm weights (1-d, names with `norm`) and of matrix entries (2-d) that the step changed."""
    moved = {"norm": [0, 0], "matrix": [0, 0]}
    for name, old in before.items():
        kind = "norm" if old.dim() == 1 and "norm" in name else "matrix" if old.dim() == 2 else None
        if kind:
            moved[kind][0] += int((after[name] != old).sum())
            moved[kind][1] += old.numel()
    return {kind: round(n / total, 4) for kind, (n, total) in moved.items()}


def single_process(model_dir: Path, dtype: str) -> dict:
    import torch

    model, cfg = load(model_dir, dtype)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt, kwargs = optimizer(model, cfg)
    loss = step(model, opt, batch(model.config.vocab_size))
    after = {n: p.detach() for n, p in model.named_parameters()}
    return {"dtype": str(next(model.parameters()).dtype), "lr": kwargs["lr"], "loss": loss,
            "optimizer": type(opt).__name__, "fused": bool(kwargs.get("fused")), "changed": fractions(before, after),
            "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}), "is_bf16": dtype == "bf16",
            "autocast": str(torch.bfloat16)}


class RecordingClient:
    """Stands in for TRL's VLLMClient (test double for the NCCL broadcast): keeps what update_named_params sends."""

    def __init__(self) -> None:
        self.sent: list = []

    def update_named_params(self, metadata, named_params):
        self.sent = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in named_params]

    def reset_prefix_cache(self):
        pass


def fsdp2_accelerator(mixed_precision: str = "no"):
    """accelerate's Accelerator with the FSDP2 plugin TRAINER_SHARDING=fsdp asks for, FSDP forced on CPU; returns it,
    its plugin and the distributed type accelerate chose by itself (it keeps FSDP for GPU-type backends)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from trainer.launch import SHARDING_FLAGS

    flags = SHARDING_FLAGS["fsdp"]  # what TRAINER_SHARDING=fsdp hands `accelerate launch`
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=int(flags[flags.index("--fsdp_version") + 1]),
        auto_wrap_policy=flags[flags.index("--fsdp_auto_wrap_policy") + 1].lower(),
        reshard_after_forward=flags[flags.index("--fsdp_reshard_after_forward") + 1] == "true",
        state_dict_type=flags[flags.index("--fsdp_state_dict_type") + 1])
    accelerator = Accelerator(cpu=True, mixed_precision=mixed_precision, fsdp_plugin=plugin)
    state = accelerator.state
    chosen = str(state.distributed_type)
    if state.distributed_type != DistributedType.FSDP:  # MULTI_CPU: accelerate keeps FSDP for GPU-type backends
        state.distributed_type = DistributedType.FSDP
        if mixed_precision != "no":
            plugin.set_mixed_precision(mixed_precision)
        state.fsdp_plugin = plugin
    return accelerator, plugin, chosen


def fsdp2(model_dir: Path, dtype: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from trl.generation.vllm_generation import VLLMGeneration

    from trainer.gpu.trl_hooks import push_in_served_dtype

    model, cfg = load(model_dir, dtype)
    loaded = sorted({str(p.dtype) for p in model.parameters()})
    opt, kwargs = optimizer(model, cfg)  # builds GRPOConfig, which resets accelerate's state: before the Accelerator
    accelerator, plugin, chosen = fsdp2_accelerator("bf16")
    at_prepare = bool(accelerator.is_fsdp2)
    model, opt = accelerator.prepare(model, opt)  # FSDP2: together, as HF's Trainer does (the optimizer is re-pointed)
    prepared = sorted({str(p.dtype) for p in model.parameters()})
    full = lambda: {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}  # noqa: E731
    before = full()
    ids = batch(model.config.vocab_size, seed=accelerator.process_index)
    with accelerator.autocast():
        loss = model(input_ids=ids, labels=ids).loss
    accelerator.backward(loss)
    opt.step()
    opt.zero_grad()
    after = full()

    gen = object.__new__(VLLMGeneration)  # TRL's own sync_weights in server mode, the client recorded
    gen.__dict__.update(model=model, mode="server", enable_sleep_mode=False, _weight_metadata=None,
                        vllm_client=RecordingClient(), _dist=SimpleNamespace(is_fsdp=True, fsdp_version=2),
                        accelerator=SimpleNamespace(is_main_process=dist.get_rank() == 0, device=torch.device("cpu")))
    pushed = push_in_served_dtype(SimpleNamespace(vllm_generation=gen), "bfloat16")
    gen.sync_weights()
    if dist.get_rank() == 0:
        print(json.dumps({
            "accelerate_chose": chosen, "is_fsdp2_at_prepare": at_prepare,
            "fsdp_module": isinstance(model, FSDPModule), "fsdp_version": plugin.fsdp_version,
            "loaded": loaded, "prepared": prepared, "lr": kwargs["lr"], "changed": fractions(before, after),
            "sharded": sum(p.to_local().numel() != p.numel() for p in model.parameters()), "pushed": pushed,
            "sent": gen.vllm_client.sent, "metadata": gen._weight_metadata,
            "full": {n: list(t.shape) for n, t in before.items()}}), flush=True)


if __name__ == "__main__":
    import torch.distributed as dist

    for dtype in sys.argv[2].split(","):
        fsdp2(Path(sys.argv[1]), dtype)
    if len(sys.argv) > 3:
        from accelerate.state import AcceleratorState

        from tests.gpu_path import fsdp2_lora

        AcceleratorState._reset_state(reset_partial_state=True)  # as a fresh process: no bf16 FSDP state left over
        fsdp2_lora.main(Path(sys.argv[1]), Path(sys.argv[3]))  # ends the process group
    else:
        dist.destroy_process_group()
