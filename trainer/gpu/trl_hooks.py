"""Where the trainer wraps TRL: the NCCL rendezvous inside GRPOTrainer.__init__ (a watchdog and a clear
error), every weight sync (timed, logged, watched), every weight push cast to the dtype vLLM serves (the trainer
keeps fp32 master weights), and, for server mode's CPU rehearsal, the weight push by reload from a shared folder
instead of NCCL."""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterable

from contract import stages
from trainer.gpu import push_state
from trainer.gpu.server import (ServerReport, VLLMGone, VLLMRestarted, explain_init_failure, started_at,
                                unreachable)
from trainer.gpu.watchdog import WeightSyncTimeout, rendezvous_diagnosis, watchdog

DEFAULT_WEIGHT_SYNC_TIMEOUT_S = 300.0  # only for a trainer instrumented without a run config (tests)

logger = logging.getLogger("trainer.gpu")


class WeightTransferInitError(RuntimeError):
    """Setting up the NCCL weight-transfer group failed; the message says why and what to do."""


_GUARD: dict[str, Any] = {}


def guard_weight_transfer_init(timeout_s: float, host_ip: str | None, port: int,
                               report: ServerReport | None = None) -> None:
    """Wrap trl's VLLMClient.init_communicator (called inside GRPOTrainer.__init__) with the
    rendezvous watchdog and a clear message on failure. Idempotent."""
    from trl.generation import vllm_client as trl_vllm_client

    _GUARD.update(timeout_s=timeout_s, host_ip=host_ip, port=port, report=report)
    require_prefix_cache_reset()
    cls = trl_vllm_client.VLLMClient
    if getattr(cls.init_communicator, "_grpo_guarded", False):
        return
    original = cls.init_communicator

    def init_communicator(self, *args, **kwargs):
        g = dict(_GUARD)
        started = time.monotonic()
        with watchdog(g["timeout_s"], lambda s: rendezvous_diagnosis(g["host_ip"], g["port"], s)):
            try:
                result = original(self, *args, **kwargs)
            except WeightSyncTimeout:
                raise
            except NotImplementedError as exc:  # trl: the trainer's device is not CUDA
                raise WeightTransferInitError(explain_init_failure(None, str(exc), g["report"])) from exc
            except Exception as exc:  # noqa: BLE001 - trl raises bare Exception("Request failed: 500, ...")
                text = str(exc)
                status = 500 if "Request failed: 500" in text else None
                raise WeightTransferInitError(explain_init_failure(status, text, g["report"])) from exc
        seconds = time.monotonic() - started
        push_state.group_formed(f"NCCL, trainer at {g['host_ip']}:{g['port']}")
        logger.info("NCCL weight-transfer group ready in %.1fs", seconds)
        stages.mark("rendezvous", seconds, "NCCL weight-transfer group formed (trainer = rank 0)")
        return result

    init_communicator._grpo_guarded = True  # type: ignore[attr-defined]
    init_communicator.__wrapped__ = original  # type: ignore[attr-defined]
    cls.init_communicator = init_communicator


