"""Tree attention for TRL 1.16's async GRPO trainer that runs where the stack runs: offline, any GPU, a CPU.

`trl.experimental.async_grpo` packs a rank's samples into a prefix tree (`packing.TreeRow.pack`) and loads the
model with `attn_implementation="tree_fa3"`, whose function fetches FlashAttention-3 from the Hub on first use
(`kernels.get_kernel("kernels-community/flash-attn3")`): Hopper only, online only, no CPU. `install()` registers
this module's function under the same name and makes the trainer's `register_tree_attention()` (called in its
`__init__`) register it again instead of TRL's, so TRL's kernel fetch never runs.

What TRL hands the attention function (read from packing.py, pinned in trainer/core/trl_privates.py):
the packed row's N tokens laid out as S contiguous segments; `tree_kv_index` lists, segment after segment, the
packed positions of that segment's root-to-segment path (its ancestors, then its own tokens); `tree_cu_seqlens_q`
/ `_k` are the segment and path boundaries. TRL's kernel call is a varlen FlashAttention over the gathered K/V
with `causal=True`, which aligns the causal diagonal bottom-right: query j of a segment of length Lq sees the
first Lk - Lq + j + 1 entries of its path of length Lk. The same rule as a boolean mask over the packed row is
`tree_mask` below.

Backends, chosen once at `install()` by what is there (one log line says which):
- `fa3`: TRL's own kernel, only on a Hopper GPU when `kernels` finds it in the local cache (baked into the GPU
  image, see services/trainer/Dockerfile); it is called exactly as TRL calls it.
- `fa2`: `flash_attn.flash_attn_varlen_func` (FlashAttention-2 >= 2.1 also aligns causal bottom-right), on CUDA.
- `sdpa`: PyTorch scaled_dot_product_attention with `tree_mask` (eager softmax when the model uses a softcap).
A call the chosen kernel cannot take (CPU tensors, fp32 without autocast) runs on `sdpa`, logged once.
"""

from __future__ import annotations

import os
import sys
import threading
from functools import cache

import torch

TREE_ATTENTION = "tree_fa3"  # the name TRL loads the model with (packing.TREE_ATTENTION; the test checks they agree)
FA3_REPO, FA3_VERSION = "kernels-community/flash-attn3", 1  # what trl's packing._flash_attn fetches (CUDA)

_state = {"backend": None, "fell_back": False}
_mask_cache = threading.local()


def log(msg: str) -> None:
    print(f"[tree-attention] {msg}", file=sys.stderr, flush=True)


def tree_mask(kv_index: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, n: int,
              sliding_window: int | None = None) -> torch.Tensor:
    """(n, n) boolean mask over the packed row: True where a query position may attend to a key position.
    Per segment: its queries see their path's keys under a bottom-right causal diagonal (varlen FlashAttention's
    `causal=True`), and within `sliding_window` path steps when the model has one."""
    mask = torch.zeros(n, n, dtype=torch.bool, device=kv_index.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        lq, lk = q1 - q0, k1 - k0
        q_depth = torch.arange(lk - lq, lk, device=mask.device)[:, None]  # a query's place on its path
        k_depth = torch.arange(lk, device=mask.device)[None, :]
        allowed = k_depth <= q_depth
        if sliding_window:
            allowed &= q_depth - k_depth < sliding_window  # FlashAttention's window_size=(sliding_window - 1, 0)
        mask[q0:q1, kv_index[k0:k1]] = allowed
    return mask


def _cached_mask(kv_index, cu_q, cu_k, n, sliding_window, device) -> torch.Tensor:
    """Every layer of one forward gets the same index tensors: build the mask once per forward. The cache holds the
    tensors themselves, so an identity match cannot be a recycled id."""
    last = getattr(_mask_cache, "entry", None)
    if last is not None and last[0] is kv_index and last[1] is cu_q and last[2] is cu_k and last[3:5] == (
            n, sliding_window) and last[5].device == device:
        return last[5]
    mask = tree_mask(kv_index.to(device), cu_q, cu_k, n, sliding_window)
    _mask_cache.entry = (kv_index, cu_q, cu_k, n, sliding_window, mask)
    return mask


def sdpa_tree_attention(query, key, value, *, tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, scaling=None,
                        sliding_window=None, softcap=None):
    """query (1, H, N, D), key/value (1, H_kv, N, D) -> (1, N, H, D), as transformers' attention functions return."""
    n = query.shape[2]
    mask = _cached_mask(tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k, n, sliding_window, query.device)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each K/V head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if softcap:  # SDPA has no logit softcap: the same attention written out
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype), value)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


def _varlen_tree_attention(varlen, module, query, key, value, *, tree_kv_index, tree_cu_seqlens_q,
                           tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling, sliding_window,
                           softcap):
    """TRL's call (packing.tree_attention) with `varlen` as the kernel's flash_attn_varlen_func."""
    from transformers.integrations.flash_attention import get_target_dtype

    dtype = get_target_dtype(query, module) or query.dtype
    query, key, value = (x.transpose(1, 2)[0].to(dtype) for x in (query, key, value))
    out = varlen(
        query, key.index_select(0, tree_kv_index), value.index_select(0, tree_kv_index),
        tree_cu_seqlens_q, tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k,
        softmax_scale=scaling, causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window else (-1, -1),
        **({"softcap": softcap} if softcap else {}),
    )
    out = out[0] if isinstance(out, tuple) else out
    return out.unsqueeze(0)


