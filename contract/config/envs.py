"""The envs a run trains on: ENV_NAME, where their servers are, how their prompts are made, and the limits on the
calls made to them."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from envs import naming
from envs.core.settings import DEFAULT_MAX_CONCURRENT_ENVS


def known_envs() -> tuple[str, ...]:
    from envs import registry  # light by contract (no heavy deps)

    return registry.names()


class EnvSettings(BaseModel):
    """ENV_NAME and everything about the env servers and the calls to them."""

    env_name: str = Field(
        "echo", description="Environment(s) to train on: one name or a comma list (multi-env). Built in: echo, "
        "wordle, catch; any other name is an OpenEnv server whose tools are learned at start (its image in "
        "ENV_<NAME>_IMAGE, docs/environments.md \"Bring your own environment\")."
    )
    env_urls: str | None = Field(
        None, description="Override env server URLs, e.g. `echo=http://env-echo:8000,wordle=http://host:9000`; "
        "default `http://env-<name>:<port>` (`ENV_<NAME>_PORT`, else the image's EXPOSE, else 8000)."
    )
    env_fleet: Literal["compose", "swarm"] = Field(
        "compose", description="Where the env servers run: `compose` = replicas on this host; `swarm` = a Docker "
        "Swarm fleet across machines (`make fleet-up`, docs/fleets.md): the trainer joins its overlay "
        "network and spreads sessions over its tasks."
    )
    tool_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="A tool call that runs longer fails: the model sees the error, and the "
        "rollout's env session is closed (a fresh one opens at its next reset). Bounded by default so a hung env "
        "cannot stall a run for ever; raise it for tools that legitimately take longer (a test suite, a build)."
    )
    reset_timeout_s: float = Field(
        120.0, gt=0, le=86400, description="An env's answer to one reset (its episode setup) may take this long; "
        "past it the reset fails and its session is closed."
    )
    tool_concurrency: int | None = Field(
        None, ge=1, description="Most tool calls in flight at once per trainer process. Empty: a whole round, every "
        "rollout that called a tool (one rollout's calls always run in the model's order). Lower it for a fragile env."
    )
    dataset_size: int = Field(256, ge=1, description="Prompts generated per environment.")
    max_concurrent_envs: int = Field(
        DEFAULT_MAX_CONCURRENT_ENVS, ge=1, description="Sessions each env server container accepts (ours, and upstream images that read "
        "it); preflight checks what each server reports, or counts it by opening sessions."
    )
    env_instruction: str | None = Field(
        None, description="Envs learned from their server: the instruction each prompt starts with (the env's "
        "reset observation follows). Empty: a generic 'act through the tools' instruction."
    )
    env_prompts_file: str | None = Field(
        None, description="Envs learned from their server: a JSONL file put in ./prompts/ and named as "
        "/prompts/<file>.jsonl (the trainer container's path), one row per line "
        "{\"prompt\": text or messages, \"reset\": {reset kwargs}, \"environment\": name (optional)}; replaces "
        "ENV_INSTRUCTION."
    )
    env_reward: Literal["sum", "last"] = Field(
        "sum", description="Envs learned from their server: an episode's reward is the sum of its step rewards, or "
        "the last one."
    )
    env_observation_chars: int = Field(
        2000, ge=100, description="Observations, tool results and env errors shown to the model are trimmed to this "
        "many characters (every env; envs learned from their server format theirs within it)."
    )

    @field_validator("env_name")
    @classmethod
    def _check_env_name(cls, value: str) -> str:
        names = naming.parse_names(value)
        naming.check_names(names, known_envs())
        return ",".join(names)

    @field_validator("env_urls")
    @classmethod
    def _check_env_urls(cls, value: str | None) -> str | None:
        naming.parse_urls(value)
        return value

    def env_urls_problem(self) -> str | None:
        """One line when ENV_URLS names an env ENV_NAME does not train on."""
        unknown = set(self.env_url_overrides) - set(self.env_names)
        if unknown:
            return (f"ENV_URLS names {', '.join(sorted(unknown))}, which ENV_NAME={self.env_name} does not train on; "
                    "drop it from ENV_URLS or add it to ENV_NAME (edit .env)")
        return None

    @property
    def env_names(self) -> list[str]:
        return self.env_name.split(",")

    @property
    def env_url_overrides(self) -> dict[str, str]:
        return naming.parse_urls(self.env_urls)

    def env_url(self, name: str) -> str:
        """ENV_URLS' URL, else the env service's (Compose replicas or Swarm tasks) on its ENV_<NAME>_PORT: envs.naming."""
        port = naming.port_of(name, os.environ)
        return self.env_url_overrides.get(name) or naming.service_url(name, self.env_fleet == "swarm", port)

    def generic_env_options(self, name: str | None = None) -> dict[str, Any]:
        """How envs learned from their server are prompted and scored (envs.generic.GenericSpec's options); with the
        env's `name`, the split it trains on where it serves the Task API (ENV_<NAME>_SPLIT, passed in by Compose)."""
        options: dict[str, Any] = {"prompts_file": self.env_prompts_file, "reward": self.env_reward,
                                   "observation_chars": self.env_observation_chars}
        if self.env_instruction:
            options["instruction"] = self.env_instruction
        split = os.environ.get(naming.split_var(name), "").strip() if name else ""
        if split:
            options["split"] = split
        return options
