"""The generated `.stack/compose.envs.yaml`: what compose.yaml cannot say for this .env (a service per env served
here, the trainers' attachment to a fleet, GPU layouts), and its YAML. Pure but for writing that file.
"""

from __future__ import annotations

from pathlib import Path

from envs import naming
from tools import gpu_layout, settings
from tools.env_kinds import EnvKinds
from tools.images import ENV_SERVER_BUILD, compose_yaml_services, image_ref
from tools.settings import ROOT


def generated_compose_file(name: str = "compose.envs") -> Path:
    """.stack/compose.envs.yaml for .env; another env file (STACK_ENV_FILE) gets its own. `name`: another file for
    the same .env (the fleet's env-servers-only view must not overwrite the run's)."""
    suffix = "" if settings.ENV_FILE == ROOT / ".env" else f".{settings.ENV_FILE.stem}"
    return ROOT / ".stack" / f"{name}{suffix}.yaml"


class Override(list):
    """A YAML list tagged `!override`: replaces compose.yaml's list instead of being appended to it."""


class OverrideMap(dict):
    """A YAML mapping tagged `!override`: replaces compose.yaml's mapping (a depends_on) instead of merging into it."""


class Reset:
    """`!reset`: drops compose.yaml's value (`make rehearse`: the GPU reservations)."""


def yaml_text(data: dict) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(Override, lambda d, v: d.represent_sequence("!override", list(v)))
    Dumper.add_representer(OverrideMap, lambda d, v: d.represent_mapping("!override", dict(v)))
    Dumper.add_representer(Reset, lambda d, v: d.represent_scalar("!reset", ""))
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False)


def env_services(envs: EnvKinds, fleet: bool = False) -> dict[str, dict]:
    """One service per env served here, extending compose.yaml's `env-template` (the env servers' hardening, health
    check and limits): a built-in env runs our image with ENV_NAME set, any other its ENV_<NAME>_IMAGE. The trainers
    wait for them to be healthy, and the init job for the ones it learns from their servers. `fleet`
    (ENV_FLEET=swarm): no env service here, the trainers join the fleet's network instead."""
    if fleet:
        return fleet_attachments(envs)
    names = envs.served_here
    if not names:
        return {}
    services: dict[str, dict] = {}
    for n in names:
        image_var = naming.image_var(n)
        service = {
            "extends": {"file": str(ROOT / "compose.yaml"), "service": "env-template"},
            "profiles": [n],
            "image": f"${{{image_var}}}",
            "deploy": {"replicas": f"${{{naming.replicas_var(n)}:-1}}"},
            "user": f"${{{naming.user_var(n)}:-{naming.SERVER_USER}}}",
            # its server's port (tools/env_ports.py): published on loopback only, to an ephemeral host port
            # (bench/tests/debugging), and PORT for the template's health check (and a server that reads it, as ours)
            "ports": [f"127.0.0.1::{port_ref(n)}"],
            "environment": {"PORT": port_ref(n)},
        }
        if n in envs.builtin:
            service["image"] = f"${{{image_var}:-{image_ref(ENV_SERVER_BUILD)}}}"  # ours, for the stack Compose runs
            service["environment"] = {"ENV_NAME": n, **service["environment"]}
        services[naming.service_name(n)] = service
    depends = {naming.service_name(n): {"condition": "service_healthy", "required": False} for n in names}
    images = {naming.image_var(n): f"${{{naming.image_var(n)}:-}}" for n in names}  # named in preflight errors
    reach = {**images, **splits(envs.custom), **server_ports(names), **no_proxy(naming.service_name(n) for n in names)}
    for trainer in ("trainer", "trainer-cpu"):
        services[trainer] = {"depends_on": depends, "environment": reach}
    learned = {naming.service_name(n): depends[naming.service_name(n)] for n in envs.custom}
    services["model-init"] = {"environment": reach, **({"depends_on": learned} if learned else {})}
    return services


