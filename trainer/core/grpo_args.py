"""What the trainer process derives from the run's settings (contract.config.RunConfig) with torch and TRL at hand:
TRAIN_MODE=auto resolved from the GPUs this process sees, and the trl.GRPOConfig of a run. The contract below stays
free of ML libraries; these are the two places that need one."""

from __future__ import annotations

import socket
from typing import Any
from urllib.parse import urlparse

from contract.config import RunConfig, train_mode_variant
from contract.train_mode import resolve_train_mode


def resolve(cfg: RunConfig) -> RunConfig:
    """The run's config with TRAIN_MODE=auto resolved, once, by contract.train_mode's rule from what this process sees:
    the GPUs torch counts, and whether the vLLM server's name resolves (imports torch only for auto). Everything after
    reads cfg.placement, the resolved variant."""
    if cfg.placement_known:
        return cfg
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        socket.getaddrinfo(urlparse(cfg.vllm_server_url).hostname, None)
        vllm_service = True
    except OSError:
        vllm_service = False
    return cfg.resolved(train_mode_variant(resolve_train_mode("auto", gpus, vllm_service=vllm_service)[0]))


def grpo_config(cfg: RunConfig, **extra: Any):
    """The run's settings (TRAIN_MODE resolved: resolve above) as trl.GRPOConfig. gpu/colocate: the caller adds
    trainer.gpu's vLLM kwargs in `extra` (this module sits below trainer.gpu and never imports it)."""
    from trl import GRPOConfig

    kwargs: dict[str, Any] = dict(cfg.shared_trainer_kwargs(), steps_per_generation=cfg.effective_steps_per_generation)
    kwargs.update(cfg.off_policy().sync_grpo_kwargs())  # OFF_POLICY_CORRECTION as TRL's fields (contract/config/off_policy.py)
    chosen = cfg.placement
    if not chosen.uses_vllm:
        kwargs.update(use_cpu=True, bf16=False, use_vllm=False)
    elif chosen.trainer_on_cpu:  # server mode rehearsed on CPU: vLLM generates, weights go by reload
        kwargs.update(use_cpu=True, bf16=False)
    else:
        import torch

        # bf16 where the GPU has it (Ampere+); older cards train in fp32 rather than risk fp16 overflow.
        kwargs.update(bf16=bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()))
    kwargs.update(extra)  # gpu/colocate: trainer.gpu.grpo_vllm_kwargs(cfg), passed by the caller (train.py)
    return one_gpu_per_process(GRPOConfig(**kwargs))


def one_gpu_per_process(args):
    """Training arguments that never make HF's Trainer wrap the model in nn.DataParallel. transformers 5.17 sets
    `n_gpu` to every GPU this process sees when no launcher started it (`make gpu-selfcheck` on a multi-GPU box,
    NCCL_FAST_PATH=1's trainer container, which sees vLLM's GPU too); TRL 1.16's GRPOTrainer then refuses to build and
    the async trainer would replicate a model its packed batches do not survive. One process trains on one GPU here
    (cuda:0, the first one CUDA_VISIBLE_DEVICES names); several GPUs mean several processes (trainer/launch.py).
    Transformers itself sets `_n_gpu = 1` the same way for a model split with device_map."""
    if args.n_gpu > 1:
        args._n_gpu = 1
    return args
