"""ROLLOUTS and TRAIN_MODE as typed choices: each variant carries the knobs only it reads, and refuses what it cannot
run.

`.env` keeps its flat names (ROLLOUTS, MAX_STALENESS, TRAIN_MODE, WEIGHT_TRANSFER, ...). RunConfig reads them once and
hands out the chosen variant (a discriminated config, as prime-rl's, kept small); code below asks the variant, never
compares the string:

    cfg.rollouts.is_async, cfg.rollouts.max_staleness (AsyncRollouts only), cfg.rollouts.eval_every (SyncRollouts only),
    cfg.rollouts.problem(mode, processes, ...)
    cfg.mode("gpu").trainer_on_cpu, .server, .colocated, .reload_dir      (TRAIN_MODE, once `auto` is resolved)

Standard library only (frozen dataclasses): the host's stdlib-only modules (tools/gpu_doctor.py, contract/memory.py) ask
it too. RunConfig's flat fields validate the knobs' values; a variant only groups them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from contract.train_mode import MODE_SPECS, ModeSpec

DEFAULT_MAX_STALENESS = 4  # TRL's AsyncGRPOConfig default
DEFAULT_EVAL_EPISODES = 32  # held-out episodes per env at each evaluation during training (EVAL_EVERY)


@dataclass(frozen=True)
class Variant:
    """One choice of a mode setting, frozen once read. `name` is its value in .env; its fields are its own knobs."""

    setting: ClassVar[str]  # the .env variable that chooses it
    name: ClassVar[str]

    def __str__(self) -> str:
        return self.name


def knobs(cls: type[Variant]) -> tuple[str, ...]:
    """The settings a variant carries (RunConfig field names)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def build(variants: dict[str, type[Variant]], name: str, flat: dict[str, Any]) -> Variant:
    """The variant `name` names, with the knobs it owns taken from the flat settings (RunConfig's fields)."""
    if name not in variants:
        cls = next(iter(variants.values()))
        raise ValueError(f"{cls.setting}={name!r}: choose from {', '.join(variants)} (edit .env)")
    cls = variants[name]
    return cls(**{knob: flat[knob] for knob in knobs(cls) if knob in flat})


def foreign_knob(variants: dict[str, type[Variant]], name: str, flat: dict[str, Any],
                 defaults: dict[str, Any]) -> str | None:
    """One line when a knob of a variant other than `name` is set to other than its default (it would be ignored
    without a word), else None."""
    cls = variants[name]
    for other in variants.values():
        for knob in knobs(other):
            if knob not in knobs(cls) and flat.get(knob, defaults[knob]) != defaults[knob]:
                return (f"{knob.upper()}={flat[knob]} is a setting of {other.setting}={other.name}, which this run "
                        f"does not use ({cls.setting}={cls.name}): set {other.setting}={other.name}, or leave "
                        f"{knob.upper()} empty (edit .env)")
    return None


# ---------------------------------------------------------------------------- TRAIN_MODE (resolved)
@dataclass(frozen=True)
class TrainMode(Variant):
    """A resolved TRAIN_MODE (`auto` is resolved by whoever counts the GPUs: contract.train_mode)."""

    setting: ClassVar[str] = "TRAIN_MODE"
    server: ClassVar[bool] = False     # vLLM in a server of its own, weights pushed to it
    colocated: ClassVar[bool] = False  # vLLM inside the trainer process
    vllm_memory_share: ClassVar[float] = 0.0  # VLLM_GPU_MEMORY_UTILIZATION when .env leaves it empty

    @property
    def trainer_on_cpu(self) -> bool:
        """The trainer's processes run on CPU (gloo between them): the CPU profile, and server mode's rehearsal."""
        return False

    @property
    def uses_vllm(self) -> bool:
        return self.server or self.colocated

    @property
    def reload_dir(self) -> str | None:
        """Where pushed weights go by reload (gpu with WEIGHT_TRANSFER=reload); None: no push, or NCCL's."""
        return None

    @property
    def spec(self) -> ModeSpec:
        """Its row of the TRAIN_MODE table the host reads (services, GPU defaults, smoke stages)."""
        return MODE_SPECS[self.name]


