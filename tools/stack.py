"""The stack as .env describes it: settings, envs by kind, the generated compose file, host checks, compose calls.

It only decides *what* runs (profiles, mode, services, replica counts); Compose does the running, and the commands
in tools/commands/ drive both. `.env` is read once, by tools/settings.py; the training knobs are validated with the
trainer's own typed config, contract.config.RunConfig.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

from envs import naming
from tools import env_replicas, gpu_doctor, gpu_layout, settings
from tools.errors import StackError, parse_env_file, say  # noqa: F401  (re-exported: the host's names)
from tools.settings import ROOT, load_env
from contract.train_mode import MODES, TrainModeError, resolve_train_mode  # stdlib only
from contract.train_mode import spec as mode_spec  # noqa: F401  (the TRAIN_MODE table, for the commands)

WHEELS = ROOT / ".wheels"
MIN_COMPOSE = (2, 24, 4)  # `!override` in the generated compose file (profiles and `required: false` are older)
# Commands run in the trainer images: vLLM's runtime image (the GPU trainer's base) installs `python3` only.
TRAINER_PYTHON = ("python3",)
LOCAL_ENV_IMAGE = "grpo-stack/env-server:local"


def setup() -> None:
    """Create what a fresh checkout lacks: .env, the (empty) HF token secret, the torch wheel."""
    if not settings.ENV_FILE.exists():
        shutil.copyfile(settings.ENV_EXAMPLE, settings.ENV_FILE)
        say("created .env from .env.example (edit it to change env, model or mode)")
    token_file = Path(load_env().get("HF_TOKEN_FILE") or ".secrets/hf_token")
    token_file = token_file if token_file.is_absolute() else ROOT / token_file
    if not token_file.exists():
        # Compose bind-mounts a file secret with the host file's mode, so the containers' uid 10001
        # needs o+r on the file; the 0700 directory keeps other host users out instead.
        token_file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        token_file.touch()
        token_file.chmod(0o644)
    # CPU images take torch from .wheels/ when a CPU wheel is on this machine (pip's find-links).
    WHEELS.mkdir(exist_ok=True)
    if not glob.glob(str(WHEELS / "torch-*.whl")):
        for d in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
            for whl in glob.glob(os.path.join(d, "torch-2.13.0*cpu*.whl")):
                shutil.copy2(whl, WHEELS)
                say(f"using local torch wheel {os.path.basename(whl)} for CPU images")


def env_names(dotenv: dict[str, str]) -> list[str]:
    """ENV_NAME's names; each is built in, has its image in ENV_<NAME>_IMAGE, or a server in ENV_URLS."""
    from envs import registry

    names = naming.parse_names(dotenv.get("ENV_NAME", "echo"))
    try:
        naming.check_names(names, registry.names())
    except ValueError as exc:
        raise StackError(f"ENV_NAME: {exc}") from None
    urls = external_env_urls(dotenv)
    for n in names:
        if not registry.is_builtin(n) and not dotenv.get(naming.image_var(n)) and n not in urls:
            raise StackError(
                f"ENV_NAME: {n!r} is not built in ({', '.join(registry.names())}): to train on any OpenEnv image, "
                f"set ENV_{n.upper()}_IMAGE=<image> in .env (or point ENV_URLS at a running server: "
                f"{n}=http://host:8000); or fix the name in .env"
            )
    return names


def external_env_urls(dotenv: dict[str, str]) -> dict[str, str]:
    try:
        return naming.parse_urls(dotenv.get("ENV_URLS"))
    except ValueError as exc:
        raise StackError(f"ENV_URLS: {exc}") from None


def custom_envs(dotenv: dict[str, str]) -> list[str]:
    """Envs of this run served by an image named in .env (not built in, not an external ENV_URLS server)."""
    from envs import registry

    urls = external_env_urls(dotenv)
    return [n for n in env_names(dotenv) if not registry.is_builtin(n) and n not in urls]


