"""RunConfig: the one typed config of a run, composed of its sections. Each section (a module of this package) holds its
settings under their flat `.env` names, their checks and what is derived from them; this class adds what crosses
sections and how the whole is loaded (environment variables, then CLI flags)."""

from __future__ import annotations

import sys
import typing
from typing import Any

from pydantic import ValidationError, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from contract import lora_rules
from contract.config.off_policy import OffPolicySettings
from contract.config.envs import EnvSettings
from contract.config.errors import ConfigError, format_validation_error
from contract.config.judge import JudgeSettings
from contract.config.model import ModelSettings
from contract.config.placement import PlacementSettings
from contract.config.rollouts import RolloutSettings, rollouts_knob_problem, rollouts_variant
from contract.config.tracking import TrackingSettings
from contract.config.training import TrainingSettings
from contract.config.variants import Variant
from contract.config.vllm import VllmSettings

# The sections, in the order their settings are listed (ENV_VARS, `python -m contract.config --names`). A new setting
# goes on the section it belongs to; a new section is a module here and one entry below.
SECTIONS = (PlacementSettings, EnvSettings, ModelSettings, TrainingSettings, TrackingSettings, VllmSettings,
            RolloutSettings, OffPolicySettings, JudgeSettings)


class RunConfig(*reversed(SECTIONS), BaseSettings):  # type: ignore[misc]  # pydantic lists the last base's fields first
    """Every knob of a run. Field name upper-cased = environment variable; kebab-cased = CLI flag."""

    model_config = SettingsConfigDict(
        case_sensitive=False,
        env_ignore_empty=True,  # compose passes unset variables as empty strings
        extra="ignore",
        validate_default=True,
    )

    @field_validator("rollouts", mode="before")
    @classmethod
    def _rollouts_by_name(cls, value: Any) -> Any:
        return value.name if isinstance(value, Variant) else value  # a variant handed back: its .env value

    @field_serializer("rollouts")
    def _rollouts_name(self, value: Variant | str) -> str:
        return str(value)  # run.json, `python -m contract.config`: the .env value, as before

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfig":
        problem = self.env_urls_problem()
        if problem:
            raise ValueError(problem)
        # ROLLOUTS chosen once: from here on `self.rollouts` is the variant, carrying its own knobs
        fields = type(self).model_fields
        flat = {name: getattr(self, name) for name in fields}
        problem = rollouts_knob_problem(self.rollouts, flat, {k: fields[k].default for k in flat})
        if problem:
            raise ValueError(problem)
        self.rollouts = rollouts_variant(self.rollouts, flat)
        problem = self.rollouts_problem(self.trainer_processes) or self.lora_problem() or self.batch_problem()
        if problem:
            raise ValueError(problem)
        return self

    def rollouts_problem(self, processes: int | None) -> str | None:
        """Why ROLLOUTS cannot run here with `processes` trainer processes (None: not known yet; nor is the mode while
        TRAIN_MODE=auto: the launcher asks again once it has resolved both), as one line; None if it can."""
        mode = self.placement if self.placement_known else None
        return self.rollouts.problem(mode, processes, self.trainer_sharding)

    def lora_problem(self) -> str | None:
        """One line naming what to change when the LoRA settings cannot work together (None: they can); the rules
        that need the mode are asked once TRAIN_MODE is resolved (train.py asks again then)."""
        return lora_rules.problem(self, self.placement if self.placement_known else None)

    def sessions_needed(self, env_name: str, env_rows: int | None = None, num_processes: int = 1) -> int:
        """Sessions TRL 1.16 opens on one env, as its environment pool grows (preflight checks them against the
        servers; the host sizes ENV_<NAME>_REPLICAS=auto by them).

        Per process the pool of an env grows to the most rollouts of that env in one generation batch
        (per_device_train_batch_size x steps_per_generation completions) and is never shrunk or closed.
        Single env: the whole generation batch. Multi-env: a batch holds gen_batch / num_generations
        prompts, each repeated num_generations times; at worst all of them are this env's (capped by how
        many distinct rows the env has: `env_rows`, else DATASET_SIZE)."""
        gen_batch, num_processes = self.rollouts.session_pool(self, num_processes)  # async: one, the worker's
        if len(self.env_names) > 1:
            prompts_per_batch = gen_batch // self.num_generations
            rows = env_rows if env_rows is not None else self.dataset_size
            gen_batch = self.num_generations * min(prompts_per_batch, rows)
        return gen_batch * num_processes

    def shared_trainer_kwargs(self) -> dict[str, Any]:
        """What GRPOConfig (ROLLOUTS=sync; trainer.core.grpo_args) and AsyncGRPOConfig (async) both take from the run's
        settings, so the two trainers read one list. TRAIN_MODE resolved (the learning rate's default depends on it)."""
        return dict(**self.tracking_kwargs(), **self.training_kwargs(),
                    chat_template_kwargs=self.chat_template_kwargs())

    # ------------------------------------------------------------------ loading
    @classmethod
    def accepts_none(cls, field: str) -> bool:
        """Whether `field` takes None (empty in .env) as a value of its own rather than falling back to its default."""
        annotation = cls.model_fields[field].annotation
        return annotation is None or type(None) in typing.get_args(annotation)

    @classmethod
    def load(cls, argv: list[str] | None = None, **overrides: Any) -> "RunConfig":
        """Environment variables, then CLI flags (`--max-steps 3`). Raises ConfigError with a clear message."""
        argv = sys.argv[1:] if argv is None else list(argv)
        try:
            if argv:
                cli = CliSettingsSource(cls, cli_parse_args=argv, cli_kebab_case=True, cli_exit_on_error=False,
                                        cli_prog_name="python -m trainer.train")
                return cls(_cli_settings_source=cli(args=argv), **overrides)
            return cls(**overrides)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None
        except SystemExit:  # argparse on --help
            raise
        except Exception as exc:  # argparse errors from the CLI source (unknown flag, missing value)
            if type(exc).__name__ in ("SettingsError", "ArgumentError"):
                raise ConfigError(f"command line: {exc} (see `python -m trainer.train --help`)") from None
            raise


def default(field: str) -> Any:
    """A RunConfig field's default: the one place every other module takes it from."""
    return RunConfig.model_fields[field].default


ENV_VARS: tuple[str, ...] = tuple(name.upper() for name in RunConfig.model_fields)


def describe() -> list[dict[str, str]]:
    """One row per variable (name, default, description)."""
    rows = []
    for name, field in RunConfig.model_fields.items():
        shown = "" if field.default is None else str(field.default)
        rows.append({"name": name.upper(), "default": shown, "description": field.description or ""})
    return rows
