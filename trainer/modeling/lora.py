"""LoRA and QLoRA (LORA_R > 0, QLORA): the adapter TRL trains, and adapter folders (checkpoints, exports) turned into
standalone models. The rules the settings must meet are the contract's (contract.lora_rules).

Standard library at import; peft, torch and transformers load inside the functions that need them.

TRL 1.16 does the training side: `GRPOTrainer(peft_config=...)` wraps the model, its checkpoints hold the adapter only
(transformers saves a PeftModel's adapter), resume loads it back, and every weight push merges the adapter into the
base, streams the merged weights under the base's names and unmerges (`VLLMGeneration._iter_named_params`), so vLLM
serves merged weights and needs no LoRA support in sync mode.

ROLLOUTS=async pushes the adapter alone (TRL 1.16's AsyncGRPOTrainer, `_sync_weight_lora`): each sync pauses vLLM,
saves the adapter to `<run dir>/.vllm_lora/trl-policy-v<N>`, has vLLM load it through `/v1/load_lora_adapter`,
resumes, and the rollout worker names `trl-policy-v<N>` in its requests; no base weight moves, no NCCL group forms.
vLLM must serve LoRA for it: contract.lora_rules' `vllm_lora_flags` and `VLLM_LORA_ENV` are the vllm service's extra flags and
environment (tools/compose_file.add_lora_serving adds them, with the outputs volume read-only, on a GPU host and in `make rehearse` alike).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from contract.lora_rules import ALL_LINEAR

if TYPE_CHECKING:
    from contract.config import RunConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
ADAPTER_SYNC_DIR = ".vllm_lora"  # TRL's AsyncGRPOTrainer._lora_dir: <run dir>/.vllm_lora/trl-policy-v<N>


def peft_config(cfg: "RunConfig"):
    """The LoraConfig TRL wraps the model with, or None for full fine-tuning."""
    lora = cfg.lora
    if lora is None:
        return None
    from peft import LoraConfig

    modules = lora.target_modules  # checked once, when the config loaded (contract/config/model.py)
    return LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=ALL_LINEAR if modules == (ALL_LINEAR,) else list(modules), bias="none",
                      task_type="CAUSAL_LM")


def quantization_kwargs(cfg: "RunConfig") -> dict[str, Any]:
    """from_pretrained kwargs for QLoRA's 4-bit base (NF4, double quantization, bf16 compute); {} otherwise."""
    if not cfg.qlora:
        return {}
    import torch
    from transformers import BitsAndBytesConfig

    return {"quantization_config": BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16)}


def keep_adapters_fp32(model) -> int:
    """QLoRA: put the trainable parameters back in fp32 after TRL's init, before the optimizer is built. TRL 1.16 casts
    every trainable parameter of a quantized model to bf16 (GRPOTrainer.__init__, the quantized-model branch), so the
    adapters, their gradients and AdamW moments would be bf16: at lr 1e-4 a lora_A entry (about 0.02) moves by less than
    one bf16 step. fp32 adapters over the 4-bit base are peft's own default (autocast_adapter_dtype); bf16 autocast still
    runs the compute. Returns how many tensors it cast (0 for a model that is not quantized)."""
    import torch

    if not (getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False)):
        return 0
    cast = 0
    for param in model.parameters():
        if param.requires_grad and param.is_floating_point() and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)
            cast += 1
    return cast


# ---------------------------------------------------------------------------- adapter folders
def is_adapter(folder: str | Path) -> bool:
    """Whether a checkpoint or export folder holds a LoRA adapter rather than full weights."""
    folder = Path(folder)
    return (folder / ADAPTER_CONFIG).is_file() and any((folder / n).is_file() for n in ADAPTER_WEIGHTS)


def adapter_info(folder: str | Path) -> dict[str, Any]:
    """adapter_config.json: base_model_name_or_path, r, lora_alpha, target_modules, ..."""
    return json.loads((Path(folder) / ADAPTER_CONFIG).read_text())