# ------------------------------------------------------------------ compose files
def generated_compose_file(name: str = "compose.envs") -> Path:
    """.stack/compose.envs.yaml for .env; another env file (STACK_ENV_FILE) gets its own. `name`: another file for
    the same .env (the fleet's env-servers-only view must not overwrite the run's)."""
    suffix = "" if settings.ENV_FILE == ROOT / ".env" else f".{settings.ENV_FILE.stem}"
    return ROOT / ".stack" / f"{name}{suffix}.yaml"


def generated_envs(dotenv: dict[str, str]) -> list[str]:
    """The run's envs served here, built in or an image named in .env: each gets a generated service (compose.yaml
    holds only their template)."""
    urls = external_env_urls(dotenv)
    return [n for n in env_names(dotenv) if n not in urls]


@functools.lru_cache(maxsize=1)
def compose_yaml_services() -> dict[str, dict]:
    """The services compose.yaml defines, parsed (anchors and merge keys resolved), not searched for as text."""
    import yaml

    return (yaml.safe_load((ROOT / "compose.yaml").read_text()) or {}).get("services") or {}


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


def env_services(dotenv: dict[str, str]) -> dict[str, dict]:
    """One service per env served here, extending compose.yaml's `env-template` (the env servers' hardening, health
    check and limits): a built-in env runs our image with ENV_NAME set, any other its ENV_<NAME>_IMAGE. The trainers
    wait for them to be healthy, and the init job for the ones it learns from their servers."""
    from envs import registry

    if fleet_mode(dotenv):
        return fleet_attachments(dotenv)
    names = generated_envs(dotenv)
    if not names:
        return {}
    services: dict[str, dict] = {}
    for n in names:
        var = f"ENV_{n.upper()}"
        service = {
            "extends": {"file": str(ROOT / "compose.yaml"), "service": "env-template"},
            "profiles": [n],
            "image": f"${{{var}_IMAGE}}",
            "deploy": {"replicas": f"${{{var}_REPLICAS:-1}}"},
            "user": f"${{{naming.user_var(n)}:-{naming.SERVER_USER}}}",
        }
        if registry.is_builtin(n):
            service.update(image=f"${{{var}_IMAGE:-{LOCAL_ENV_IMAGE}}}", environment={"ENV_NAME": n})
        services[naming.service_name(n)] = service
    depends = {naming.service_name(n): {"condition": "service_healthy", "required": False} for n in names}
    images = {naming.image_var(n): f"${{ENV_{n.upper()}_IMAGE:-}}" for n in names}  # named in preflight errors
    for trainer in ("trainer", "trainer-cpu"):
        services[trainer] = {"depends_on": depends, "environment": images}
    learned = {naming.service_name(n): depends[naming.service_name(n)] for n in names if not registry.is_builtin(n)}
    services["model-init"] = {"environment": images, **({"depends_on": learned} if learned else {})}
    return services


def fleet_mode(dotenv: dict[str, str]) -> bool:
    return (dotenv.get("ENV_FLEET") or "compose") == "swarm"


def fleet_stack_name(dotenv: dict[str, str]) -> str:
    """The fleet's Swarm stack, and its overlay network's name (tools/fleet.py deploys it)."""
    return dotenv.get("FLEET_STACK") or "grpo-fleet"


def fleet_attachments(dotenv: dict[str, str]) -> dict[str, dict]:
    """ENV_FLEET=swarm: no env service here; the trainers and the init job (it plays the envs for the CPU
    warm start) also join the fleet's overlay network (added to the networks compose.yaml gives them).
    vLLM does not: its dev routes stay off it."""
    images = {naming.image_var(n): f"${{ENV_{n.upper()}_IMAGE:-}}" for n in custom_envs(dotenv)}

    def attach() -> dict:  # a fresh dict per service: YAML would write a shared one as an anchor
        return {"networks": {"fleet": {}}, **({"environment": dict(images)} if images else {})}

    return {service: attach() for service in ("trainer", "trainer-cpu", "model-init")}


