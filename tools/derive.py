"""What `.env` means for the stack, derived without running anything: the envs by kind (ENV_NAME and ENV_URLS parsed
once, into EnvKinds), the mode, the trainer's typed config, the GPU layout, the replica counts Compose reads.

No Docker call and no file written (tools/docker_host.py does both); a bad value raises StackError with its fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from envs import naming
from tools import env_replicas, gpu_doctor, gpu_layout, settings
from tools.errors import StackError, parse_env_file
from tools.settings import ROOT
from contract.config import TrainModeVariant, train_mode_variant
from contract.train_mode import MODES, TrainModeError, resolve_train_mode  # stdlib only


@dataclass(frozen=True)
class EnvKinds:
    """ENV_NAME's envs by where they are served: ENV_NAME, ENV_URLS and each ENV_<NAME>_IMAGE parsed once."""

    names: tuple[str, ...]          # every env of the run, in ENV_NAME's order
    builtin: tuple[str, ...]        # built in, served here by our image
    custom: tuple[str, ...]         # an OpenEnv image named in ENV_<NAME>_IMAGE, served here
    external: dict[str, str]        # ENV_URLS: a server somewhere else (no service here)
    images: dict[str, str] = field(default_factory=dict)  # ENV_<NAME>_IMAGE as set in .env, by env name

    @property
    def served_here(self) -> tuple[str, ...]:
        """The envs that get a service here (built in or custom), in ENV_NAME's order."""
        return tuple(n for n in self.names if n in self.builtin or n in self.custom)


def env_kinds(values: dict[str, str]) -> EnvKinds:
    """ENV_NAME's names by kind; each is built in, has its image in ENV_<NAME>_IMAGE, or a server in ENV_URLS."""
    from envs import registry

    names = naming.parse_names(values.get("ENV_NAME", "echo"))
    try:
        naming.check_names(names, registry.names())
    except ValueError as exc:
        raise StackError(f"ENV_NAME: {exc}") from None
    try:
        urls = naming.parse_urls(values.get("ENV_URLS"))
    except ValueError as exc:
        raise StackError(f"ENV_URLS: {exc}") from None
    images = {n: values[naming.image_var(n)] for n in names if values.get(naming.image_var(n))}
    for n in names:
        if not registry.is_builtin(n) and n not in images and n not in urls:
            raise StackError(
                f"ENV_NAME: {n!r} is not built in ({', '.join(registry.names())}): to train on any OpenEnv image, "
                f"set {naming.image_var(n)}=<image> in .env (or point ENV_URLS at a running server: "
                f"{n}=http://host:8000); or fix the name in .env"
            )
    return EnvKinds(
        names=tuple(names),
        builtin=tuple(n for n in names if registry.is_builtin(n) and n not in urls),
        custom=tuple(n for n in names if not registry.is_builtin(n) and n not in urls),
        external={n: u for n, u in urls.items() if n in names},
        images=images,
    )


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
