"""How rollouts are generated: ROLLOUTS (sync | async) and the knobs only async reads. `cfg.rollouts` is the variant,
built once when the config loads; code asks it (`cfg.rollouts.is_async`, `.max_staleness`, `.problem(...)`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, Field, TypeAdapter

from contract.config.placement import CpuMode, TrainModeVariant
from contract.config.variants import Variant, build, foreign_knob

DEFAULT_MAX_STALENESS = 4  # TRL's AsyncGRPOConfig default
DEFAULT_ADMISSION = "bounded"  # ASYNC_ADMISSION, chosen from make bench-async-stress (docs/async.md "Stale samples: drop or hold")
DEFAULT_EVAL_EPISODES = 32  # held-out episodes per env at each evaluation during training (EVAL_EVERY)


class StepShape(Protocol):
    """What the variants read of a run's batch settings (a RunConfig has them)."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    generation_batch_size: int


class SyncRollouts(Variant):
    """TRL's GRPOTrainer: generate a batch, then train on it."""

    setting: ClassVar[str] = "ROLLOUTS"
    is_async: ClassVar[bool] = False
    name: Literal["sync"] = "sync"
    # EVAL_EVERY (0: off) and EVAL_EPISODES: evaluation during training (trainer.run.evaluation), on the sessions TRL's
    # environment pool already holds
    eval_every: int = 0
    eval_episodes: int = DEFAULT_EVAL_EPISODES

    def problem(self, mode: TrainModeVariant | None, processes: int | None, sharding: str) -> str | None:
        return None

    def session_pool(self, cfg: StepShape, num_processes: int) -> tuple[int, int]:
        """(episodes in flight per pool, pools): TRL's environment pool, one per process, as big as a generation
        batch (per_device_train_batch_size x steps_per_generation)."""
        return cfg.generation_batch_size, num_processes


class AsyncRollouts(Variant):
    """TRL's AsyncGRPOTrainer: a rollout worker keeps generating while the trainer trains on what is queued."""

    setting: ClassVar[str] = "ROLLOUTS"
    is_async: ClassVar[bool] = True
    name: Literal["async"] = "async"
    max_staleness: int = DEFAULT_MAX_STALENESS
    async_step_samples: Literal["packed", "batch"] = "packed"  # packed (TRL's token budget) or batch
    max_inflight_rollouts: int | None = None  # None: TRL's default (inflight below)
    async_admission: Literal["free", "bounded"] = DEFAULT_ADMISSION  # trainer.async_grpo.admission
    # EVAL_EVERY and EVAL_EPISODES: evaluation during training, played in the trainer's process beside the rollout
    # worker's (trainer.async_grpo.async_eval), on env sessions of its own (eval_sessions)
    eval_every: int = 0
    eval_episodes: int = DEFAULT_EVAL_EPISODES

    @property
    def token_budget(self) -> int | None:
        """TRL's AsyncGRPOConfig.token_budget: None packs each step up to vLLM's max_model_len in tokens; 0 trains a
        fixed count, per_device_train_batch_size x gradient_accumulation_steps x processes, as a sync step does."""
        return 0 if self.async_step_samples == "batch" else None

    def problem(self, mode: TrainModeVariant | None, processes: int | None, sharding: str) -> str | None:
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

    def inflight(self, cfg: StepShape, num_processes: int) -> int:
        """Rollouts TRL's worker keeps in flight (AsyncGRPOConfig.max_inflight_tasks), each with an env session of
        its own: MAX_INFLIGHT_ROLLOUTS, else TRL's default, max(MAX_STALENESS, 1) x the samples of one optimizer step
        (all processes)."""
        if self.max_inflight_rollouts:
            return self.max_inflight_rollouts
        return (max(self.max_staleness, 1) * cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
                * num_processes)

    def eval_sessions(self, cfg: StepShape) -> int:
        """Env sessions the evaluation during training holds beside the worker's (EVAL_EVERY): its episodes run in the
        trainer's process, at most one step's samples (PER_DEVICE_TRAIN_BATCH_SIZE x GRADIENT_ACCUMULATION_STEPS), and
        never more than EVAL_EPISODES, at once."""
        if not self.eval_every:
            return 0
        return min(self.eval_episodes, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps)

    def inflight_rule(self, cfg: StepShape) -> str:
        """What session_pool() counted, in .env's names (preflight's line when the env servers are too few)."""
        evaluation = f" + {self.eval_sessions(cfg)} for EVAL_EVERY's episodes" if self.eval_every else ""
        if self.max_inflight_rollouts:
            return f"ROLLOUTS=async: MAX_INFLIGHT_ROLLOUTS {self.max_inflight_rollouts}{evaluation}"
        return (f"ROLLOUTS=async: MAX_STALENESS {max(self.max_staleness, 1)} x PER_DEVICE_TRAIN_BATCH_SIZE "
                f"{cfg.per_device_train_batch_size} x GRADIENT_ACCUMULATION_STEPS {cfg.gradient_accumulation_steps}"
                f"{evaluation}")

    def session_pool(self, cfg: StepShape, num_processes: int) -> tuple[int, int]:
        """One pool, the rollout worker's on rank 0, one env instance per rollout in flight; plus the evaluation's
        sessions (EVAL_EVERY), in the trainer's process on rank 0."""
        return self.inflight(cfg, num_processes) + self.eval_sessions(cfg), 1


