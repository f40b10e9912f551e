"""Which trainer process this is, when several run (trainer/launch.py starts them through accelerate,
which sets RANK / WORLD_SIZE). Rank 0 does what must happen once: the run folder, preflight, logs,
metrics, checkpoints; the others wait for its verdict."""

from __future__ import annotations

import os
from typing import Any


def rank() -> int:
    return int(os.environ.get("RANK", "0") or 0)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def is_main() -> bool:
    return rank() == 0


def log(msg: str) -> None:
    """A line of the run's log, once per run: on the main process when several train."""
    if is_main():
        print(f"[train] {msg}", flush=True)


def init(on_cpu: bool) -> None:
    """Start the process group the way HF's Trainer will use it (accelerate's shared state: gloo when the trainer
    runs on CPU, NCCL on GPUs), early, so rank 0 can hand its decisions to the others."""
    if world_size() > 1:
        from accelerate import PartialState

        PartialState(cpu=on_cpu)


def from_main(value: Any) -> Any:
    """Rank 0's `value` on every process (the others pass a placeholder)."""
    if world_size() == 1:
        return value
    import torch.distributed as torch_dist

    box = [value if is_main() else None]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def any_rank(flag: bool, device) -> bool:
    """True on every process when `flag` is true on any (one collective; every process must call it)."""
    if world_size() == 1:
        return flag
    import torch
    import torch.distributed as torch_dist

    box = torch.tensor([1 if flag else 0], device=device)
    torch_dist.all_reduce(box, op=torch_dist.ReduceOp.MAX)
    return bool(box.item())
