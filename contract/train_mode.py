"""TRAIN_MODE, resolved by one rule wherever it is resolved (standard library only).

The host (`tools/derive.py`, from the GPUs Docker hands out) resolves `auto` once into its plan and passes the
result to the trainer as TRAIN_MODE; the trainer resolves `auto` itself only when started outside `make`
(trainer.core.grpo_args.resolve: the GPUs torch sees, and whether the vllm service's name resolves: inside the trainer
container of a two-GPU host it sees only its own GPU). Either way the result is the config's variant
(contract.config.placement: cfg.placement), which the code below asks; a row of the table: `cfg.placement.spec`.
"""

from __future__ import annotations

from dataclasses import dataclass

MODES = ("auto", "cpu", "gpu", "colocate")


@dataclass(frozen=True)
class ModeSpec:
    """What a resolved mode runs. Its Compose profile is its name."""

    gpus_needed: int
    trainer_service: str          # the compose service that trains
    trainer_image_service: str    # the build-only service that builds its image
    runs_vllm_service: bool       # vLLM in its own service (gpu) or inside the trainer / not at all
    makes_model_locally: bool     # the model-init job makes a tiny model (no hub): the CPU profile
    vllm_gpu_default: str         # VLLM_GPU / TRAINER_GPU when .env leaves them empty
    trainer_gpu_default: str
    smoke_stages: tuple[str, ...]  # what `make gpu-smoke` checks, in order (tools/commands/smoke.py says what each is)


# The one TRAIN_MODE table: the host (tools/) and the trainer read it, neither restates it.
MODE_SPECS: dict[str, ModeSpec] = {
    "cpu": ModeSpec(0, "trainer-cpu", "trainer-cpu-image", False, True, "", "",
                    ("first_generation", "first_optimizer_step", "tool_calls")),
    "gpu": ModeSpec(2, "trainer", "trainer-gpu-image", True, False, "0", "1",
                    ("model_download", "vllm_healthy", "rendezvous", "first_generation", "first_optimizer_step",
                     "first_weight_sync", "importance_sampling", "tool_calls")),
    "colocate": ModeSpec(1, "trainer", "trainer-gpu-image", False, False, "", "0",
                         ("model_download", "first_generation", "first_optimizer_step", "first_weight_sync",
                          "importance_sampling", "tool_calls")),
}
NEEDS_GPUS = {mode: spec.gpus_needed for mode, spec in MODE_SPECS.items()}


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
