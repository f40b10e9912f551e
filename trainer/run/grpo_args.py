"""What the trainer process derives from the run's settings (contract.config.RunConfig) with torch and TRL at hand:
TRAIN_MODE=auto resolved from the GPUs this process sees, and the trl.GRPOConfig of a run. The contract below stays
free of ML libraries; these are the two places that need one."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

from contract.config import RunConfig
from contract.train_mode import resolve_train_mode


def resolved_train_mode(cfg: RunConfig) -> str:
    """TRAIN_MODE with `auto` resolved by contract.train_mode's rule from what this process sees: the GPUs torch counts,
    and whether the vLLM server's name resolves. Imports torch only for auto."""
    if cfg.train_mode != "auto":
        return cfg.train_mode
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        socket.getaddrinfo(urlparse(cfg.vllm_server_url).hostname, None)
        vllm_service = True
    except OSError:
        vllm_service = False
    return resolve_train_mode("auto", gpus, vllm_service=vllm_service)[0]


def grpo_config(cfg: RunConfig, mode: str | None = None, **extra: Any):
    """The run's settings as trl.GRPOConfig. gpu/colocate: the caller adds trainer.gpu's vLLM kwargs in `extra` (this
    module sits below trainer.gpu and never imports it)."""
    from trl import GRPOConfig

    mode = mode or resolved_train_mode(cfg)
    kwargs: dict[str, Any] = dict(cfg.shared_trainer_kwargs(mode), steps_per_generation=cfg.effective_steps_per_generation)
    if mode == "cpu":
        kwargs.update(use_cpu=True, bf16=False, use_vllm=False)
    elif cfg.trainer_on_cpu(mode):  # server mode rehearsed on CPU: vLLM generates, weights go by reload
        kwargs.update(use_cpu=True, bf16=False)
    else:
        import torch

        # bf16 where the GPU has it (Ampere+); older cards train in fp32 rather than risk fp16 overflow.
        kwargs.update(bf16=bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()))
    kwargs.update(extra)  # gpu/colocate: trainer.gpu.grpo_vllm_kwargs(cfg), passed by the caller (train.py)
    return GRPOConfig(**kwargs)
