"""What `.env` means for the stack, derived without running anything: the mode, the trainer's typed config, the GPU
layout, the replica counts Compose reads (the envs by kind: tools/env_kinds.py).

No Docker call and no file written (tools/docker_host.py does both); a bad value raises StackError with its fix.
"""

from __future__ import annotations

import json
from pathlib import Path

from envs import naming
from tools import env_replicas, gpu_doctor, gpu_layout, settings
from tools.env_kinds import EnvKinds
from tools.errors import StackError, parse_env_file
from tools.settings import ROOT
from contract.config import TrainModeVariant, train_mode_variant
from contract.train_mode import MODES, TrainModeError, resolve_train_mode  # stdlib only


def fleet_mode(values: dict[str, str]) -> bool:
    return (values.get("ENV_FLEET") or "compose") == "swarm"


def fleet_stack_name(values: dict[str, str]) -> str:
    """The fleet's Swarm stack, and its overlay network's name (tools/fleet.py deploys it)."""
    return values.get("FLEET_STACK") or "grpo-fleet"


def resolve_mode(values: dict[str, str], gpus: gpu_doctor.DockerGpus | None) -> tuple[TrainModeVariant, str]:
    """(mode, one line saying why) for TRAIN_MODE in .env on a host with `gpus` (None: none found, not probed): the
    host's one resolution of TRAIN_MODE=auto, into the variant (with its knobs from .env) every host function takes."""
    want = (values.get("TRAIN_MODE") or "auto").strip().lower()
    if want not in MODES:
        raise StackError(f"TRAIN_MODE: unknown value {want!r}; choose from {', '.join(MODES)} and edit .env")
    try:
        name, why = resolve_train_mode(want, gpus.count if gpus else 0, found=gpus.detail if gpus else "")
    except TrainModeError as exc:
        raise StackError(str(exc)) from None
    try:
        mode = train_mode_variant(name, {k.lower(): v for k, v in values.items() if v})
    except ValueError:  # a bad knob (WEIGHT_TRANSFER=...): validate_run_config names it; the layout needs none
        mode = train_mode_variant(name)
    spec = mode.spec
    if spec.runs_vllm_service:
        why += (f"; vLLM on GPU {values.get('VLLM_GPU') or spec.vllm_gpu_default}, trainer on GPU "
                f"{values.get('TRAINER_GPU') or spec.trainer_gpu_default}")
    return mode, why


def run_config(values: dict[str, str], mode: TrainModeVariant | None):
    """The trainer's typed config (contract.config.RunConfig, light imports only) from .env's values, with TRAIN_MODE
    resolved to `mode` (None: as .env says, `auto` left unresolved)."""
    from contract.config import RunConfig

    keys = set(parse_env_file(settings.ENV_EXAMPLE))
    chosen = {k: v for k, v in values.items() if k in keys and v != ""}
    if mode is not None:
        chosen["TRAIN_MODE"] = mode.name
    return RunConfig(**{k.lower(): v for k, v in chosen.items() if k.lower() in RunConfig.model_fields})


def validate_run_config(values: dict[str, str], mode: TrainModeVariant) -> str | None:
    """Validate .env against the trainer's typed config."""
    from pydantic import ValidationError

    try:
        run_config(values, mode)
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors()]
        return "invalid .env values: " + "; ".join(lines) + " (edit .env)"
    except (ValueError, SystemExit) as e:
        return f"invalid .env values: {e} (edit .env)"
    return None


def colocated_flags_problem(values: dict[str, str], mode: TrainModeVariant) -> str | None:
    """TRAIN_MODE=colocate: VLLM_EXTRA_ARGS must map onto the engine TRL builds in the trainer (contract/vllm_flags.py
    says which cannot); one line, or None."""
    from contract import vllm_flags

    if not mode.colocated:
        return None
    try:
        vllm_flags.engine_kwargs(vllm_flags.parse(values.get("VLLM_EXTRA_ARGS")))
    except ValueError as exc:
        return f"VLLM_EXTRA_ARGS: {exc}"
    return None


def gpu_layout_for(values: dict[str, str], mode: TrainModeVariant,
                   gpus: gpu_doctor.DockerGpus | None = None) -> gpu_layout.GpuLayout | None:
    """The GPU layout of a gpu/colocate run (None on CPU); a bad GPU list stops with its fix."""
    if not mode.uses_vllm:
        return None
    try:
        return gpu_layout.plan(values, mode, {g.uuid: int(g.index) for g in (gpus.gpus if gpus else [])})
    except gpu_layout.LayoutError as exc:
        raise StackError(str(exc)) from None


# ------------------------------------------------------------------ ENV_<NAME>_REPLICAS=auto
def last_counts_file() -> Path:
    """.stack/replicas.json: the counts `make up` resolved for .env (another env file gets its own)."""
    suffix = "" if settings.ENV_FILE == ROOT / ".env" else f".{settings.ENV_FILE.stem}"
    return ROOT / ".stack" / f"replicas{suffix}.json"


def auto_replica_envs(envs: EnvKinds, values: dict[str, str]) -> list[str]:
    try:
        return env_replicas.auto_envs(values, list(envs.custom), list(envs.builtin))
    except env_replicas.ReplicasError as exc:
        raise StackError(str(exc)) from None


def replica_counts(envs: EnvKinds, values: dict[str, str]) -> dict[str, str]:
    """What Compose interpolates as ENV_<NAME>_REPLICAS for each env served here: a number as given (in .env, or
    resolved by docker_host.resolve_auto_replicas), else (`auto`) the count `make up` last resolved, else 1, so
    `make ps`, `make logs`, ... read a valid file without measuring."""
    auto = set(auto_replica_envs(envs, values))
    try:
        last = json.loads(last_counts_file().read_text())
    except (OSError, ValueError):
        last = {}
    out = {}
    for name in [*envs.custom, *envs.builtin]:
        var = naming.replicas_var(name)
        value = (values.get(var) or "").strip()
        if value.isdigit():
            out[var] = value
        elif name in auto:
            out[var] = str(last.get(var, 1))
    return out