def gpu_services(layout: gpu_layout.Plan | None, cdi: bool) -> dict[str, dict]:
    """Device reservations compose.yaml's one-GPU-each default cannot express: several GPUs for a side
    (a list, each id its own entry), and NCCL_FAST_PATH=1's shared layout (tools/gpu_layout.py says why)."""
    if layout is None:
        return {}
    default = layout.mode == "gpu" and len(layout.vllm) == 1 and len(layout.trainer) == 1 and not layout.fast_path
    if default or (layout.mode == "colocate" and len(layout.trainer) == 1):
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


def run(cmd: list[str], timeout: float = 20) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return subprocess.CompletedProcess(cmd, 127, "", f"{cmd[0]}: not found")
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(cmd, 124, "", f"{' '.join(cmd)}: timed out")


def check_docker() -> str | None:
    if not shutil.which("docker"):
        return ("no `docker` command: install Docker Engine (https://docs.docker.com/engine/install/) "
                "or, on a Debian CI machine, run `bash .ci/provision`")
    r = run(["docker", "info", "--format", "{{json .ServerVersion}}"])
    if r.returncode != 0:
        return ("the Docker engine is not answering (" + (r.stderr.strip().splitlines() or ["?"])[-1] + "): "
                "start it (`sudo systemctl start docker`), check you may use it (`docker info`), "
                "or on a Debian CI machine run `bash .ci/provision`")
    return None


def check_compose() -> str | None:
    r = run(["docker", "compose", "version", "--short"])
    if r.returncode != 0:
        return "Docker Compose v2 plugin missing: install docker-compose-plugin, or run `bash .ci/provision`"
    return compose_too_old(r.stdout.strip())


# Docker's promise that a port published on 127.0.0.1 stays on this machine: engines before 28.0 route packets a LAN
# neighbour addresses to 127.0.0.1 into the container (28.0 adds a raw-table drop), and 28.0-28.3.2 lose that drop
# when firewalld reloads (CVE-2025-54388). Every env server and TensorBoard rely on it (SECURITY.md).
LOOPBACK_SAFE_ENGINE = (28, 0, 0)
LOOPBACK_SAFE_ENGINE_FIREWALLD = (28, 3, 3)


