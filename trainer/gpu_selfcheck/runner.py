"""Runs the self-checks: one PASS / FAIL / SKIP line each, the time bounds, one GPU pinned."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable

from trainer.gpu_selfcheck import devices, models, push
from trainer.gpu_selfcheck.base import CheckTimeout, Result


CHECKS: dict[str, Callable] = {
    "inventory": devices.check_inventory,
    "master_weights": models.check_master_weights,
    "trainer_loop": models.check_trainer_loop,
    "colocate_budget": models.check_colocate_budget,
    "weight_iterator": push.check_weight_iterator,
    "nccl_sockets": devices.check_nccl_sockets,
    "tree_attention": devices.check_tree_attention,
    "lora_push_order": push.check_lora_push_order,
}
# Per-check time bounds (seconds, on a GPU; 4x on the CPU): together under 12 minutes, the whole command's budget on a
# lent GPU.
BUDGET_S = {"inventory": 30, "master_weights": 60, "trainer_loop": 180, "colocate_budget": 60, "weight_iterator": 60,
            "nccl_sockets": 120, "tree_attention": 60, "lora_push_order": 120}
# What only a GPU shows, printed after a CPU run (the CPU ran each at a tiny size, or a stand-in of it).
NEEDS_GPU = {
    "master_weights": "Qwen3-0.6B's shape in bf16 autocast",
    "trainer_loop": "the 2 GRPO steps on CUDA",
    "colocate_budget": "CUDA memory peaks and the card's own budget",
    "weight_iterator": "vLLM 0.31's packed sender on CUDA streams",
    "nccl_sockets": "NCCL between two processes (gloo ran here)",
    "tree_attention": "bf16 at 4,096 tokens on the fa3/fa2 kernels (fp32 SDPA at 512 ran here)",
    "lora_push_order": "the race between two CUDA side streams (the CPU has none)",
}


@contextlib.contextmanager
def time_bound(seconds: float):
    """Stop a check that runs past its bound (SIGALRM in the main thread)."""
    def expire(signum, frame):
        raise CheckTimeout(f"took longer than its bound of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_check(name: str, device, tiny: bool, bound_s: float) -> Result:
    t0 = time.monotonic()
    try:
        with time_bound(bound_s):
            result = CHECKS[name](device, tiny)
    except Exception as exc:  # noqa: BLE001 - one FAIL line per check, the traceback on stderr
        import traceback

        traceback.print_exc(file=sys.stderr)
        first = str(exc).splitlines()[0] if str(exc) else ""
        result = Result(name, "FAIL", f"{type(exc).__name__}: {first}")
    result.detail += f" [{time.monotonic() - t0:.0f} s]"
    return result


def resolve_device(choice: str):
    """cuda / cpu as asked; auto: cuda when torch sees one, else None (main runs the CPU-possible parts)."""
    import torch

    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise SystemExit("selfcheck: --device cuda, but torch sees no CUDA device (torch "
                             f"{torch.__version__}, built for CUDA {torch.version.cuda}): install a CUDA build of torch "
                             "or check the driver (nvidia-smi)")
        return torch.device("cuda", torch.cuda.current_device())
    return None


def pin_one_gpu(environ=os.environ) -> str | None:
    """Make this process see one GPU (the first CUDA_VISIBLE_DEVICES names, else GPU 0) before CUDA initialises:
    the checks measure one card, and transformers would count every visible GPU into `n_gpu` (nn.DataParallel).
    Returns a note when it narrowed the list; an empty CUDA_VISIBLE_DEVICES (no GPU) stays as it is."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is not None and "," not in value:
        return None
    first = "0" if value is None else value.split(",")[0].strip()
    environ["CUDA_VISIBLE_DEVICES"] = first
    return f"CUDA_VISIBLE_DEVICES={first} (was {'unset' if value is None else value}): the checks run on one GPU"


def main(argv: list[str] | None = None) -> int:
    pinned = pin_one_gpu()  # before torch touches CUDA
    p = argparse.ArgumentParser(prog="python -m trainer.gpu_selfcheck",
                                description="GPU self-check without Docker, vLLM server or the Hub "
                                "(docs/gpu-host.md \"GPU self-check\")")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: CUDA when present, else the CPU at tiny sizes; cpu: the same code at a tiny size")
    p.add_argument("--only", default=None, help=f"comma list of checks to run (of {', '.join(CHECKS)})")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--bound-s", type=float, default=None,
                   help="every check's time bound in seconds (default: per check, 4x on the CPU)")
    args = p.parse_args(argv)
    names = list(CHECKS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"selfcheck: unknown check {', '.join(unknown)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    import torch

    device = resolve_device(args.device)
    if device is None:  # auto on a box without CUDA: the CPU-possible parts, and which need a GPU
        device = torch.device("cpu")
    tiny = device.type == "cpu"
    where = ("CPU, tiny sizes" if tiny else f"{torch.cuda.get_device_name(device)}" if device is not None else "no CUDA")
    print(f"selfcheck: torch {torch.__version__} (CUDA {torch.version.cuda}), {where}"
          + (f"; {pinned}" if pinned else ""), flush=True)
    results = []
    for name in names:
        bound = args.bound_s or BUDGET_S[name] * (4 if tiny else 1)  # a busy CPU box is slower
        result = run_check(name, device, tiny, bound)
        results.append(result)
        print(result.line(), flush=True)
    failed = [r.name for r in results if r.verdict == "FAIL"]
    counts = {v: sum(r.verdict == v for r in results) for v in ("PASS", "FAIL", "SKIP")}
    print(f"selfcheck: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
          + (f" (FAIL: {', '.join(failed)})" if failed else ""), flush=True)
    gpu_only = [f"{r.name}: {NEEDS_GPU[r.name]}" for r in results if tiny and r.name in NEEDS_GPU]
    if gpu_only:
        print("selfcheck: ran on the CPU at tiny sizes; only a GPU checks " + "; ".join(gpu_only), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=2, default=str))
    return 1 if failed else 0