def port_ref(name: str) -> str:
    """ENV_<NAME>_PORT as Compose interpolates it: the resolved port (StackPlan.compose_vars), else the default."""
    return f"${{{naming.port_var(name)}:-{naming.PORT}}}"


def server_ports(names) -> dict[str, str]:
    """The trainers' and model-init's ENV_<NAME>_PORT: where they reach each env's servers (envs.naming.port_of)."""
    return {naming.port_var(n): port_ref(n) for n in names}


def splits(names) -> dict[str, str]:
    """ENV_<NAME>_SPLIT for the envs learned from their server: the split one serving OpenEnv's Task API trains on."""
    return {naming.split_var(n): f"${{{naming.split_var(n)}:-}}" for n in names}


def no_proxy(hosts) -> dict[str, str]:
    """NO_PROXY and no_proxy for a service that reaches these hosts besides the stack's own names (compose.yaml's
    x-no-proxy, read from the trainer): an injected HTTP(S)_PROXY must not carry traffic between the containers."""
    base = compose_yaml_services()["trainer"]["environment"]["NO_PROXY"]
    value = ",".join(dict.fromkeys([*base.split(","), *hosts]))
    return {"NO_PROXY": value, "no_proxy": value}


def fleet_attachments(envs: EnvKinds) -> dict[str, dict]:
    """ENV_FLEET=swarm: no env service here; the trainers and the init job (it plays the envs for the CPU
    warm start) also join the fleet's overlay network (added to the networks compose.yaml gives them).
    vLLM does not: its dev routes stay off it."""
    images = {naming.image_var(n): f"${{{naming.image_var(n)}:-}}" for n in envs.custom}
    reach = {**images, **splits(envs.custom), **server_ports(envs.served_here),
             **no_proxy(f"tasks.{naming.service_name(n)}" for n in envs.served_here)}

    def attach() -> dict:  # a fresh dict per service: YAML would write a shared one as an anchor
        return {"networks": {"fleet": {}}, **({"environment": dict(reach)} if reach else {})}

    return {service: attach() for service in ("trainer", "trainer-cpu", "model-init")}


def gpu_services(layout: gpu_layout.GpuLayout | None, cdi: bool) -> dict[str, dict]:
    """Device reservations compose.yaml's one-GPU-each default cannot express: several GPUs for a side
    (a list, each id its own entry), and NCCL_FAST_PATH=1's shared layout (tools/gpu_layout.py says why)."""
    if layout is None:
        return {}
    chosen = layout.mode
    default = chosen.server and len(layout.vllm) == 1 and len(layout.trainer) == 1 and not layout.fast_path
    if default or (chosen.colocated and len(layout.trainer) == 1):
        return {}
    services = {}
    for service, place in layout.placements().items():
        spec: dict = {"deploy": {"resources": {"reservations": {
            "devices": Override([gpu_layout.compose_device(place.devices, cdi)])}}}}
        if place.env:
            spec["environment"] = place.env
        if place.ipc:
            spec["ipc"] = place.ipc
        services[service] = spec
    return services


def add_lora_serving(services: dict[str, dict], cfg) -> dict[str, dict]:
    """LORA_R with ROLLOUTS=async (contract/lora_rules.py, trainer/modeling/lora.py): the vllm service serves LoRA adapters. Its command becomes
    compose.yaml's flags plus the adapter ones, it may load adapters at run time, and it reads the trainer's adapter
    folders (`<run dir>/.vllm_lora/...`) read-only at the path the trainer writes them. The same on a GPU host and in
    `make rehearse` (whose twin runs the vllm service's command); `services` unchanged when the run needs none."""
    from contract import lora_rules

    flags = lora_rules.vllm_lora_flags(cfg)
    if not flags:
        return services
    vllm = services.setdefault("vllm", {})
    vllm["command"] = Override([*compose_yaml_services()["vllm"]["command"], *flags])
    vllm["environment"] = {**vllm.get("environment", {}), **lora_rules.VLLM_LORA_ENV}
    mount = f"outputs:{cfg.output_dir.rstrip('/') or '/'}:ro"
    volumes = vllm.get("volumes")
    vllm["volumes"] = type(volumes)([*volumes, mount]) if volumes else [mount]  # an `!override` list stays one
    return services