def loopback_exposure(version: str, firewalld: bool) -> str | None:
    """A warning (with what to do) when engine `version` lets the LAN reach ports published on 127.0.0.1."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if not m:
        return None  # not a version we can read (a dev build): nothing to say
    have = (int(m[1]), int(m[2]), int(m[3] or 0))
    need = LOOPBACK_SAFE_ENGINE_FIREWALLD if firewalld else LOOPBACK_SAFE_ENGINE
    if have >= need:
        return None
    why = ("with firewalld running, a firewalld reload drops the rule that keeps 127.0.0.1 ports local "
           "(CVE-2025-54388)" if firewalld and have >= LOOPBACK_SAFE_ENGINE else
           "it lets machines on your LAN reach ports published on 127.0.0.1")
    return (f"Docker Engine {version.strip()}: {why}, so neighbours can open env-server sessions and read TensorBoard. "
            f"Upgrade Docker Engine to >= {'.'.join(map(str, need))}; until then, on a machine others share a network "
            "with, drop such packets yourself: `sudo iptables -t raw -I PREROUTING -d 127.0.0.0/8 ! -i lo -j DROP`"
            + (" (again after every firewalld reload)" if firewalld else ""))


def firewalld_running() -> bool:
    return run(["firewall-cmd", "--state"]).stdout.strip() == "running"


def check_loopback_guarantee() -> str | None:
    """loopback_exposure() for the engine answering here (None when docker does not answer: check_docker says so)."""
    r = run(["docker", "version", "--format", "{{.Server.Version}}"])
    if r.returncode != 0 or not r.stdout.strip():
        return None
    return loopback_exposure(r.stdout, firewalld_running())


def compose_too_old(version: str) -> str | None:
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version)
    if not m or (int(m[1]), int(m[2]), int(m[3] or 0)) < MIN_COMPOSE:
        need = ".".join(map(str, MIN_COMPOSE))
        return f"Compose {version} is too old: need >= {need} (`!override` in the generated compose file)"
    return None


@functools.lru_cache(maxsize=1)
def detect_gpus() -> gpu_doctor.DockerGpus:
    """The GPUs Docker hands to containers, and how (tools/gpu_doctor.py probes with a throw-away container)."""
    if os.environ.get("STACK_FAKE_NO_GPU"):  # tests: behave as a GPU-less host
        return gpu_doctor.DockerGpus(None, [], "no GPU (forced off by STACK_FAKE_NO_GPU)")
    found = gpu_doctor.probe()
    return found if found is not None else gpu_doctor.DockerGpus(None, [], "no NVIDIA GPU (no NVIDIA driver here)")


def resolve_mode(dotenv: dict[str, str], gpus: gpu_doctor.DockerGpus | None = None) -> tuple[str, str]:
    """(mode, one line saying why) for TRAIN_MODE in .env."""
    want = (dotenv.get("TRAIN_MODE") or "auto").strip().lower()
    if want not in MODES:
        raise StackError(f"TRAIN_MODE: unknown value {want!r}; choose from {', '.join(MODES)} and edit .env")
    gpus = gpus if gpus is not None or want == "cpu" else detect_gpus()
    try:
        mode, why = resolve_train_mode(want, gpus.count if gpus else 0, found=gpus.detail if gpus else "")
    except TrainModeError as exc:
        raise StackError(str(exc)) from None
    if mode_spec(mode).runs_vllm_service:
        spec = mode_spec(mode)
        why += (f"; vLLM on GPU {dotenv.get('VLLM_GPU') or spec.vllm_gpu_default}, trainer on GPU "
                f"{dotenv.get('TRAINER_GPU') or spec.trainer_gpu_default}")
    return mode, why


def check_gpu_driver(dotenv: dict[str, str], gpus: gpu_doctor.DockerGpus) -> None:
    """Stop when the host's NVIDIA driver cannot run VLLM_IMAGE's CUDA (before a multi-GB pull when the
    tag is known, else once the image is here)."""
    if not gpus.gpus:
        return
    image = dotenv.get("VLLM_IMAGE") or gpu_doctor.DEFAULT_VLLM_IMAGE
    ok, message = gpu_doctor.check_driver(gpus.gpus[0].driver, image, gpu_doctor.cuda_of_image(image))
    if not ok:
        raise StackError(message)


# ------------------------------------------------------------------ ENV_<NAME>_REPLICAS=auto
CAPACITY_CACHE = ROOT / ".stack" / "capacity.json"  # per image: any env file may reuse a measurement


def last_counts_file() -> Path:
    """.stack/replicas.json: the counts `make up` resolved for .env (another env file gets its own)."""
    suffix = "" if settings.ENV_FILE == ROOT / ".env" else f".{settings.ENV_FILE.stem}"
    return ROOT / ".stack" / f"replicas{suffix}.json"


def builtin_served_here(dotenv: dict[str, str]) -> list[str]:
    from envs import registry

    urls = external_env_urls(dotenv)
    return [n for n in env_names(dotenv) if registry.is_builtin(n) and n not in urls]


def auto_replica_envs(dotenv: dict[str, str]) -> list[str]:
    try:
        return env_replicas.auto_envs(dotenv, custom_envs(dotenv), builtin_served_here(dotenv))
    except env_replicas.ReplicasError as exc:
        raise StackError(str(exc)) from None


def replica_counts(dotenv: dict[str, str]) -> dict[str, str]:
    """What Compose interpolates as ENV_<NAME>_REPLICAS for each env served here: a number as given (in .env, or
    resolved by resolve_auto_replicas), else (`auto`) the count `make up` last resolved, else 1, so `make ps`,
    `make logs`, ... read a valid file without measuring."""
    auto = set(auto_replica_envs(dotenv))
    try:
        last = json.loads(last_counts_file().read_text())
    except (OSError, ValueError):
        last = {}
    out = {}
    for name in [*custom_envs(dotenv), *builtin_served_here(dotenv)]:
        var = naming.replicas_var(name)
        value = (dotenv.get(var) or "").strip()
        if value.isdigit():
            out[var] = value
        elif name in auto:
            out[var] = str(last.get(var, 1))
    return out


def resolve_auto_replicas(dotenv: dict[str, str], mode: str, processes: int) -> dict[str, str]:
    """{ENV_<NAME>_REPLICAS: count} for the run's auto envs, measuring an image not measured yet (tools/env_replicas.py);
    one line per env says what it found and how many containers run."""
    names = auto_replica_envs(dotenv)
    if not names:
        return {}
    cfg = run_config(dotenv, mode)
    cache = env_replicas.load_cache(CAPACITY_CACHE)
    counts = {}
    try:
        most = env_replicas.cap(dotenv)
        for name in names:
            image = dotenv.get(f"ENV_{name.upper()}_IMAGE") or LOCAL_ENV_IMAGE
            image_id = run(["docker", "image", "inspect", "--format", "{{.Id}}", "--", image]).stdout.strip()
            needed = cfg.sessions_needed(name, num_processes=processes)
            key = f"{name}|{env_replicas.cache_key(image_id, dotenv)}"
            measured = cache.get(key)
            if measured is None or not measured.covers(needed):
                builtin = name if name in builtin_served_here(dotenv) else None
                try:
                    measured = env_replicas.measure(image, needed, dotenv, run, say, builtin_env=builtin,
                                                    user=dotenv.get(naming.user_var(name)) or naming.SERVER_USER)
                except env_replicas.ReplicasError as exc:  # the service's own start and checks say what is wrong
                    say(f"env {name}: not measured ({exc}); starting 1 container")
                    counts[naming.replicas_var(name)] = "1"
                    continue
                cache[key] = measured
                env_replicas.save_cache(CAPACITY_CACHE, cache)
            count, line = env_replicas.replicas_for(name, needed, measured, most)
            say(line)
            counts[naming.replicas_var(name)] = str(count)
    except env_replicas.ReplicasError as exc:
        raise StackError(str(exc)) from None
    last_counts_file().parent.mkdir(exist_ok=True)
    last_counts_file().write_text(json.dumps(counts))
    return counts


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def check_port(dotenv: dict[str, str], key: str) -> str | None:
    raw = dotenv.get(key, "")
    if not raw:
        return None
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        return f"{key}={raw!r} is not a port number; edit .env"
    if not port_free(int(raw)) and not _ours_on_port(int(raw)):
        return (f"port {raw} ({key}) is already in use on 127.0.0.1: stop what holds it "
                f"(`ss -ltnp 'sport = :{raw}'`) or set {key} to a free port in .env")
    return None


def _ours_on_port(port: int) -> bool:
    r = run(["docker", "ps", "--filter", "label=com.docker.compose.project=grpo-stack", "--format", "{{.Ports}}"])
    return f":{port}->" in r.stdout


def check_token_file(dotenv: dict[str, str]) -> str | None:
    """The token file: readable by the containers' uid (Compose keeps the host file's mode), inside a directory
    only its owner can enter (so the file's o+r shows it to nobody else on the host)."""
    path = Path(dotenv.get("HF_TOKEN_FILE") or ".secrets/hf_token")
    path = path if path.is_absolute() else ROOT / path
    if path.parent.exists() and path.parent.stat().st_mode & 0o077:
        return (f"{path.parent} is open to other users of this host (mode {path.parent.stat().st_mode & 0o777:o}): "
                f"they can read the Hugging Face token in it; `chmod 700 {path.parent}`")
    if path.exists() and not path.stat().st_mode & 0o004:
        return (f"{path} is not readable by the containers' uid 10001 (Compose keeps the host file's mode): "
                f"`chmod 644 {path}` and keep its directory private (`chmod 700 {path.parent}`)")
    return None


def run_config(dotenv: dict[str, str], mode: str):
    """The trainer's typed config (contract.config.RunConfig, light imports only) from .env's values."""
    from contract.config import RunConfig

    keys = set(parse_env_file(settings.ENV_EXAMPLE))
    values = {k: v for k, v in dotenv.items() if k in keys and v != ""}
    values["TRAIN_MODE"] = mode
    return RunConfig(**{k.lower(): v for k, v in values.items() if k.lower() in RunConfig.model_fields})


def validate_run_config(dotenv: dict[str, str], mode: str) -> str | None:
    """Validate .env against the trainer's typed config."""
    from pydantic import ValidationError

    try:
        run_config(dotenv, mode)
    except ValidationError as e:
        lines = [f"{'.'.join(map(str, err['loc'])).upper()}: {err['msg']}" for err in e.errors()]
        return "invalid .env values: " + "; ".join(lines) + " (edit .env)"
    except (ValueError, SystemExit) as e:
        return f"invalid .env values: {e} (edit .env)"
    return None


def gpu_plan(dotenv: dict[str, str], mode: str, gpus: gpu_doctor.DockerGpus | None = None) -> gpu_layout.Plan | None:
    """The GPU layout of a gpu/colocate run (None on CPU); a bad GPU list stops with its fix."""
    if mode == "cpu":
        return None
    try:
        return gpu_layout.plan(dotenv, mode, {g.uuid: int(g.index) for g in (gpus.gpus if gpus else [])})
    except gpu_layout.LayoutError as exc:
        raise StackError(str(exc)) from None


def compose_command(compose_vars: dict[str, str], *args: str, extra_profiles: tuple[str, ...] = ()):
    """(argv, environment) of a `docker compose` call for this stack."""
    env = dict(compose_vars)
    if extra_profiles:
        env["COMPOSE_PROFILES"] = ",".join([env["COMPOSE_PROFILES"], *extra_profiles])
    env_file = ["--env-file", str(settings.ENV_FILE)] if settings.ENV_FILE.exists() else []  # STACK_ENV_FILE, else .env
    return ["docker", "compose", *env_file, *args], env


def compose(compose_vars: dict[str, str], *args: str, extra_profiles: tuple[str, ...] = ()) -> int:
    cmd, env = compose_command(compose_vars, *args, extra_profiles=extra_profiles)
    return subprocess.call(cmd, cwd=ROOT, env=env)


# Docker's reference grammar, loosely: a name starting with `-` would read as an option, spaces as more arguments.
IMAGE_REFERENCE = re.compile(r"[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?", re.I)


def check_custom_images(dotenv: dict[str, str]) -> None:
    """Each ENV_<NAME>_IMAGE is on this machine, or pulled now; else one line saying what to do."""
    for n in custom_envs(dotenv):
        var = naming.image_var(n)
        image = dotenv[var]
        if not IMAGE_REFERENCE.fullmatch(image):
            raise StackError(f"{var}={image!r} is not an image name (e.g. ghcr.io/org/env:1.0, or a digest "
                             f"name@sha256:...); fix {var} in .env")
        if run(["docker", "image", "inspect", "--", image]).returncode == 0:
            continue
        say(f"pulling {image} ({var})")
        r = run(["docker", "pull", "--", image], timeout=1800)  # `--`: a name starting with - is no option
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["?"])[-1]
            raise StackError(f"{var}={image}: not on this machine and `docker pull` failed ({why}); build or load "
                             f"the image first (e.g. `docker build -t {image} .` in the env's folder), or fix {var} "
                             "in .env")


def unhealthy_custom_envs(compose_vars: dict[str, str], dotenv: dict[str, str]) -> list[str]:
    """Why each custom env's service is not healthy (an image that is no OpenEnv server, usually)."""
    problems = []
    for n in custom_envs(dotenv):
        cmd, cmd_env = compose_command(compose_vars, "ps", "-a", "--format", "json", naming.service_name(n))
        r = subprocess.run(cmd, cwd=ROOT, env=cmd_env, capture_output=True, text=True)
        states = [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]
        if states and all(s.get("Health") == "healthy" for s in states):
            continue
        seen = ", ".join(sorted({s.get("Health") or s.get("State", "?") for s in states})) or "not started"
        problems.append(f"env-{n} (image {dotenv[f'ENV_{n.upper()}_IMAGE']}) is {seen}: its GET /health on port 8000 "
                        "never answered 200. Is it an OpenEnv server (openenv's create_app, served on port 8000)? "
                        f"`make logs` shows its output")
    return problems