@dataclass(frozen=True)
class CpuMode(TrainMode):
    """The CPU profile: transformers generation, the tiny local model, no vLLM."""

    name: ClassVar[str] = "cpu"

    @property
    def trainer_on_cpu(self) -> bool:
        return True


@dataclass(frozen=True)
class GpuMode(TrainMode):
    """vLLM serves on a GPU of its own; the trainer pushes new weights to it (NCCL, or a reload: its CPU rehearsal)."""

    name: ClassVar[str] = "gpu"
    server: ClassVar[bool] = True
    vllm_memory_share: ClassVar[float] = 0.9  # its own GPU: vLLM takes most of it
    weight_transfer: Literal["nccl", "reload"] = "nccl"
    weight_reload_dir: str = "/weights"

    @property
    def trainer_on_cpu(self) -> bool:
        return self.weight_transfer == "reload"

    @property
    def reload_dir(self) -> str | None:
        """WEIGHT_RELOAD_DIR when weights go by reload, else None (NCCL)."""
        return self.weight_reload_dir if self.weight_transfer == "reload" else None


@dataclass(frozen=True)
class ColocateMode(TrainMode):
    """One GPU: vLLM runs inside the trainer process."""

    name: ClassVar[str] = "colocate"
    colocated: ClassVar[bool] = True
    vllm_memory_share: ClassVar[float] = 0.3  # the trainer's weights, grads and optimizer share the GPU


TRAIN_MODES: dict[str, type[TrainMode]] = {"cpu": CpuMode, "gpu": GpuMode, "colocate": ColocateMode}


def as_mode(value: TrainMode | str) -> TrainMode:
    """A resolved TRAIN_MODE's variant as it is, or the one its name names with default knobs: for the host's
    questions about the layout (server, colocated, spec), which no knob changes. With a RunConfig, ask cfg.mode()."""
    return value if isinstance(value, TrainMode) else build(TRAIN_MODES, value, {})  # type: ignore[return-value]


# ---------------------------------------------------------------------------- ROLLOUTS
@dataclass(frozen=True)
class SyncRollouts(Variant):
    """TRL's GRPOTrainer: generate a batch, then train on it."""

    setting: ClassVar[str] = "ROLLOUTS"
    name: ClassVar[str] = "sync"
    is_async: ClassVar[bool] = False
    # RunConfig's EVAL_EVERY (0: off) and EVAL_EPISODES: evaluation during training (trainer.run.evaluation), sync only:
    # the async trainer's process holds no env session and does not generate (its rollout worker does)
    eval_every: int = 0
    eval_episodes: int = DEFAULT_EVAL_EPISODES

    def problem(self, mode: TrainMode | None, processes: int | None, sharding: str) -> str | None:
        return None

    def session_pool(self, cfg: Any, num_processes: int) -> tuple[int, int]:
        """(episodes in flight per pool, pools): TRL's environment pool, one per process, as big as a generation
        batch (per_device_train_batch_size x steps_per_generation)."""
        return cfg.generation_batch_size, num_processes