def instrument_weight_sync(trainer: Any, log_fn: Callable[[float], None],
                           timeout_s: float | None = None) -> bool:
    """Time every weight sync and call log_fn(seconds) after it; a sync that outlives the weight-sync
    timeout fails with a diagnosis instead of hanging.

    In trl 1.16.0 the sync is `trainer.vllm_generation.sync_weights()` (VLLMGeneration, called from
    GRPOTrainer._generate / _generate_single_turn when global_step moved): NCCL broadcast in server
    mode, in-process load_weights in colocate mode. Also records `weight_sync/seconds` in the
    trainer's own metrics. Returns False (and does nothing) when the trainer does not use vLLM.
    """
    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not hasattr(gen, "sync_weights"):
        return False
    if getattr(gen.sync_weights, "_grpo_timed", False):
        return True
    args = getattr(trainer, "args", None)
    if timeout_s is None:  # preflight_vllm stored the run's WEIGHT_SYNC_TIMEOUT_S (train.py passes it too)
        timeout_s = float(_GUARD.get("timeout_s") or DEFAULT_WEIGHT_SYNC_TIMEOUT_S)
    port = int(args.vllm_group_port)  # GRPOConfig's, set from VLLM_GROUP_PORT by grpo_vllm_kwargs
    server = getattr(gen, "mode", None) == "server"
    original = gen.sync_weights

    def sync_weights(*a, **kw):
        start = time.perf_counter()
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        if server:
            push_state.push_started(step)  # rank 0 only (the others have no marker): cleared when the push returns
            with watchdog(timeout_s, lambda s: rendezvous_diagnosis(None, port, s, what="weight sync")):
                result = original(*a, **kw)
            push_state.push_done(step)
            client = getattr(gen, "vllm_client", None)  # rank 0's: the one that pushes
            if client is not None and getattr(gen.accelerator, "is_main_process", True):
                record_push(client.base_url)
        else:
            result = original(*a, **kw)
        seconds = time.perf_counter() - start
        try:
            log_fn(seconds)
        except Exception:  # noqa: BLE001 - metrics must never break training
            logger.exception("weight-sync log_fn failed")
        metrics = getattr(trainer, "_metrics", None)
        if isinstance(metrics, dict) and "train" in metrics:
            metrics["train"]["weight_sync/seconds"].append(seconds)
        logger.info("weight sync %.2fs", seconds)
        # TRL also syncs before the first step (its last-loaded step starts at -1): unchanged weights. The smoke's
        # stage is the first push of weights an optimizer step changed.
        if getattr(getattr(trainer, "state", None), "global_step", 0) >= 1:
            stages.mark("first_weight_sync", seconds, "server mode: NCCL broadcast of trained weights" if server
                        else "colocate: in-process load of trained weights")
        return result

    sync_weights._grpo_timed = True  # type: ignore[attr-defined]
    gen.sync_weights = sync_weights
    return True


def record_push(url: str) -> None:
    """Rank 0, after each push into the vLLM server at `url`: which process the pushed weights went into."""
    _GUARD.update(served_url=url, pushed_into=started_at(url))


def check_served_weights() -> None:
    """Server mode, after a step's generations: raise VLLMRestarted when the vLLM that answered them is not the one the
    last push went into (a restart inside TRL's client retries fails no request, and the new process serves the
    weights it loaded at start: the step would train on the base policy's samples). Before the optimizer step, so
    the run stops (exit 77) and `make train` resumes it from its last checkpoint. A no-op on other ranks, in other
    modes, and where /metrics does not give the process' start time."""
    pushed_into = _GUARD.get("pushed_into")
    if pushed_into is None:
        return
    now = started_at(_GUARD["served_url"])
    if now is not None and now != pushed_into:
        raise VLLMRestarted(f"it restarted after the last weight push (the process that answered this step's "
                            f"generations started {now - pushed_into:.0f} s after the one the push went into) and "
                            "served the weights it loaded at start")


def check_vllm_there() -> None:
    """ROLLOUTS=async, while the trainer waits for samples: raise VLLMGone when the vLLM the last push went into
    refuses connections (TRL's rollout worker would retry a refused generation for minutes, the run silent), and
    VLLMRestarted when another process answers. Either stops the run (exit 77). A no-op before the first push."""
    url = _GUARD.get("served_url")
    if url is None:
        return
    why = unreachable(url)
    if why:
        raise VLLMGone(why)
    check_served_weights()