def merged_model(adapter_dir: str | Path, base: str | None = None, load_kwargs: dict[str, Any] | None = None):
    """The base model (fp32) with the adapter of `adapter_dir` merged in: a plain transformers model, as a full
    fine-tune's checkpoint would load. `base`: the base model's folder or hub id (default: the one the adapter
    records)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = base or adapter_info(adapter_dir)["base_model_name_or_path"]
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, **(load_kwargs or {}))
    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()


def write_merged(adapter_dir: str | Path, out: str | Path, base: str | None = None,
                 load_kwargs: dict[str, Any] | None = None) -> Path:
    """A standalone model folder (weights, config, generation config, tokenizer from the adapter folder) of base +
    adapter: what `make eval` scores on GPU and `make export` writes by default."""
    from transformers import AutoTokenizer

    out = Path(out)
    merged_model(adapter_dir, base, load_kwargs).save_pretrained(out)
    AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(out)
    return out


# ---------------------------------------------------------------------------- QLoRA's weight push
def merged_weights(model, fix_name=lambda name: name):
    """(name, tensor) of base + adapter under the base model's names, computed per layer without touching the model:
    an adapted linear layer's weight is its base weight (dequantized when 4-bit) + scale x B·A; the adapters' own
    tensors are skipped. The same tensors TRL's merge-then-read yields for a plain LoRA model (tests check it), but
    a 4-bit base is never re-quantized: TRL 1.16's push merges into the base and unmerges after
    (VLLMGeneration._iter_named_params), which peft does for a 4-bit layer by dequantize, add, re-quantize, so every
    push would move the frozen base by a rounding (peft warns so), and it would read the packed 4-bit tensors. A 4-bit
    layer no adapter targets is dequantized too (its weight is packed uint8 `[N/2, 1]`, not the float `[out, in]`)."""
    import torch
    from peft.tuners.lora import LoraLayer
    from peft.utils.integrations import dequantize_module_weight, get_bnb_param_type

    adapted = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    modules = dict(model.named_modules())
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        owner, _, leaf = name.rpartition(".")
        layer = adapted.get(owner.removesuffix(".base_layer")) if owner.endswith(".base_layer") else None
        clean = fix_name(name.removeprefix("base_model.model.").replace(".base_layer", ""))
        if layer is None or leaf != "weight":
            tensor = param.data
            if get_bnb_param_type(param):  # an unadapted 4-bit layer (LORA_TARGET_MODULES short of all-linear)
                with torch.no_grad():
                    tensor = dequantize_module_weight(modules[owner])
            yield clean, _unpacked(clean, tensor)
            continue
        with torch.no_grad():
            weight = dequantize_module_weight(layer.get_base_layer()).to(torch.float32)
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    weight = weight + layer.get_delta_weight(adapter).to(torch.float32)
        yield clean, weight


def _unpacked(name: str, tensor):
    """Never a packed quantized tensor under a float weight's name: vLLM would size its receive buffers from it and the
    push would hang in the broadcast until the watchdog, whose diagnosis would blame the rendezvous."""
    if not tensor.is_floating_point():
        raise RuntimeError(f"weight push: {name} is a {str(tensor.dtype).removeprefix('torch.')} "
                           f"{list(tensor.shape)} tensor (packed quantized bytes, not weights); set QLORA=false or "
                           f"LORA_TARGET_MODULES=all-linear (edit .env)")
    return tensor


def push_without_merging(trainer) -> bool:
    """QLoRA: every weight push (server mode's NCCL stream and metadata, colocate's load) reads merged_weights instead
    of TRL's merge-then-read. Install before trainer.gpu.push_in_served_dtype (which casts what this yields). Returns
    False when the trainer has no vLLM. PINNED to trl 1.16's `VLLMGeneration._iter_named_params` (the one iterator
    every push reads) and its `_fix_param_name_to_vllm`."""
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not hasattr(gen, "_iter_named_params"):
        return False
    gen._iter_named_params = lambda: merged_weights(gen.model, gen._fix_param_name_to_vllm)
    return True
