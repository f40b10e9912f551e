"""The device's side of the self-check: what is installed (`inventory`), NCCL between two processes on one GPU over
sockets (`nccl_sockets`: the closest one GPU gets to the two containers' weight push), and the async path's tree
attention against a dense causal reference (`tree_attention`). On the CPU (`--device cpu`) the last two run their
harness at a small size (gloo instead of NCCL, fp32 SDPA instead of bf16 kernels); their real form needs a GPU."""

from __future__ import annotations

import importlib
import os
import socket
import time

from trainer.gpu_selfcheck.base import GB, Result

GIB = 1 << 30
LIBRARIES = ("transformers", "trl", "peft", "accelerate", "datasets", "bitsandbytes", "flash_attn", "kernels")
NEEDED = ("transformers", "trl", "peft", "accelerate", "datasets")  # the trainer's; the others are per feature
# NCCL as the two containers run it on a bridge network (compose.yaml), each rank its own host to NCCL
NCCL_SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                    "NCCL_SOCKET_IFNAME": "lo"}


# ---------------------------------------------------------------------------- inventory
def library_versions() -> dict[str, str | None]:
    """Each library's version, or None when it does not import (the exception's first line is not kept: the line
    says which are missing, the traceback would be noise)."""
    found: dict[str, str | None] = {}
    for name in LIBRARIES:
        try:
            module = importlib.import_module(name)
            found[name] = str(getattr(module, "__version__", "?"))
        except Exception:  # noqa: BLE001 - ImportError, or a build that fails to load (a CUDA mismatch)
            found[name] = None
    return found


def check_inventory(device, tiny: bool) -> Result:
    import torch

    nccl = None
    if torch.cuda.is_available() and hasattr(torch.cuda, "nccl"):
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a torch built without NCCL
            nccl = None
    libs = library_versions()
    missing = [n for n in NEEDED if libs[n] is None]
    shown = ", ".join(f"{n} {v}" if v else f"{n} -" for n, v in libs.items())
    detail = (f"torch {torch.__version__}, CUDA {torch.version.cuda or '- (CPU build)'}, NCCL {nccl or '-'}; {shown}"
              " (- : does not import)")
    if missing:
        detail += f"; the trainer needs {', '.join(missing)} (docs/gpu-host.md \"GPU self-check\")"
    return Result("inventory", "FAIL" if missing else "PASS", detail, {"nccl": nccl, "libraries": libs})


