"""The model and tokenizer a run trains (fp32 master weights; QLoRA's 4-bit base), and what is read off the model
without loading its weights (its published dtype, its generation config)."""

from __future__ import annotations

from contract.config import RunConfig


def published_dtype(cfg: RunConfig) -> str | None:
    """The dtype the base model is published in (its config.json), for run.json: checkpoints hold the fp32 master
    weights, `make export` writes them back in this dtype."""
    from transformers import AutoConfig

    try:
        dtype = AutoConfig.from_pretrained(cfg.model_path, **cfg.model_load_kwargs).dtype
    except (OSError, ValueError):  # no readable config: the export then keeps the checkpoint's dtype
        return None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def load_model_and_tokenizer(cfg: RunConfig):
    tokenizer = load_tokenizer(cfg)
    return load_model(cfg, cfg.model_path, **cfg.model_load_kwargs), tokenizer


def load_model(cfg: RunConfig, name: str, **load_kwargs):
    """The weights a run trains, as training holds them (also `make nccl-check FULL=1`'s, which pushes them)."""
    import torch
    from transformers import AutoModelForCausalLM

    # fp32 master weights in every layout; GRPOConfig(bf16=True) runs the forward and backward under bf16 autocast.
    # bf16 weights would not train: at lr 1e-5 an AdamW step rounds back to the same bf16 value for any |w| above
    # ~0.004 (norm weights, most matrix entries). Pushes to vLLM are cast to its dtype (gpu.push_in_served_dtype).
    # QLoRA: the frozen base in 4 bits (bf16 for what stays unquantized); the adapters train in fp32 (TRL casts them to
    # bf16; lora.keep_adapters_fp32 casts them back before the optimizer exists).
    from trainer.modeling import lora

    dtype = torch.bfloat16 if cfg.qlora else torch.float32
    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **load_kwargs, **lora.quantization_kwargs(cfg))


def attention_line(model) -> str:
    """Which attention the sync trainer's forwards run: transformers' implementation as it loaded the model (sdpa
    unless the model or its config asks for another). ROLLOUTS=async logs its tree attention backend instead."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    return f"attention: {impl} (transformers' attn_implementation for {type(model).__name__})"


def load_tokenizer(cfg: RunConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path, **cfg.model_load_kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    from envs.core.untrusted import register_tokenizer

    register_tokenizer(tokenizer)  # never forged by an env's text
    return tokenizer


def generation_config_of(cfg: RunConfig):
    """What stop_token_ids reads off a model (its generation config), without loading the weights (async: TRL
    loads the model itself)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(cfg.model_path, **cfg.model_load_kwargs)
    except OSError:  # no generation_config.json: the tokenizer's eos and pad only
        config = None
    return SimpleNamespace(generation_config=config)
