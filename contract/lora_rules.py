"""The rules a run's LoRA and QLoRA settings (LORA_R > 0, QLORA) must meet: what vLLM can serve, and which settings
cannot work together (standard library only: contract.config validates with them, and the host's `make doctor` through
it). The adapter itself (peft, the 4-bit base, merging) is the trainer's: trainer.run.lora."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from contract.config import RunConfig

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head
# vLLM 0.31's --max-lora-rank choices (vllm/config/lora.py MaxLoRARanks): an adapter of rank r is served under the
# smallest one >= r; above the largest, vLLM cannot serve it.
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Layers that are not linear layers of the decoder: vLLM serves adapters on linear layers only (vllm/lora/utils.py
# get_supported_lora_modules), and the default leaves the embeddings and the head alone on purpose.
NOT_ADAPTABLE = ("embed_tokens", "lm_head", "wte", "embed_out", "norm", "rotary_emb")


def parse_target_modules(value: str) -> list[str]:
    """LORA_TARGET_MODULES as a list; raises ValueError (one line) for a layer vLLM could not serve an adapter on."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise ValueError(f"empty; write `{ALL_LINEAR}` or layer names like `q_proj,v_proj` (edit .env)")
    if ALL_LINEAR in names and len(names) > 1:
        raise ValueError(f"`{ALL_LINEAR}` already takes every linear layer of the decoder; list names only without "
                         "it (edit .env)")
    bad = [n for n in names if any(part in n.lower() for part in NOT_ADAPTABLE)]
    if bad:
        raise ValueError(f"{', '.join(bad)} is not a linear layer of the decoder: vLLM serves adapters on linear "
                         f"layers only, and the embeddings and the head stay frozen; use `{ALL_LINEAR}` or names like "
                         "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj (edit .env)")
    return names


def served_max_lora_rank(rank: int) -> int:
    """vLLM's --max-lora-rank for adapters of `rank`: the smallest choice it accepts that holds them."""
    return next(r for r in VLLM_MAX_LORA_RANKS if r >= rank)


def adapter_problem(cfg: "RunConfig", mode: str | None) -> str | None:
    """One line naming what to change when the LoRA settings cannot work together (None: they can). `mode`: the
    resolved TRAIN_MODE, or None while it is still `auto` (train.py asks again once it is resolved)."""
    if cfg.lora_r and cfg.rollouts == "async":
        return ("LORA_R with ROLLOUTS=async: the adapter-only weight sync into vLLM (--enable-lora) is not built yet; "
                "set ROLLOUTS=sync (TRL merges the adapter and pushes merged weights) or LORA_R=0 (edit .env)")
    if cfg.lora_r > VLLM_MAX_LORA_RANKS[-1]:
        return (f"LORA_R={cfg.lora_r}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]} (--max-lora-rank); "
                f"set LORA_R to {VLLM_MAX_LORA_RANKS[-1]} or less (edit .env)")
    if not cfg.qlora:
        return None
    if not cfg.lora_r:
        return "QLORA=true trains adapters on a 4-bit base, but LORA_R=0 asks for full fine-tuning: set LORA_R (e.g. 16) (edit .env)"
    if mode == "cpu" or (mode == "gpu" and cfg.weight_transfer == "reload"):
        return ("QLORA=true needs a GPU (bitsandbytes' 4-bit kernels); the trainer runs on CPU here: set QLORA=false "
                "(LORA_R alone trains adapters on the full-precision base) (edit .env)")
    if mode == "colocate":
        return ("QLORA=true with TRAIN_MODE=colocate: TRL then runs the colocated vLLM in 4 bits too (bitsandbytes in "
                "flight), whose layers a weight push cannot refresh (their 4-bit scales stay the old ones); use "
                "TRAIN_MODE=gpu (vLLM serves the merged weights on its own GPU) or QLORA=false (edit .env)")
    if cfg.trainer_sharding == "fsdp":
        return ("QLORA=true with TRAINER_SHARDING=fsdp: each weight push merges the adapter into the whole base "
                "weight, which a 4-bit base sharded by FSDP2 cannot give; use TRAINER_SHARDING=ddp (a 4-bit copy per "
                "GPU) or QLORA=false (edit .env)")
    return None


def describe(cfg: "RunConfig") -> str:
    """One line for the log and the model card."""
    if not cfg.lora_r:
        return "full fine-tuning (every weight trained)"
    base = "4-bit NF4 base (QLoRA)" if cfg.qlora else "frozen base"
    return (f"LoRA r={cfg.lora_r}, alpha={cfg.resolved_lora_alpha:g}, dropout={cfg.lora_dropout:g}, "
            f"target modules {cfg.lora_target_modules}, on a {base}")
