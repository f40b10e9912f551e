"""GPU self-check without Docker, vLLM server or the Hub: `python -m trainer.gpu_selfcheck` (`make gpu-selfcheck`).

Checks the trainer's CUDA path in a plain Python environment (torch, trl, transformers, peft, accelerate, datasets,
openenv; docs/gpu-host.md "GPU self-check"), one line each, `PASS` / `FAIL` / `SKIP (why)` with its figures, in one
command under 12 minutes on a GPU:

  inventory        torch, CUDA, NCCL versions; which of transformers/trl/peft/accelerate/datasets/bitsandbytes/
                   flash_attn/kernels import (devices.py)
  master_weights   a model of Qwen3-0.6B's shape, random init, 3 AdamW steps at lr 1e-5, with bf16 and with fp32
                   master weights: the fraction of elements each step changed, per parameter group (models.py)
  trainer_loop     the project's trainer class and rollout loop (trainer.run.grpo_trainer.make_trainer_class), 2 GRPO
                   steps against the echo env server on 127.0.0.1, generation by transformers: memory peak, step time
  colocate_budget  Qwen3-0.6B's shape at the default batch and lengths, gradient checkpointing as training sets it:
                   memory peak after forward, backward and the optimizer step, and what is left for vLLM on 24, 48, 80
                   and 141 GB cards
  weight_iterator  (vLLM importable) training's push iterator (trainer.gpu.push_path: TRL's, fp32 weights cast to
                   bf16) through vLLM's packed producer and consumer over a loopback: bytes identical, tied
                   embeddings sent once, exactly the checkpoint's names (push.py)
  nccl_sockets     two processes on the one GPU, NCCL over TCP sockets on the loopback (each rank its own
                   NCCL_HOSTID, P2P/SHM/IB off): a 1 GiB broadcast's GB/s, the bytes checked
  tree_attention   the async path's tree attention (trainer/async_grpo/tree_attention.py) against dense causal
                   attention in bf16 at 4,096 tokens, forward and backward: errors, NaNs, peak memory
  lora_push_order  a LoRA push through training's hooks (the merge complete before any read) and a torch-only copy of
                   vLLM's two-stream packing loop, 20 times, byte for byte against a default-stream reference

Without CUDA (or with `--device cpu`) the same code runs on the CPU at tiny sizes, stand-ins where a part needs a GPU
(gloo for NCCL, fp32 SDPA for the bf16 kernels, no side streams), and a last line names what only a GPU checks. The
process pins itself to one GPU first (pin_one_gpu), whatever the box has. Exit code 0 when nothing FAILed, 1 otherwise.
"""

from trainer.gpu_selfcheck.base import GB, CheckTimeout, Result, autocast, param_group, qwen3_config
from trainer.gpu_selfcheck.models import (ADAM_STEPS, CARDS_GB, LR, MIN_FP32_CHANGED, PROMPT_TOKENS,
                                          check_colocate_budget, check_master_weights, check_trainer_loop,
                                          colocate_fits, training_args)
from trainer.gpu_selfcheck.push import (SERVED_DTYPE, LoopbackGroup, check_lora_push_order, check_weight_iterator,
                                        trl_weight_iterator, two_stream_producer)
from trainer.gpu_selfcheck.runner import BUDGET_S, CHECKS, NEEDS_GPU, main, pin_one_gpu, resolve_device

__all__ = ["ADAM_STEPS", "BUDGET_S", "CARDS_GB", "CHECKS", "GB", "LR", "MIN_FP32_CHANGED", "NEEDS_GPU", "PROMPT_TOKENS",
           "SERVED_DTYPE", "CheckTimeout", "LoopbackGroup", "Result", "autocast", "check_colocate_budget",
           "check_lora_push_order", "check_master_weights", "check_trainer_loop", "check_weight_iterator",
           "colocate_fits", "main", "param_group", "pin_one_gpu", "qwen3_config", "resolve_device", "training_args",
           "trl_weight_iterator", "two_stream_producer"]
