"""The host's one `.env` reader: StackEnv (pydantic-settings over python-dotenv's parser, as Compose reads the file),
typed, with every other key kept as given. ENV_FILE is the file the stack uses (STACK_ENV_FILE lets tests and users
with several setups point at another), else .env.example before `make` copies it."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from tools.errors import StackError, parse_env_file

ROOT = Path(__file__).resolve().parent.parent
ENV_FILE = Path(os.environ.get("STACK_ENV_FILE") or ROOT / ".env")
ENV_EXAMPLE = ROOT / ".env.example"
WHEELS = ROOT / ".wheels"  # CPU images take torch from here when a CPU wheel is on this machine
# A Compose project name that is also an image name's first part (Docker's: no leading, trailing or doubled separator).
STACK_NAME_PATTERN = r"^[a-z0-9]+(?:[_-][a-z0-9]+)*$"


def checkout_stack_name(root: Path = ROOT) -> str:
    """This checkout's STACK_NAME when .env sets none: its folder's name, lowercased, each run of other characters
    one '-' (as Compose's own default is the folder's name), so two checkouts are two stacks; `grpo-stack` when the
    name holds no letter or digit."""
    return "-".join(re.findall(r"[a-z0-9]+", root.resolve().name.lower())) or "grpo-stack"


class StackEnv(BaseSettings):
    """The host's view of `.env`, read once (what decides what runs; the trainer validates its own
    knobs with contract.config.RunConfig). Process variables win over the file, as in Compose. Every
    other key (ENV_<NAME>_IMAGE, ENV_<NAME>_REPLICAS, ...) is kept as given, in `values`."""

    model_config = SettingsConfigDict(case_sensitive=True, extra="ignore", env_ignore_empty=True)

    TRAIN_MODE: str = "auto"
    ENV_NAME: str = "echo"
    ENV_URLS: str = ""
    # The descriptions are docs/configuration.md's (tools/commands/config_docs.py); the trainer's knobs are RunConfig's.
    DASHBOARD: bool = Field(False, description="`1` starts the dashboard (TensorBoard, or trackio's UI) with "
                            "`make up`/`make train`")
    DASHBOARD_PORT: Optional[int] = Field(6006, ge=1, le=65535, description="the dashboard's port on 127.0.0.1")
    HF_TOKEN_FILE: str = Field("./.secrets/hf_token", description="file holding your Hugging Face token (a Compose "
                               "secret, never an env var)")
    # empty: the mode's default (contract.train_mode.MODE_SPECS)
    VLLM_GPU: str = Field("", description="GPU(s) for vllm: an id, a list `0,1` or a range `0-3`")
    TRAINER_GPU: str = Field("", description="GPU(s) for the trainer, one process each: an id, a list or a range `4-7`")
    # the judge service (JUDGE_MODEL set; tools/judge.py resolves the empty defaults, `make doctor` checks them)
    JUDGE_GPU: str = Field("", description="GPU for the judge service (JUDGE_MODEL): one id; empty: vLLM's first GPU "
                           "(TRAIN_MODE=gpu) or the trainer's (colocate), shared with a memory split "
                           "([Serving the judge](judge.md#serving-the-judge))")
    JUDGE_GPU_MEMORY_SHARE: Optional[float] = Field(
        None, gt=0, lt=1, description="the judge's share of its GPU's memory (its vLLM --gpu-memory-utilization); "
        "empty: 0.9 on a GPU of its own, 0.3 on a shared one (vLLM's share then defaults to 0.6)")
    JUDGE_MAX_MODEL_LEN: Optional[int] = Field(8192, ge=256, description="the judge's context in tokens: the rubric "
                                               "and a whole episode's transcript (ranking: a group's)")
    JUDGE_API_KEY_FILE: str = Field("", description="`JUDGE_URL`: file holding its API key (a Compose secret mounted "
                                    "into the trainers, never an env var, a log or `make config`); empty: no key")
    VLLM_PARALLEL: Literal["tensor", "data"] = Field(
        "tensor", description="how vLLM uses several GPUs: `tensor` (one model split over them) or `data` (a copy per "
        "GPU)")
    STACK_NAME: str = Field("", pattern=f"^$|{STACK_NAME_PATTERN}", description=(  # "": the checkout's
        "this checkout's stack: its Compose project (containers, networks, volumes) and the first part of the image "
        "tags built here; empty: the checkout folder's name (lowercase letters, digits, '-'), so two checkouts on "
        "one host are two stacks (`grpo-stack` reuses what checkouts made before this setting)"))
    ENV_FLEET: Literal["compose", "swarm"] = "compose"
    FLEET_STACK: str = Field("grpo-fleet", pattern=r"^[a-zA-Z0-9][a-zA-Z0-9_-]*$",
                             description="the fleet's Swarm stack and overlay network name")
    CUDA_FORWARD_COMPAT: bool = Field(  # tools/gpu_doctor.forward_compat, tools/compose_file.add_cuda_compat
        False, description="`1`: datacenter GPUs (H100, H200, A100, L40S, ...) on driver R535-R570 run the CUDA 13 "
        "images through CUDA forward compatibility (`make doctor` says when it applies; consumer GPUs need R580+)")
    FLEET_ALLOW_NEW_PRIVILEGES: bool = Field(  # tools/fleet.py
        False, description="`1`: deploy the fleet where a node's daemon does not set no-new-privileges (setuid "
        "binaries in an env image can then regain privileges)")
    values: dict[str, str] = Field(default_factory=dict, exclude=True)

    @property
    def stack_name(self) -> str:
        """STACK_NAME, else this checkout's (checkout_stack_name)."""
        return self.STACK_NAME or checkout_stack_name()

    @property
    def project(self) -> str:
        """The Compose project the stack's containers are in: STACK_NAME's, unless COMPOSE_PROJECT_NAME (Compose's own
        setting, which wins over compose.yaml's `name:`; the tests' grpo-test-* projects) says another."""
        return self.values.get("COMPOSE_PROJECT_NAME") or self.stack_name

    @classmethod
    def load(cls, path: Path) -> "StackEnv":
        values = parse_env_file(path)
        # As in Compose, a process variable wins over the file: for the file's keys, the typed ones, and every ENV_*
        # one (an ENV_<NAME>_IMAGE or _REPLICAS may be set only in the environment), and Compose's COMPOSE_PROJECT_NAME.
        extra = ("COMPOSE_PROJECT_NAME", *(k for k in os.environ if k.startswith("ENV_")))
        for key in {*values, *cls.model_fields, *extra}:
            if key in os.environ and key != "values":
                values[key] = os.environ[key]
        return cls.from_values(values)

    @classmethod
    def from_values(cls, values: dict[str, str]) -> "StackEnv":
        """These values as they are (no process variable read), typed; a bad one is a StackError with its fix."""
        typed = {k: v for k, v in values.items() if k in cls.model_fields and v != ""}
        try:
            return cls(_env_prefix="__stack_none__", values=values, **typed)  # the file (+ overrides) only
        except ValidationError as exc:
            raise StackError("; ".join(f"{err['loc'][0]}: {err['msg']} (got {err.get('input')!r}); edit .env"
                                       for err in exc.errors())) from None


def load() -> StackEnv:
    """ENV_FILE (else .env.example), typed."""
    return StackEnv.load(ENV_FILE if ENV_FILE.exists() else ENV_EXAMPLE)


def load_env() -> dict[str, str]:
    """The same values as strings, every key included (ENV_<NAME>_IMAGE, ...)."""
    return load().values
