"""Server mode's share of the preflight (trainer/run/preflight.py runs it): everything vLLM server mode needs before
GRPOTrainer is built, checked in one pass."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

from contract import stages
from trainer.gpu.nccl import NCCL_BRIDGE_DEFAULTS, check_group_port, pin_async_rendezvous_port, prepare_rendezvous
from trainer.gpu.server import (
    VLLMPreflightError,
    check_vllm_server,
    explain_init_failure,
    one_token,
    restart_blind,
    version_skew,
    world_size_mismatch,
)
from trainer.gpu import colocate, push_state
from trainer.gpu.trl_hooks import guard_generation, guard_weight_transfer_init, use_weight_reload

if TYPE_CHECKING:
    from contract.config import RunConfig

logger = logging.getLogger("trainer.gpu")


def mark_scheduler(state: bool | None, source: str, cfg: "RunConfig") -> None:
    """The `vllm_scheduler` stage: which scheduler vLLM runs (`make gpu-smoke` prints it)."""
    from contract import vllm_flags

    stages.mark("vllm_scheduler", None, vllm_flags.scheduler_detail(state, source, vllm_flags.parse(cfg.vllm_extra_args)),
                async_scheduling=state)


def preflight_vllm(cfg: "RunConfig") -> dict[str, Any]:
    """Everything server mode needs before GRPOTrainer is built; raises VLLMPreflightError with one
    clear message (problems joined by newlines), each naming its fix.

    gpu: vLLM healthy, dev mode on (/server_info 404 = off), nccl weight transfer configured, same
    vllm/torch on both ends, a CUDA device here, this container's address resolved and exported as
    VLLM_HOST_IP, the group port free, NCCL bridge defaults applied, and the rendezvous watchdog
    armed around trl's init_communicator (it runs inside GRPOTrainer.__init__).
    colocate: CUDA and vllm importable. cpu: nothing to check.
    """
    chosen = cfg.placement
    if not chosen.uses_vllm:
        return {"mode": "cpu"}
    problems: list[str] = []
    import torch

    reload = chosen.reload_dir  # the CPU rehearsal: no GPU
    if not reload and not torch.cuda.is_available():
        problems.append(
            f"TRAIN_MODE={chosen} needs a CUDA GPU in the trainer container, and torch sees none; give the "
            "trainer service a GPU (NVIDIA runtime, TRAINER_GPU in .env; `make doctor`) or use TRAIN_MODE=cpu"
        )
    try:
        import vllm

        local_vllm = getattr(vllm, "__version__", None)
    except Exception as exc:  # noqa: BLE001
        local_vllm = None
        problems.append(f"vllm does not import in the trainer ({type(exc).__name__}: {exc}); rebuild the trainer "
                        "image FROM VLLM_IMAGE (`make build`)")
    if chosen.colocated:
        try:  # VLLM_EXTRA_ARGS onto the engine TRL builds in this process
            engine, _ = colocate.extra_flags(cfg)
        except ValueError as exc:
            problems.append(f"VLLM_EXTRA_ARGS: {exc}")
        if problems:
            raise VLLMPreflightError("\n".join(problems))
        colocate.install_engine_args(engine)
        return {"mode": "colocate", "vllm": local_vllm, "vllm_extra_args": engine}

    url = str(cfg.vllm_server_url).rstrip("/")
    try:
        rep = check_vllm_server(url, timeout_s=float(cfg.vllm_server_timeout_s))
    except VLLMPreflightError as exc:
        raise VLLMPreflightError("\n".join([*problems, str(exc)])) from None
    generates = one_token(url, float(cfg.vllm_server_timeout_s))
    if generates:  # healthy by /health, yet no answer: wedged (trainer.launch normally catches this first)
        raise VLLMPreflightError("\n".join([*problems, f"vLLM at {url} is healthy by /health but {generates}; "
                                             "restart it: `docker compose up -d --no-deps --force-recreate --wait "
                                             "vllm` (`make train` does it by itself)"]))
    stages.mark("vllm_healthy", rep.waited_s, f"{url} serves {rep.model} (world size {rep.world_size})")
    mark_scheduler(rep.async_scheduling, "the server's /server_info scheduler_config", cfg)
    problems += version_skew(rep, local_vllm, torch.__version__)
    blind = restart_blind(url)  # restart detection reads the process start time (data parallel drops it)
    if blind:
        problems.append(blind)
    problems += world_size_mismatch(rep, int(cfg.vllm_world_size))
    if reload:
        if problems:
            raise VLLMPreflightError("\n".join(problems))
        push_state.configure(str(cfg.output_dir), cfg.resolved_run_name)
        guard_generation(float(cfg.generation_timeout_s))
        use_weight_reload(reload, float(cfg.weight_sync_timeout_s))
        return {"mode": "gpu", "url": url, "model": rep.model, "world_size": rep.world_size,
                "vllm_version": rep.vllm_version, "max_model_len": rep.max_model_len,
                "weight_transfer": f"reload from {reload}", "warnings": rep.warnings, "dtype": rep.dtype}
    if rep.server_has_cuda is False:
        problems.append(explain_init_failure(None, "", rep))

    host_ip = ""
    try:
        host_ip = prepare_rendezvous(url)
    except VLLMPreflightError as exc:
        problems.append(str(exc))
    if host_ip:
        port_problem = check_group_port(host_ip, int(cfg.vllm_group_port))
        if port_problem:
            problems.append(port_problem)
        pin_async_rendezvous_port(int(cfg.vllm_group_port))  # ROLLOUTS=async's transfer: the same port rule
    if problems:
        raise VLLMPreflightError("\n".join(problems))

    timeout = float(cfg.weight_sync_timeout_s)
    push_state.configure(str(cfg.output_dir), cfg.resolved_run_name)  # rank 0: the one process that pushes
    guard_generation(float(cfg.generation_timeout_s))
    guard_weight_transfer_init(timeout, host_ip, int(cfg.vllm_group_port), rep)
    for w in rep.warnings:
        logger.warning(w)
    return {
        "mode": "gpu", "url": url, "model": rep.model, "world_size": rep.world_size,
        "vllm_version": rep.vllm_version, "max_model_len": rep.max_model_len, "host_ip": host_ip,
        "group_port": int(cfg.vllm_group_port),
        "nccl": {k: os.environ.get(k) for k in NCCL_BRIDGE_DEFAULTS}, "warnings": rep.warnings,
        "waited_s": round(rep.waited_s, 1), "dtype": rep.dtype,
    }
