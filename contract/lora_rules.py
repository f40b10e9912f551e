"""What vLLM can serve of a run's LoRA settings (LORA_R > 0, LORA_TARGET_MODULES), standard library only:
contract.config validates with it (RunConfig.lora_problem asks `problem` below: which settings cannot work together),
and so does the host's `make doctor` through it. The adapter itself (peft, the 4-bit base, merging) is the trainer's:
trainer.modeling.lora."""

from __future__ import annotations

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


def problem(cfg, mode) -> str | None:
    """One line naming what to change when the LoRA settings of `cfg` (a contract.config.RunConfig) cannot work together
    (None: they can). `mode`: the resolved TRAIN_MODE's variant (contract.config.placement), None while it is still `auto`."""
    if cfg.lora_r > VLLM_MAX_LORA_RANKS[-1]:
        return (f"LORA_R={cfg.lora_r}: vLLM serves adapters up to rank {VLLM_MAX_LORA_RANKS[-1]} "
                f"(--max-lora-rank); set LORA_R to {VLLM_MAX_LORA_RANKS[-1]} or less (edit .env)")
    if not cfg.qlora:
        return None
    if not cfg.lora_r:
        return ("QLORA=true trains adapters on a 4-bit base, but LORA_R=0 asks for full fine-tuning: set LORA_R (e.g. 16) "
                "(edit .env)")
    if cfg.rollouts.is_async:
        return ("QLORA=true with ROLLOUTS=async: the adapter-only sync has vLLM serve the adapter on its "
                "full-precision base while the trainer scores it on the 4-bit one (every importance ratio off), and "
                "TRL's async trainer loads no 4-bit base; set ROLLOUTS=sync (merged weights pushed) or QLORA=false "
                "(edit .env)")
    if mode is not None and mode.trainer_on_cpu:
        return ("QLORA=true needs a GPU (bitsandbytes' 4-bit kernels); the trainer runs on CPU here: set QLORA=false "
                "(LORA_R alone trains adapters on the full-precision base) (edit .env)")
    if mode is not None and mode.colocated:
        return ("QLORA=true with TRAIN_MODE=colocate: TRL then runs the colocated vLLM in 4 bits too (bitsandbytes in "
                "flight), whose layers a weight push cannot refresh (their 4-bit scales stay the old ones); use "
                "TRAIN_MODE=gpu (vLLM serves the merged weights on its own GPU) or QLORA=false (edit .env)")
    if cfg.trainer_sharding == "fsdp":
        return ("QLORA=true with TRAINER_SHARDING=fsdp: each weight push merges the adapter into the whole base "
                "weight, which a 4-bit base sharded by FSDP2 cannot give; use TRAINER_SHARDING=ddp (a 4-bit copy per "
                "GPU) or QLORA=false (edit .env)")
    return None


# ---------------------------------------------------------------------------- ROLLOUTS=async: vLLM serves the adapter
# (`cfg` below: a contract.config.RunConfig; the host's plan and compose file ask, the trainer's lora.py says how)
# vLLM's switch for /v1/load_lora_adapter and /v1/unload_lora_adapter (TRL's async VLLMClient calls them).
VLLM_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}


def syncs_adapter(cfg) -> bool:
    """Whether weight syncs push the adapter alone (and vLLM must serve LoRA): LORA_R with ROLLOUTS=async."""
    return bool(cfg.lora_r) and cfg.rollouts.is_async


def vllm_max_loras(cfg) -> int:
    """--max-loras: MAX_STALENESS + 1 policy versions may be named by requests in flight, and each sync loads the next
    before unloading the oldest (TRL 1.16's select_adapter_sync refuses fewer; vLLM would silently evict one)."""
    return cfg.rollouts.max_staleness + 2


def vllm_lora_flags(cfg) -> list[str]:
    """`vllm serve` flags the run needs beyond compose.yaml's (x-vllm-serve-flags): none unless syncs_adapter."""
    if not syncs_adapter(cfg):
        return []
    return ["--enable-lora", f"--max-lora-rank={served_max_lora_rank(cfg.lora_r)}",
            f"--max-loras={vllm_max_loras(cfg)}"]


def serving_problem(cfg, vllm_data_parallel: int) -> str | None:
    """One line when the vllm service's layout cannot serve the adapter sync (the host's plan asks; None: it can)."""
    if syncs_adapter(cfg) and vllm_data_parallel > 1:
        return (f"LORA_R with ROLLOUTS=async and vLLM data parallel ({vllm_data_parallel} copies): /v1/load_lora_adapter "
                "loads the adapter into the one copy that answered, so the others would serve the base (TRL 1.16 then "
                "falls back to merged weights over NCCL); set VLLM_PARALLEL=tensor, or ROLLOUTS=sync (edit .env)")
    return None
