"""The weight push's path, in one place for training and for the checks that must push the way training does.

Training (ROLLOUTS=sync) pushes what TRL 1.16's `VLLMGeneration._iter_named_params` yields (plain parameters, a LoRA
model merged then unmerged, DeepSpeed-gathered, or FSDP2 `full_tensor()` ones), with the stack's hooks on it: QLoRA's
`lora.merged_weights` (no merge into the 4-bit base) and the cast to the served dtype (`trl_hooks.push_in_served_dtype`).
ROLLOUTS=async streams `AsyncGRPOTrainer._streaming_iter` (FSDP2 `full_tensor()` per parameter) through TRL's
`WeightTransferClient`, manifest and stream cast together (`trl_hooks.async_nccl_push`).

`install` is what the sync trainer calls (trainer.run.grpo_trainer.build_sync_trainer); `generation` and
`async_stream` give `make nccl-check FULL=1` (trainer.sync_check) and `make gpu-selfcheck`'s weight_iterator
(trainer.gpu_selfcheck) TRL's own objects with the same hooks, so a check cannot be green on a path training does not
take. Single-process: TRL's FSDP2/DeepSpeed branches run only under a launcher with several ranks.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, Iterator


def install(trainer: Any, qlora: bool, served_dtype: str | None) -> str | None:
    """The stack's hooks on a trainer's push iterator: QLoRA's merged weights first, then the served-dtype cast (which
    casts what the first yields). Returns the dtype pushes are cast to, or None."""
    from trainer.gpu.trl_hooks import push_in_served_dtype
    from trainer.modeling import lora

    if qlora:  # a 4-bit base must not be re-quantized by a merge at every push (trainer.modeling.lora)
        lora.push_without_merging(trainer)
    else:
        merge_before_push(getattr(trainer, "vllm_generation", None))
    return push_in_served_dtype(trainer, served_dtype)


def merge_before_push(gen: Any) -> bool:
    """A LoRA model's push with the merge complete before any tensor is read, and the unmerge after the last.

    TRL 1.16 merges the adapter lazily, on the first item `_iter_named_params` yields, and unmerges when it is
    exhausted; vLLM's packed sender (packed_tensor.packed_nccl_broadcast_producer) reads that first item on one side
    stream and later chunks on another that never waits for the first, and the last chunk is packed (`torch.cat` of
    views of the parameters) after the generator's unmerge on the same stream. So every sync is bracketed here: the
    merge runs before TRL's iterator is built, the device is synchronized, TRL's own merge and unmerge are no-ops for
    the push, and the unmerge runs once the sender has drained its streams (sync_weights returned). Sharded models
    (FSDP, ZeRO-3) merge inside TRL's gather, so they keep TRL's order with a synchronize after the first item.
    Returns False (nothing done) for a model without an adapter. Idempotent."""
    from accelerate.utils import is_peft_model

    if gen is None or not is_peft_model(getattr(gen, "model", None)):
        return False
    if getattr(gen.sync_weights, "_grpo_merge_ordered", False) or getattr(gen._iter_named_params, "_grpo_synced", False):
        return True
    dist = getattr(gen, "_dist", None)
    if dist is not None and (dist.is_fsdp or dist.is_zero3):
        iterate = gen._iter_named_params

        def synced_after_first():
            items = iterate()
            for i, item in enumerate(items):
                if i == 0:
                    synchronize(item[1].device)  # the merge TRL ran for the first item, complete
                yield item

        synced_after_first._grpo_synced = True  # type: ignore[attr-defined]
        gen._iter_named_params = synced_after_first
        return True
    original = gen.sync_weights

    def sync_weights(*args, **kwargs):
        with merged_for_push(gen.model):
            return original(*args, **kwargs)

    sync_weights._grpo_merge_ordered = True  # type: ignore[attr-defined]
    sync_weights.__wrapped__ = original  # type: ignore[attr-defined]
    gen.sync_weights = sync_weights
    return True


@contextlib.contextmanager
def merged_for_push(model: Any):
    """The adapter merged into the base (complete on the device) for the block, TRL's merge/unmerge calls no-ops in
    it; unmerged after, once the device has finished reading. PINNED to peft's `merge_adapter`/`unmerge_adapter`
    (the tuner's, which TRL 1.16 reaches through the PeftModel)."""
    tuner = model.base_model
    device = next(model.parameters()).device
    tuner.merge_adapter()
    synchronize(device)
    model.merge_adapter = model.unmerge_adapter = lambda *a, **k: None  # TRL's calls inside the push
    try:
        yield
    finally:
        del model.merge_adapter, model.unmerge_adapter
        synchronize(device)  # every stream done reading the merged weights
        tuner.unmerge_adapter()


def synchronize(device: Any) -> None:
    """Wait for every stream of `device` (CUDA); nothing to wait for on the CPU."""
    if getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.synchronize(device)


def generation(model: Any, served_dtype: str | None, qlora: bool = False, client: Any = None):
    """TRL 1.16's VLLMGeneration in server mode, holding only what `sync_weights` and `_iter_named_params` read (the
    model, the accelerator, the distributed backend, the client; no engine), with `install`'s hooks on it. Its
    `sync_weights()` is training's push (metadata, `client.update_named_params`, the prefix-cache reset); its
    `_iter_named_params()` is what that push streams. PINNED to those attributes (trainer/core/trl_privates.py)."""
    from accelerate import Accelerator
    from trl.distributed import DistributedBackend
    from trl.generation.vllm_generation import VLLMGeneration

    gen = object.__new__(VLLMGeneration)
    gen.model, gen.mode, gen.vllm_client = model, "server", client
    gen.enable_sleep_mode, gen._weight_metadata = False, None
    gen.accelerator = Accelerator(cpu=next(model.parameters()).device.type == "cpu")
    gen._dist = DistributedBackend(gen.accelerator)
    install(SimpleNamespace(vllm_generation=gen), qlora, served_dtype)
    return gen


def async_manifest(model: Any) -> dict[str, list]:
    """The manifest TRL 1.16's AsyncGRPOTrainer.__init__ gives its WeightTransferClient (names, dtype names, shapes of
    `_iter_vllm_named_params`), before `trl_hooks.async_nccl_push` casts its dtype names."""
    from trl.experimental.async_grpo.async_grpo_trainer import _iter_vllm_named_params

    params = list(_iter_vllm_named_params(model))
    return {"names": [n for n, _ in params], "dtype_names": [str(p.dtype).split(".")[-1] for _, p in params],
            "shapes": [list(p.shape) for _, p in params]}


def async_stream(model: Any) -> Iterator[tuple[str, Any]]:
    """What ROLLOUTS=async's merged sync hands `send_weights`: TRL 1.16's `AsyncGRPOTrainer._streaming_iter` on a
    stand-in that has only what it reads (the accelerator, the model)."""
    from accelerate import Accelerator
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    holder = SimpleNamespace(model=model, accelerator=Accelerator(cpu=next(model.parameters()).device.type == "cpu"))
    return AsyncGRPOTrainer._streaming_iter(holder)