# ---------------------------------------------------------------------------- NCCL over sockets
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast_rank(rank: int, port: int, backend: str, size: int, rounds: int, out) -> None:
    """One rank: join the group over 127.0.0.1, broadcast `size` bytes from rank 0 `rounds` times, check the bytes."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        os.environ.update(NCCL_SOCKETS_ENV, NCCL_HOSTID=f"selfcheck-rank{rank}")  # two hosts to NCCL, one GPU
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        pattern = (torch.arange(size, device=device, dtype=torch.int64) % 251).to(torch.uint8)
        data = pattern.clone() if rank == 0 else torch.zeros(size, dtype=torch.uint8, device=device)
        dist.broadcast(data[:1024], src=0)  # the connection, off the clock
        seconds = []
        for _ in range(rounds):
            if rank:
                data.zero_()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            dist.broadcast(data, src=0)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - t0)
        same = bool(torch.equal(data, pattern))
        dist.destroy_process_group()
        out.put((rank, same, seconds, None))
    except Exception as exc:  # noqa: BLE001 - reported by the parent, one line
        out.put((rank, False, [], f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))


def check_nccl_sockets(device, tiny: bool) -> Result:
    """Two processes on this GPU, NCCL over TCP sockets on the loopback (each its own NCCL_HOSTID, P2P/SHM/IB off):
    1 GiB broadcasts, GB/s and the bytes checked. `--device cpu`: the same harness over gloo, 64 MiB."""
    import torch.multiprocessing as mp

    backend, size, rounds = ("gloo", 64 << 20, 2) if device.type == "cpu" else ("nccl", GIB, 3)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_broadcast_rank, args=(r, port, backend, size, rounds, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, same, seconds, error = out.get(timeout=150)
            results[rank] = (same, seconds, error)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [f"rank {r}: {e}" for r, (_, _, e) in sorted(results.items()) if e]
    if errors:
        return Result("nccl_sockets", "FAIL", f"{backend} over 127.0.0.1: " + "; ".join(errors))
    best = min(results[1][1])
    rate = size / best / GB
    what = (f"NCCL over sockets on lo, 2 processes on one GPU (NCCL_HOSTID per rank, P2P/SHM/IB off)"
            if backend == "nccl" else "gloo over 127.0.0.1 (CPU stand-in: the NCCL run needs a GPU)")
    ok = results[1][0]
    detail = (f"{what}: {size / GIB:g} GiB broadcast x{rounds}, best {best:.2f} s = {rate:.2f} GB/s; bytes on rank 1 "
              f"{'identical' if ok else 'DIFFER'}")
    return Result("nccl_sockets", "PASS" if ok else "FAIL", detail,
                  {"backend": backend, "bytes": size, "seconds": results[1][1], "gb_s": rate})


# ---------------------------------------------------------------------------- tree attention
def tree_case(prefix: int, branch: int, device):
    """A prefix shared by two branches, packed as TRL packs a tree (trainer/async_grpo/tree_attention.py): segments
    [prefix, branch 1, branch 2], each branch's path = the prefix's positions, then its own."""
    import torch

    p, b = prefix, branch
    kv_index = torch.cat([torch.arange(p), torch.arange(p), torch.arange(p, p + b), torch.arange(p),
                          torch.arange(p + b, p + 2 * b)]).to(device)
    cu_q = torch.tensor([0, p, p + b, p + 2 * b], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, p, 2 * p + b, 3 * p + 2 * b], dtype=torch.int32, device=device)
    return kv_index, cu_q, cu_k


def dense_reference(q, k, v, prefix: int, branch: int):
    """Dense causal attention in fp32 over each root-to-leaf path (prefix + branch), laid out as the packed row."""
    import torch
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    p, b = prefix, branch
    outs = []
    for lo in (p, p + b):
        idx = torch.cat([torch.arange(p), torch.arange(lo, lo + b)]).to(q.device)
        out = F.scaled_dot_product_attention(q[:, :, idx].float(), k[:, :, idx].float(), v[:, :, idx].float(),
                                             is_causal=True)
        outs.append(out)
    packed = torch.cat([outs[0][:, :, :p], outs[0][:, :, p:], outs[1][:, :, p:]], dim=2)
    return packed.transpose(1, 2)  # (1, N, H, D), as the tree function returns


def check_tree_attention(device, tiny: bool) -> Result:
    """The async path's tree attention (the backend this host picks: fa3 / fa2 / sdpa) against dense causal attention
    on each path, in bf16 at 4,096 packed tokens (Qwen3-0.6B's heads), forward and backward: errors, NaNs, peak
    memory. `--device cpu`: fp32 at 512 tokens on SDPA (the bf16 kernels need a GPU)."""
    import torch

    from trainer.async_grpo import tree_attention as tree

    cuda = device.type == "cuda"
    try:
        backend = tree.install()  # what the async trainer does: the fastest backend this host runs offline
    except Exception:  # noqa: BLE001 - trl's async package not importable here: the same choice, no registration
        backend = tree.choose_backend()[0]
        tree._state["backend"] = backend
    prefix, branch = (2048, 1024) if cuda else (256, 128)
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = (16, 8, 128) if cuda else (4, 2, 32)
    n = prefix + 2 * branch
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, h, n, dim, generator=gen).to(device, dtype).requires_grad_()
               for h in (heads, kv_heads, kv_heads))
    kv_index, cu_q, cu_k = tree_case(prefix, branch, device)
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    out, _ = tree.tree_attention(torch.nn.Module(), q, k, v, None, tree_kv_index=kv_index, tree_cu_seqlens_q=cu_q,
                                 tree_cu_seqlens_k=cu_k, tree_max_seqlen_q=prefix, tree_max_seqlen_k=prefix + branch,
                                 scaling=dim ** -0.5)
    seed = torch.randn(out.shape, generator=gen).to(device, dtype)
    (out.float() * seed.float()).sum().backward()
    peak = torch.cuda.max_memory_allocated() / GB if cuda else None
    grads = [t.grad.detach().float() for t in (q, k, v)]
    rq, rk, rv = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = dense_reference(rq, rk, rv, prefix, branch)
    (ref * seed.float()).sum().backward()

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm().clamp_min(1e-12))

    errors = {"out": rel(out.detach().float(), ref.detach()),
              **{f"d{name}": rel(g, r.grad) for name, g, r in zip("qkv", grads, (rq, rk, rv))}}
    nans = sum(int(torch.isnan(t).any()) for t in (out.detach(), *grads))
    bound = 5e-2 if dtype == torch.bfloat16 else 1e-4  # bf16 keeps 8 bits of mantissa: ~4e-3 per op, more in grads
    worst = max(errors.values())
    ok = nans == 0 and worst <= bound
    mem = f"peak {peak:.2f} GB" if peak is not None else "peak n/a on CPU"
    what = f"{str(dtype).removeprefix('torch.')}, {n:,} packed tokens (prefix {prefix:,} + 2 branches of {branch:,})"
    detail = (f"backend {backend}, {what}, {heads}/{kv_heads} heads x {dim}: relative error vs dense causal "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()) + f" (bound {bound:g}); NaNs {nans}; {mem}")
    if not cuda:
        detail += " (CPU stand-in: bf16 at 4,096 tokens on fa3/fa2 needs a GPU)"
    return Result("tree_attention", "PASS" if ok else "FAIL", detail,
                  {"backend": backend, "errors": errors, "nans": nans, "peak_gb": peak, "tokens": n})