def add_extra_vllm_flags(services: dict[str, dict], values: dict[str, str], vllm_service: bool) -> dict[str, dict]:
    """VLLM_EXTRA_ARGS (contract/vllm_flags.py, checked there: a flag the stack sets is refused) after the flags of
    the vllm service's command (compose.yaml's, plus add_lora_serving's) and of its CPU twin `vllm-cpu`; `make
    rehearse` runs the vllm service's command on the twin. `vllm_service`: the mode runs the vllm service."""
    from contract import vllm_flags

    extra = vllm_flags.parse(values.get("VLLM_EXTRA_ARGS"))
    if not extra:
        return services
    base = compose_yaml_services()
    targets = ("vllm", "vllm-cpu") if vllm_service else ("vllm-cpu",)
    for name in targets:
        spec = services.setdefault(name, {})
        # `$` escaped: Compose would interpolate it; the flags reach vLLM as written
        spec["command"] = Override([*(spec.get("command") or base[name]["command"]), *(w.replace("$", "$$") for w in extra)])
    return services


# CUDA_FORWARD_COMPAT=1 (tools/gpu_doctor.forward_compat says when it applies). vLLM 0.31 puts the image's compat
# libraries (/usr/local/cuda-<torch's CUDA>/compat) first on its library path before it imports torch
# (vllm/env_override.py); the trainer imports torch before vLLM, so its path is set at container start. NVIDIA's
# CUDA images refuse to start on an older driver (NVIDIA_REQUIRE_CUDA) unless told not to check.
CUDA_COMPAT_LIBS = "/usr/local/cuda/compat"
CUDA_COMPAT_ENV = {"VLLM_ENABLE_CUDA_COMPATIBILITY": "1", "NVIDIA_DISABLE_REQUIRE": "1"}


def add_cuda_compat(services: dict[str, dict], values: dict[str, str]) -> dict[str, dict]:
    """CUDA forward compatibility on the vllm service and the trainer (colocate's engine too), when .env asks."""
    from tools.gpu_doctor import forward_compat_on

    if not forward_compat_on(values):
        return services
    trainer_paths = [CUDA_COMPAT_LIBS, "/usr/local/nvidia/lib", "/usr/local/nvidia/lib64"]  # + the CUDA image's own
    for name, extra in (("vllm", {}), ("trainer", {"LD_LIBRARY_PATH": ":".join(trainer_paths)})):
        spec = services.setdefault(name, {})
        spec["environment"] = {**spec.get("environment", {}), **CUDA_COMPAT_ENV, **extra}
    return services


def merge_services(*parts: dict[str, dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for part in parts:
        for name, spec in part.items():
            into = out.setdefault(name, {})
            for key, value in spec.items():
                # type(value): a merged `!override` mapping stays one
                into[key] = type(value)({**into[key], **value}) if isinstance(value, dict) and isinstance(into.get(key), dict) else value
    return out


def write_compose_files(generated: dict, name: str = "compose.envs") -> list[Path]:
    """compose.yaml, plus the generated file holding `generated` (tools/plan.py: a service per env compose.yaml does
    not define, NCCL's layouts, a fleet's network) when there is any. Written on every call, so it follows .env;
    `make config` prints the whole stack."""
    if not generated.get("services"):
        return [ROOT / "compose.yaml"]
    path = generated_compose_file(name)
    path.parent.mkdir(exist_ok=True)
    text = (f"# Generated by tools/plan.py from {settings.ENV_FILE.name} (ENV_NAME, ENV_<NAME>_IMAGE, ENV_FLEET, VLLM_GPU, "
            "TRAINER_GPU, NCCL_FAST_PATH); do not edit.\n")
    path.write_text(text + yaml_text(generated))
    return [ROOT / "compose.yaml", path]
