"""TRAIN_MODE=colocate's vLLM engine (TRL 1.16 builds `vllm.LLM` inside the trainer, in VLLMGeneration's set-up):
VLLM_EXTRA_ARGS mapped onto it (contract/vllm_flags.py: engine arguments, or the GRPOConfig fields TRL reads for the
ones it passes from its config), and which scheduler it runs."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from contract import vllm_flags

if TYPE_CHECKING:
    from contract.config import RunConfig

logger = logging.getLogger("trainer.gpu")


def extra_flags(cfg: "RunConfig") -> tuple[dict[str, Any], dict[str, Any]]:
    """(engine kwargs, GRPOConfig kwargs) from VLLM_EXTRA_ARGS; ValueError (one line) for a flag that cannot map."""
    return vllm_flags.engine_kwargs(vllm_flags.parse(cfg.vllm_extra_args))


def install_engine_args(engine: dict[str, Any]) -> bool:
    """Make TRL's colocated `LLM(...)` also get `engine` (what TRL itself passes wins nothing: vllm_flags refuses
    those flags). PINNED to trl 1.16 calling the module-level name `LLM` in trl/generation/vllm_generation.py.
    Idempotent; {} restores TRL's own. False when vLLM does not import here (preflight says so)."""
    from trl.generation import vllm_generation

    current = getattr(vllm_generation, "LLM", None)
    if current is None:
        return False
    original = getattr(current, "_grpo_original", current)
    if not engine:
        vllm_generation.LLM = original
        return True

    def build(*args, **kwargs):
        logger.info("colocated vLLM engine: VLLM_EXTRA_ARGS adds %s", engine)
        return original(*args, **{**kwargs, **engine})

    build._grpo_original = original  # type: ignore[attr-defined]
    vllm_generation.LLM = build
    return True


def scheduler(gen: Any) -> bool | None:
    """Whether TRL's colocated engine runs vLLM's async scheduler (its vllm_config.scheduler_config), None if unknown."""
    engine = getattr(getattr(gen, "llm", None), "llm_engine", None)
    config = getattr(getattr(engine, "vllm_config", None), "scheduler_config", None)
    value = getattr(config, "async_scheduling", None)
    return None if value is None else bool(value)
