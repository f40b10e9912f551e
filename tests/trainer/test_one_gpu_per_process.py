"""A trainer process that sees two or more GPUs and no launcher (`make gpu-selfcheck` on a multi-GPU box,
NCCL_FAST_PATH=1's trainer container, which sees vLLM's GPU too): transformers 5.17 counts every visible GPU into
`n_gpu`, TRL 1.16's GRPOTrainer then refuses to build (nn.DataParallel) and HF's Trainer would wrap the async trainer's
model in nn.DataParallel. Faked on the CPU at the torch layer: `torch.cuda.device_count()` says 2, transformers'
own device setup runs unchanged (its CUDA branch sets `n_gpu` from the count; the device stays the CPU here)."""

from __future__ import annotations

import os

import pytest

from contract.config import CpuMode, GpuMode, RunConfig
from trainer.core import grpo_args


@pytest.fixture
def sees_two_gpus(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_transformers_alone_counts_both_gpus_into_n_gpu(sees_two_gpus, tmp_path):
    """The fake reproduces the issue: plain GRPOConfig (no one_gpu_per_process) on a box that sees 2 GPUs."""
    from trl import GRPOConfig

    assert GRPOConfig(output_dir=str(tmp_path), bf16=False, use_vllm=False).n_gpu == 2


def test_the_sync_trainer_builds_on_one_gpu_when_the_process_sees_two(sees_two_gpus, tmp_path, tiny_model_dir,
                                                                      echo_server):
    from envs import registry
    from trainer.rollouts.envs_binding import build_factories
    from trainer.run.dataset import build_dataset
    from trainer.run.grpo_trainer import make_trainer_class
    from trainer.core.metrics import STATS
    from trainer.modeling.model import load_model_and_tokenizer

    cfg = RunConfig.load(["--train-mode", "cpu", "--model-name", str(tiny_model_dir), "--env-name", "echo",
                          "--env-urls", f"echo={echo_server.url}", "--output-dir", str(tmp_path)])
    args = grpo_args.grpo_config(cfg.resolved(CpuMode()), use_cpu=False)  # transformers' GPU branch, as on a GPU box
    assert args.n_gpu == 1 and args.train_batch_size == args.per_device_train_batch_size
    model, tokenizer = load_model_and_tokenizer(cfg.resolved(CpuMode()))
    specs = {"echo": registry.get("echo")}
    trainer = make_trainer_class()(model=model, args=args, train_dataset=build_dataset(cfg, specs),
                                   processing_class=tokenizer, environment_factory=build_factories(cfg, specs, STATS))
    assert trainer.args.n_gpu == 1


def test_the_async_trainer_is_never_given_more_than_one_gpu(sees_two_gpus):
    """HF's Trainer wraps the model in nn.DataParallel exactly when args.n_gpu > 1 (Trainer._wrap_model)."""
    from trainer.async_grpo.async_trainer import build_async_config

    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="nccl")
    args = build_async_config(cfg.resolved(GpuMode()))
    assert not args.use_cpu and args.n_gpu == 1


@pytest.mark.parametrize("visible, pinned", [(None, "0"), ("3,1", "3"), ("GPU-aa,GPU-bb", "GPU-aa"), ("2", "2"),
                                             ("", "")])
def test_the_selfcheck_pins_itself_to_one_gpu_before_cuda_starts(monkeypatch, visible, pinned):
    from trainer import gpu_selfcheck as selfcheck

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert selfcheck.main(["--only", "no_such_check"]) == 2  # pinned first, before the arguments are even checked
    assert os.environ["CUDA_VISIBLE_DEVICES"] == pinned
