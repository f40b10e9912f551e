"""One typed config for a training run: environment variables, then CLI overrides.

Light on purpose: only pydantic / pydantic-settings / stdlib and `envs.registry`, so the host-side
`make doctor` can validate `.env` without torch (`python -m contract.config --check`).

    RunConfig.load()                      # env vars + sys.argv[1:]
    RunConfig.load(["--max-steps", "3"])  # CLI overrides win over env vars
    ENV_VARS                              # every variable name, in one place (docs/configuration.md, tests)

The settings live in sections, one module each (`.env` keeps its flat names; each is declared once, on its section):
placement (TRAIN_MODE: cfg.placement, the resolved cpu | gpu | colocate variant), envs, model (cfg.lora: LoraSettings
or None), training, tracking, vllm, rollouts (cfg.rollouts: the sync | async variant). run_config composes them.
"""

from contract.config.envs import known_envs
from contract.config.errors import ConfigError, format_validation_error
from contract.config.model import CPU_DEFAULT_MODEL, GPU_DEFAULT_MODEL, LoraSettings, is_hub_id, local_snapshot
from contract.config.placement import ColocateMode, CpuMode, GpuMode, TrainMode, TrainModeVariant, train_mode_variant
from contract.config.rollouts import AsyncRollouts, Rollouts, SyncRollouts, rollouts_variant
from contract.config.run_config import ENV_VARS, SECTIONS, RunConfig, default, describe
from contract.config.training import CPU_DEFAULT_LR, GPU_DEFAULT_LR

__all__ = [
    "AsyncRollouts", "CPU_DEFAULT_LR", "CPU_DEFAULT_MODEL", "ColocateMode", "ConfigError", "CpuMode", "ENV_VARS",
    "GPU_DEFAULT_LR", "GPU_DEFAULT_MODEL", "GpuMode", "LoraSettings", "RunConfig", "Rollouts", "SECTIONS",
    "SyncRollouts", "TrainMode", "TrainModeVariant", "default", "describe", "format_validation_error", "is_hub_id",
    "known_envs", "local_snapshot", "rollouts_variant", "train_mode_variant",
]