def tree_attention(module, query, key, value, attention_mask, *, tree_kv_index, tree_cu_seqlens_q,
                   tree_cu_seqlens_k, tree_max_seqlen_q, tree_max_seqlen_k, scaling=None, sliding_window=None,
                   softcap=None, **kwargs):
    """Registered under TREE_ATTENTION; same signature and result as trl's packing.tree_attention."""
    backend = _state["backend"] or "sdpa"
    if backend != "sdpa":
        from transformers.integrations.flash_attention import get_target_dtype

        dtype = get_target_dtype(query, module) or query.dtype
        if query.is_cuda and dtype in (torch.float16, torch.bfloat16):
            varlen = _fa3().flash_attn_varlen_func if backend == "fa3" else _fa2()
            return _varlen_tree_attention(
                varlen, module, query, key, value, tree_kv_index=tree_kv_index,
                tree_cu_seqlens_q=tree_cu_seqlens_q, tree_cu_seqlens_k=tree_cu_seqlens_k,
                tree_max_seqlen_q=tree_max_seqlen_q, tree_max_seqlen_k=tree_max_seqlen_k, scaling=scaling,
                sliding_window=sliding_window, softcap=softcap), None
        if not _state["fell_back"]:
            _state["fell_back"] = True
            log(f"{backend} needs CUDA fp16/bf16, got {query.device.type} {dtype}: these calls use sdpa")
    return sdpa_tree_attention(query, key, value, tree_kv_index=tree_kv_index, tree_cu_seqlens_q=tree_cu_seqlens_q,
                               tree_cu_seqlens_k=tree_cu_seqlens_k, scaling=scaling, sliding_window=sliding_window,
                               softcap=softcap), None


@cache
def _fa3():
    from kernels import get_kernel

    return get_kernel(FA3_REPO, version=FA3_VERSION)


@cache
def _fa2():
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func


def fa3_cached() -> str | None:
    """Where the FA3 kernel sits in the local kernel cache (what `kernels` reads with HF_HUB_OFFLINE=1), or None."""
    from pathlib import Path

    try:
        from huggingface_hub import constants
        from huggingface_hub.file_download import repo_folder_name
    except ImportError:
        return None
    cache_dir = Path(os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)
    for repo_type in ("kernel", "model"):  # newer huggingface_hub caches kernels as "kernel" repos
        folder = cache_dir / repo_folder_name(repo_id=FA3_REPO, repo_type=repo_type)
        if (folder / "snapshots").is_dir():
            return str(folder)
    return None


def choose_backend() -> tuple[str, str]:
    """(backend, why): the fastest of fa3 / fa2 / sdpa this host can run without the network."""
    import importlib.util

    if not torch.cuda.is_available():
        return "sdpa", "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if torch.version.hip:
        why = "ROCm (TRL's aiter kernel is not baked in)"
    elif major != 9:
        why = f"GPU capability {major}.{minor} is not Hopper (FA3 needs 9.x)"
    elif importlib.util.find_spec("kernels") is None:
        why = "the `kernels` package is not installed"
    elif (where := fa3_cached()) is None:
        why = f"{FA3_REPO} is not in the local kernel cache (KERNELS_CACHE / HF_HUB_CACHE)"
    else:
        try:
            _fa3()
            return "fa3", f"{FA3_REPO} v{FA3_VERSION} from {where}"
        except Exception as e:  # a broken or partial cache: say why and use what works
            why = f"{FA3_REPO} in {where} did not load: {type(e).__name__}: {e}"
    if importlib.util.find_spec("flash_attn") is not None:
        try:
            _fa2()
            return "fa2", f"flash_attn varlen ({why})"
        except Exception as e:
            why += f"; flash_attn did not load: {type(e).__name__}: {e}"
    return "sdpa", why


def register() -> None:
    """Register tree_attention (and TRL's no-mask mask function) under TREE_ATTENTION."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, lambda **kwargs: None)  # as TRL: the tree kwargs are the mask


def install(backend: str | None = None) -> str:
    """Pick the backend (or use `backend`), register, and point the async trainer's `register_tree_attention` at
    `register`, so its `__init__` keeps this function. Call before constructing AsyncGRPOTrainer. Returns the
    backend."""
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    if packing.TREE_ATTENTION != TREE_ATTENTION:
        raise RuntimeError(f"trl's tree attention is named {packing.TREE_ATTENTION!r}, this module registers "
                           f"{TREE_ATTENTION!r}: update trainer/async_grpo/tree_attention.py for this trl version")
    if backend is None:
        backend, why = choose_backend()
    elif backend not in ("fa3", "fa2", "sdpa"):
        raise ValueError(f"tree attention backend {backend!r}: use fa3, fa2 or sdpa")
    else:
        why = "asked for"
        try:  # fail here, in one line, rather than in the first forward
            {"fa3": _fa3, "fa2": _fa2, "sdpa": lambda: None}[backend]()
        except Exception as e:
            raise RuntimeError(f"tree attention backend {backend!r} does not load here ({type(e).__name__}: {e}): "
                               "use sdpa, or install() without a backend to pick what this host has") from e
    _state["backend"], _state["fell_back"] = backend, False
    register()
    async_grpo_trainer.register_tree_attention = register
    log(f"{TREE_ATTENTION} runs on {backend}: {why}")
    return backend
