"""TRAIN_MODE, resolved by one rule wherever it is resolved (standard library only).

The host (`tools/stack.py`) counts the GPUs Docker hands out and passes the result to the trainer
as TRAIN_MODE; the trainer resolves `auto` itself only when started outside `make` (it counts the
GPUs torch sees, and whether the vllm service's name resolves: inside the trainer container of a
two-GPU host it sees only its own GPU).
"""

from __future__ import annotations

MODES = ("auto", "cpu", "gpu", "colocate")
NEEDS_GPUS = {"gpu": 2, "colocate": 1, "cpu": 0}


class TrainModeError(ValueError):
    """TRAIN_MODE cannot run here; the message names what was found and what to set."""


def resolve_train_mode(requested: str | None, gpu_count: int, *, vllm_service: bool = False,
                       found: str = "") -> tuple[str, str]:
    """(mode, one line saying why).

    auto: no GPU -> cpu; two or more GPUs, or a vllm service to talk to -> gpu (vLLM on its own GPU,
    weights over NCCL); exactly one -> colocate (vLLM inside the trainer). An explicit gpu/colocate
    with too few GPUs raises TrainModeError; `found` describes how the GPUs were counted.
    """
    want = (requested or "auto").strip().lower()
    if want == "server":
        want = "gpu"
    if want not in MODES:
        raise TrainModeError(f"TRAIN_MODE: unknown value {want!r}; choose from {', '.join(MODES)} and edit .env")
    found = found or f"{gpu_count} GPU(s)"
    if want == "cpu":
        return "cpu", "TRAIN_MODE=cpu: training on the CPU profile with a tiny local model (no vLLM)"
    if want == "auto":
        if gpu_count >= 2 or (gpu_count >= 1 and vllm_service):
            return "gpu", f"TRAIN_MODE=auto: {found}: vLLM serves on its own GPU, the trainer trains on another"
        if gpu_count == 1:
            return "colocate", f"TRAIN_MODE=auto: {found}: vLLM runs inside the trainer on it (colocate)"
        return "cpu", (f"TRAIN_MODE=auto: {found}, so training runs on the CPU profile with a tiny local model "
                       "(no vLLM); set TRAIN_MODE=gpu on a host with 2 NVIDIA GPUs")
    need = NEEDS_GPUS[want]
    if gpu_count < need and not (want == "gpu" and vllm_service and gpu_count >= 1):
        raise TrainModeError(f"TRAIN_MODE={want} needs {need} NVIDIA GPU(s), found {gpu_count} ({found}); set "
                             "TRAIN_MODE=auto or cpu in .env, or run `make doctor`")
    return want, f"TRAIN_MODE={want}: {found}"