@dataclass(frozen=True)
class AsyncRollouts(Variant):
    """TRL's AsyncGRPOTrainer: a rollout worker keeps generating while the trainer trains on what is queued."""

    setting: ClassVar[str] = "ROLLOUTS"
    name: ClassVar[str] = "async"
    is_async: ClassVar[bool] = True
    max_staleness: int = DEFAULT_MAX_STALENESS  # RunConfig's MAX_STALENESS, validated there
    async_step_samples: str = "packed"  # RunConfig's ASYNC_STEP_SAMPLES: packed (TRL's token budget) or batch
    max_inflight_rollouts: int | None = None  # RunConfig's MAX_INFLIGHT_ROLLOUTS; None: TRL's default (inflight)

    @property
    def token_budget(self) -> int | None:
        """TRL's AsyncGRPOConfig.token_budget: None packs each step up to vLLM's max_model_len in tokens; 0 trains a
        fixed count, per_device_train_batch_size x gradient_accumulation_steps x processes, as a sync step does."""
        return 0 if self.async_step_samples == "batch" else None

    def problem(self, mode: TrainMode | None, processes: int | None, sharding: str) -> str | None:
        """Why this cannot run in `mode` with `processes` trainer processes (None: not known yet; the launcher asks
        again once it has resolved both), as one line naming what to change; None if it can."""
        if isinstance(mode, CpuMode):
            return ("ROLLOUTS=async generates with a vLLM server, which the CPU profile has none of: to try the GPU "
                    "layout on this machine run `make rehearse` (TRAIN_MODE=gpu on CPU, the vLLM CPU twin), or set "
                    "ROLLOUTS=sync (edit .env)")
        if mode is not None and mode.colocated:
            return ("ROLLOUTS=async needs vLLM on a GPU of its own (it generates while the trainer trains); colocate "
                    "shares one GPU between them: use TRAIN_MODE=gpu on 2+ GPUs, or ROLLOUTS=sync (edit .env)")
        if processes is not None and processes > 2:
            # TRL 1.16's weight sync deadlocks with more than 2 FSDP ranks (huggingface/trl#6797, #7103): rank 0's
            # full_tensor() gathers run inside the NCCL transfer loop, out of order with the other ranks'.
            return (f"ROLLOUTS=async runs 1 or 2 trainer processes, not {processes}: TRL 1.16's async weight sync "
                    "deadlocks past 2 (huggingface/trl#6797); set TRAINER_GPU to 1 or 2 GPUs (or TRAINER_PROCESSES), "
                    "or ROLLOUTS=sync (edit .env)")
        if processes == 2 and sharding != "fsdp":
            return (f"ROLLOUTS=async shards 2 trainer processes with FSDP2 only (TRL's AsyncGRPOTrainer), not "
                    f"{sharding}: set TRAINER_SHARDING=fsdp (edit .env)")
        return None

    def inflight(self, cfg: Any, num_processes: int) -> int:
        """Rollouts TRL's worker keeps in flight (AsyncGRPOConfig.max_inflight_tasks), each with an env session of
        its own: MAX_INFLIGHT_ROLLOUTS, else TRL's default, max(MAX_STALENESS, 1) x the samples of one optimizer step
        (all processes)."""
        if self.max_inflight_rollouts:
            return self.max_inflight_rollouts
        return (max(self.max_staleness, 1) * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                * num_processes)

    def inflight_rule(self, cfg: Any) -> str:
        """What inflight() counted, in .env's names (preflight's line when the env servers are too few)."""
        if self.max_inflight_rollouts:
            return f"ROLLOUTS=async: MAX_INFLIGHT_ROLLOUTS {self.max_inflight_rollouts}"
        return (f"ROLLOUTS=async: MAX_STALENESS {max(self.max_staleness, 1)} x PER_DEVICE_TRAIN_BATCH_SIZE "
                f"{cfg.per_device_train_batch_size} x GRADIENT_ACCUMULATION_STEPS {cfg.gradient_accumulation_steps}")

    def session_pool(self, cfg: Any, num_processes: int) -> tuple[int, int]:
        """One pool, the rollout worker's on rank 0, one env instance per rollout in flight."""
        return self.inflight(cfg, num_processes), 1


Rollouts = SyncRollouts | AsyncRollouts
ROLLOUTS: dict[str, type[Variant]] = {"sync": SyncRollouts, "async": AsyncRollouts}


def as_rollouts(value: Rollouts | str) -> Rollouts:
    """A variant as it is, or the one a ROLLOUTS value names with its default knobs (the host reads .env's string;
    callers that hold a RunConfig pass cfg.rollouts)."""
    if isinstance(value, Variant):
        return value
    return build(ROLLOUTS, (value or "sync").strip().lower(), {})