Rollouts = Annotated[SyncRollouts | AsyncRollouts, Field(discriminator="name")]
ROLLOUT_VARIANTS = (SyncRollouts, AsyncRollouts)
_ADAPTER: TypeAdapter = TypeAdapter(Rollouts)


def rollouts_variant(name: str, flat: dict[str, Any] | None = None) -> SyncRollouts | AsyncRollouts:
    """The ROLLOUTS variant `name` names, with its knobs from the flat settings (none given: their defaults): the host
    reads .env's string once through it."""
    return build(_ADAPTER, ROLLOUT_VARIANTS, (name or "sync").strip().lower(), flat or {})


def rollouts_knob_problem(name: str, flat: dict[str, Any], defaults: dict[str, Any]) -> str | None:
    """One line when a knob of the ROLLOUTS variant this run does not use is set (it would be ignored)."""
    return foreign_knob(ROLLOUT_VARIANTS, name, flat, defaults)


class RolloutSettings(BaseModel):
    """ROLLOUTS and each variant's knobs, as .env names them (flat); RunConfig turns them into the variant."""

    # read as the .env value, held as its variant once validated (cfg.rollouts.is_async, ...)
    rollouts: Literal["sync", "async"] = Field(
        "sync", description="sync: TRL's GRPOTrainer, generate a batch then train on it (vLLM idles while the "
        "trainer trains). async: TRL's AsyncGRPOTrainer, a rollout worker keeps generating against the vLLM server "
        "while the trainer trains on what is queued (docs/async.md). async needs TRAIN_MODE=gpu (its CPU "
        "rehearsal too: `make rehearse`), 1 or 2 trainer processes, TRAINER_SHARDING=fsdp for 2."
    )
    max_staleness: int = Field(
        DEFAULT_MAX_STALENESS, ge=0, le=64, description="ROLLOUTS=async: how many weight updates a rollout may "
        "lag the trained policy and still be trained on; older ones are dropped (TRL's default, 4; 0 = strictly "
        "on-policy). Another value with ROLLOUTS=sync is refused (it would be ignored)."
    )
    async_step_samples: Literal["packed", "batch"] = Field(
        "packed", description="ROLLOUTS=async: what one optimizer step trains. packed: TRL's default, as many finished "
        "samples as fit in vLLM's max_model_len tokens (dozens to hundreds of short episodes); batch: "
        "PER_DEVICE_TRAIN_BATCH_SIZE x GRADIENT_ACCUMULATION_STEPS x processes samples, as a sync step, for "
        "comparisons step by step (make bench-async). Another value with ROLLOUTS=sync is refused."
    )
    max_inflight_rollouts: int | None = Field(None, ge=1, le=4096, description="ROLLOUTS=async: rollouts in flight "
        "at once, an env session each (TRL's max_inflight_tasks); empty: max(MAX_STALENESS, 1) x the samples of one "
        "step (TRL's default). Another value with ROLLOUTS=sync is refused.")
    async_admission: Literal["free", "bounded"] = Field(
        DEFAULT_ADMISSION, description="ROLLOUTS=async: which episodes the rollout worker starts. free: TRL's, one "
        "whenever a rollout slot is free; a sample that comes back more than MAX_STALENESS updates behind is dropped, "
        "and the slow (long) episodes are the ones that go stale. bounded: a new episode waits while it could push the "
        "oldest unfinished one past MAX_STALENESS before the trainer reaches it (docs/async.md \"Stale samples: drop or "
        "hold\": measured, it cut the samples dropped and the trained-vs-generated gap; the default). Another value with "
        "ROLLOUTS=sync is refused.")
    # evaluation during training (#66): both variants' knobs (trainer/run/evaluation.py, trainer/async_grpo/async_eval.py)
    eval_every: int = Field(0, ge=0, description="Score the policy greedily on held-out episodes every this many steps "
                            "(eval/<env>/... in metrics.jsonl, every tracker and `make report`; the best by eval reward "
                            "kept as checkpoint-best, `make export CHECKPOINT=best`). Empty or 0: off. ROLLOUTS=async "
                            "plays them beside the rollout worker, on env sessions of their own (at most one step's "
                            "samples at once).")
    eval_episodes: int = Field(DEFAULT_EVAL_EPISODES, ge=1, le=4096, description="EVAL_EVERY: held-out episodes "
                               "per env each time, one greedy episode per seed training never uses (as `make eval`'s; "
                               "an env serving its own tasks: its test split).")