def colocated_dtype(gen: Any) -> str | None:
    """The dtype of the vLLM engine TRL built inside this process (colocate): its `LLM(model=...)` passes no dtype,
    so vLLM's "auto" picks it from the model's config.json (an fp32 config is served in bf16 on GPUs that have it)."""
    llm = getattr(gen, "llm", None)
    engine = getattr(llm, "llm_engine", None)
    model_config = getattr(engine, "model_config", None) or getattr(getattr(engine, "vllm_config", None),
                                                                     "model_config", None)
    dtype = getattr(model_config, "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def push_in_served_dtype(trainer: Any, served_dtype: str | None) -> str | None:
    """Cast every tensor a weight push sends to the dtype vLLM serves, names unchanged.

    The trainer keeps fp32 master weights (bf16 ones would not move under AdamW at lr 1e-5), so TRL would stream
    fp32: twice the bytes against WEIGHT_SYNC_TIMEOUT_S. All of TRL 1.16's pushes read one iterator,
    `VLLMGeneration._iter_named_params` (plain, DeepSpeed-gathered, or FSDP2 `full_tensor()` parameters): server
    mode's metadata (dtype names the server allocates by) and NCCL broadcast, colocate's `load_weights`, and the
    CPU rehearsal's reload file (use_weight_reload). Wrapping it here covers them all.

    served_dtype: server mode's /server_info model_config.dtype (trainer.gpu.server); colocate reads its own engine
    (colocated_dtype). Returns the dtype pushes are cast to, or None (no vLLM, or the server did not say: the
    tensors go as they are and vLLM casts them on load)."""

    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not hasattr(gen, "_iter_named_params"):
        return None
    if getattr(gen, "mode", None) == "colocate":
        served_dtype = colocated_dtype(gen) or served_dtype
    if not served_dtype:
        logger.warning("the vLLM server did not report its dtype (/server_info model_config.dtype): weight pushes "
                       "go in the trainer's dtype, and vLLM casts them on load")
        return None
    target = served_torch_dtype(served_dtype)
    original = getattr(gen._iter_named_params, "__wrapped__", gen._iter_named_params)

    def _iter_named_params():
        return in_dtype(original(), target)

    _iter_named_params.__wrapped__ = original  # type: ignore[attr-defined]
    gen._iter_named_params = _iter_named_params
    return served_dtype


def served_torch_dtype(served_dtype: str):
    """The torch dtype vLLM serves in (its /server_info name, e.g. `bfloat16`); ValueError (one line) for a name torch
    does not know."""
    import torch

    target = getattr(torch, served_dtype, None)
    if not isinstance(target, torch.dtype):
        raise ValueError(f"vLLM serves dtype {served_dtype!r}, which torch does not know; the weight push cannot "
                         "cast to it (check the vllm service's --dtype)")
    return target


def in_dtype(named_tensors: Iterable[tuple[str, Any]], target) -> Iterable[tuple[str, Any]]:
    """Each floating tensor of a push cast to `target` (None: as it is), names unchanged; one tensor at a time: a second
    copy of one parameter, never of the model."""
    for name, tensor in named_tensors:
        if target is not None and tensor.is_floating_point() and tensor.dtype != target:
            tensor = tensor.to(target)
        yield name, tensor


def async_nccl_push(transfer: Any, served_dtype: str | None) -> bool:
    """ROLLOUTS=async with TRL 1.16's own NCCL client (`WeightTransferClient`, rank 0): its pushes go in the served
    dtype and are marked in flight (push_state), as the sync trainer's are. TRL builds the manifest vLLM sizes its
    receive buffers by (`_weight_update_info["dtype_names"]`) from the parameters' dtype and streams them uncast: fp32
    master weights would go in fp32, twice the bytes, and TRL would warn at each start to load the model in bf16. The
    manifest and the stream are cast together, here, or not at all. Returns False for another transfer (reload casts
    and marks its own pushes, trainer.async_grpo.async_trainer.ReloadWeightTransfer). PINNED to trl 1.16's
    `WeightTransferClient._weight_update_info`, `send_weights(iterator)` and `init_weight_transfer()`."""
    from trl.experimental.async_grpo.weight_transfer import WeightTransferClient

    if not isinstance(transfer, WeightTransferClient) or getattr(transfer.send_weights, "_grpo_cast", False):
        return False
    target = served_torch_dtype(served_dtype) if served_dtype else None
    if target is not None:
        import torch

        def floating(name: str) -> bool:
            dtype = getattr(torch, name, None)
            return isinstance(dtype, torch.dtype) and dtype.is_floating_point

        info = transfer._weight_update_info  # in_dtype below casts exactly the floating tensors
        info["dtype_names"] = [served_dtype if floating(name) else name for name in info["dtype_names"]]
    else:
        logger.warning("the vLLM server did not report its dtype (/server_info model_config.dtype): async weight "
                       "pushes go in the trainer's fp32")
    send, init, pushes = transfer.send_weights, transfer.init_weight_transfer, [0]

    def init_weight_transfer() -> None:
        init()
        push_state.group_formed("NCCL, async trainer = rank 0")

    def send_weights(iterator) -> None:
        push_state.push_started(pushes[0])  # a kill mid-push: the next launch restarts vLLM at once, no probe wait
        send(in_dtype(iterator, target))
        reset_after_async_push(transfer.vllm.server_url)
        push_state.push_done(pushes[0])
        pushes[0] += 1

    send_weights._grpo_cast = True  # type: ignore[attr-defined]
    transfer.send_weights, transfer.init_weight_transfer = send_weights, init_weight_transfer
    return True


def reset_after_async_push(base_url: str) -> None:
    """ROLLOUTS=async, after the weights went in and before TRL resumes vLLM: reset its prefix cache, checked.

    Redundant with vLLM 0.31, kept on purpose. TRL 1.16 pauses with `/pause?mode=keep` (no clear_cache parameter, so
    the route's default True); the route's docstring says clear_cache is ignored for keep, but vLLM 0.31's code applies
    it: EngineCore.pause_scheduler -> _finish_pause(True) -> _reset_caches(reset_running_requests=True) (v1/engine/
    core.py), so the pause itself drops the prefix cache and preempts the frozen requests (they recompute with the new
    weights on resume), and a keep-paused engine takes no step before this reset finds nothing to drop. It stays
    because clear_cache is marked DEPRECATED on that route: a vLLM that makes the code match its docstring would
    otherwise serve KV the old weights computed (a GRPO group's prompt, every episode's system prompt and tool
    schemas), silently; this call costs one HTTP round trip per push and is the only place that raises when a reset is
    refused (weight_check.reset_prefix_cache; `reset_running_requests`: a plain reset is refused while paused
    requests hold blocks)."""
    import requests

    from trainer.gpu.weight_check import reset_prefix_cache

    reset_prefix_cache(requests, base_url, running=True)


def use_weight_reload(folder: str, timeout_s: float) -> None:
    """WEIGHT_TRANSFER=reload, server mode rehearsed on CPU (no NCCL without GPUs). TRL's VLLMClient keeps its
    generation and every other route; its weight push becomes: write the weights TRL streams to
    `folder`/model.safetensors (a folder the vLLM server mounts at the same path), then ask the server to reload
    them (vLLM's dev route /collective_rpc -> worker.reload_weights(weights_path=folder)). The server's model
    really changes; only the transport differs from the GPU path. Call before GRPOTrainer is built. Idempotent."""
    from pathlib import Path

    from trl.generation import vllm_client as trl_vllm_client

    require_prefix_cache_reset()
    cls = trl_vllm_client.VLLMClient
    if getattr(cls.update_named_params, "_grpo_reload", False):
        return
    target = Path(folder)

    def init_communicator(self, *args, **kwargs):
        print(f"[weight-sync] WEIGHT_TRANSFER=reload: no NCCL group; each sync writes {target}/model.safetensors "
              "and has vLLM reload it", flush=True)
        stages.mark("rendezvous", 0.0, f"weight transfer by reload from {target} (CPU rehearsal, no NCCL)")
        push_state.group_formed(f"reload from {target}")

    def update_named_params(self, metadata, named_params):
        reload_weights(self.base_url, target, named_params, timeout_s)

    update_named_params._grpo_reload = True  # type: ignore[attr-defined]
    cls.init_communicator = init_communicator
    cls.update_named_params = update_named_params
    cls.close_communicator = lambda self: None


def reload_weights(base_url: str, folder: str | os.PathLike, named_params: Iterable[tuple[str, Any]],
                   timeout_s: float) -> int:
    """The weight push of WEIGHT_TRANSFER=reload, shared by the sync trainer (use_weight_reload) and the async one
    (trainer.async_grpo.async_trainer.ReloadWeightTransfer): write `named_params` to `folder`/model.safetensors (a folder the
    vLLM server mounts at the same path), then have vLLM reload them (its dev route /collective_rpc ->
    worker.reload_weights(weights_path=folder)). Returns how many tensors it wrote."""
    from pathlib import Path

    import requests
    from safetensors.torch import save_file

    target = Path(folder)
    tensors = {name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in named_params}
    target.mkdir(parents=True, exist_ok=True)
    partial = target / "model.safetensors.partial"  # vLLM reads *.safetensors: never a half-written one
    save_file(tensors, str(partial))
    os.replace(partial, target / "model.safetensors")
    r = requests.post(f"{base_url}/collective_rpc", timeout=timeout_s,
                      json={"method": "reload_weights", "kwargs": {"weights_path": str(target)}})
    if r.status_code != 200:
        raise WeightTransferInitError(f"vLLM could not reload the weights from {target} (HTTP {r.status_code}: "
                                      f"{r.text[:300]}); it must mount that folder at the same path")
    print(f"[weight-sync] vLLM reloaded {len(tensors)} tensors from {target}", flush=True)
    return len(tensors)


def require_prefix_cache_reset() -> None:
    """TRL 1.16 calls VLLMClient.reset_prefix_cache() after every weight sync and drops vLLM's `{"success": false}`:
    the next rollouts would then reuse KV computed with the old weights. Make that answer an error
    (weight_check.PrefixCacheResetFailed, its message says what to do). Idempotent."""
    from trl.generation import vllm_client as trl_vllm_client

    from trainer.gpu.weight_check import reset_prefix_cache

    cls = trl_vllm_client.VLLMClient
    if getattr(cls.reset_prefix_cache, "_grpo_checked", False):
        return

    def checked_reset(self):
        reset_prefix_cache(self.session, self.base_url)

    checked_reset._grpo_checked = True  # type: ignore[attr-defined]
    checked_reset.__wrapped__ = cls.reset_prefix_cache  # type: ignore[attr-defined]
    cls.reset_prefix_cache = checked_reset


def guard_generation(timeout_s: float, grace_s: float = 15.0) -> None:
    """Server mode: TRL's VLLMClient.generate (one POST /v1/completions, no timeout of its own) runs under the same
    watchdog as the weight sync, so a hung vLLM ends the run with a diagnosis (exit 75) instead of a silent hang.
    Call before GRPOTrainer is built. Idempotent; a later call only changes the deadline."""
    from trl.generation import vllm_client as trl_vllm_client

    _GUARD.update(generation_timeout_s=timeout_s, generation_grace_s=grace_s)
    cls = trl_vllm_client.VLLMClient
    if getattr(cls.generate, "_grpo_watched", False):
        return
    original = cls.generate

    def generate(self, *args, **kwargs):
        limit, grace = float(_GUARD["generation_timeout_s"]), float(_GUARD["generation_grace_s"])
        # a request blocked reading the socket sees no Python exception: past the grace the process exits (75)
        with watchdog(limit, lambda s: generation_diagnosis(self.base_url, s), grace_s=grace):
            return original(self, *args, **kwargs)

    generate._grpo_watched = True  # type: ignore[attr-defined]
    generate.__wrapped__ = original  # type: ignore[attr-defined]
    cls.generate = generate


def generation_diagnosis(url: str, seconds: float) -> str:
    return (f"vLLM at {url} did not answer a generation request in {seconds:.0f}s: hung? `docker compose logs vllm` "
            "says why (a weight update left unfinished, the engine stuck, out of memory). The next `make train` "
            "restarts the vllm service and resumes from the last checkpoint; for very long completions raise "
            "GENERATION_TIMEOUT_S")
