"""The calls that touch Docker and the host: `docker` and `docker compose` runs, the engine and Compose checks, the
GPU probe, images pulled or measured, ports and the token file, and `setup`'s files. Each takes the plan's parsed
values (tools/env_kinds.py's EnvKinds, the values dict); what to run is decided there and in tools/plan.py.
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

from contract.config import TrainModeVariant
from envs import naming
from tools import env_replicas, gpu_doctor, settings
from tools.derive import auto_replica_envs, last_counts_file, run_config
from tools.env_kinds import EnvKinds
from tools.env_ports import EnvPort
from tools.errors import StackError, say
from tools.images import local_env_image
from tools.settings import ROOT, WHEELS, load_env

MIN_COMPOSE = (2, 24, 4)  # `!override` in the generated compose file (profiles and `required: false` are older)
# Commands run in the trainer images: vLLM's runtime image (the GPU trainer's base) installs `python3` only.
TRAINER_PYTHON = ("python3",)
CAPACITY_CACHE = ROOT / ".stack" / "capacity.json"  # per image: any env file may reuse a measurement


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
    if r.returncode != 0 or r.stdout.strip() in ("", '""'):  # Debian trixie's CLI 26.1 exits 0, printing "", with no engine
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


def check_gpu_driver(values: dict[str, str], gpus: gpu_doctor.DockerGpus) -> None:
    """Stop when the host's NVIDIA driver cannot run VLLM_IMAGE's CUDA (before a multi-GB pull when the
    tag is known, else once the image is here)."""
    if not gpus.gpus:
        return
    image = values.get("VLLM_IMAGE") or gpu_doctor.DEFAULT_VLLM_IMAGE
    ok, message = gpu_doctor.check_driver(gpus.gpus[0].driver, image, gpu_doctor.cuda_of_image(image),
                                          gpus.gpus[0].name, gpu_doctor.forward_compat_on(values))
    if not ok:
        raise StackError(message)


def resolve_auto_replicas(envs: EnvKinds, dotenv: dict[str, str], mode: TrainModeVariant | None, processes: int,
                          ports: dict[str, EnvPort]) -> dict[str, str]:
    """{ENV_<NAME>_REPLICAS: count} for the run's auto envs, measuring an image not measured yet (tools/env_replicas.py)
    on its server's port (`ports`, tools/env_ports.py); one line per env says what it found and how many containers run."""
    names = auto_replica_envs(envs, dotenv)
    if not names:
        return {}
    cfg = run_config(dotenv, mode)
    cache = env_replicas.load_cache(CAPACITY_CACHE)
    counts = {}
    try:
        most = env_replicas.cap(dotenv)
        for name in names:
            image = envs.images.get(name) or local_env_image()
            image_id = run(["docker", "image", "inspect", "--format", "{{.Id}}", "--", image]).stdout.strip()
            needed = cfg.sessions_needed(name, num_processes=processes)
            key = f"{name}|{env_replicas.cache_key(image_id, dotenv)}"
            measured = cache.get(key)
            if measured is None or not measured.covers(needed):
                builtin = name if name in envs.builtin else None
                try:
                    measured = env_replicas.measure(image, needed, dotenv, run, say, port=ports[name], builtin_env=builtin,
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
    project = settings.load().project
    r = run(["docker", "ps", "--filter", f"label=com.docker.compose.project={project}", "--format", "{{.Ports}}"])
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


# Images its caller built from this checkout moments ago, "<build fingerprint>@<image id>" comma-separated (build_marks):
# the test session sets it after its own builds (tests/helpers.py), so each stack command's build, a no-op then, costs
# a `compose config` and an inspect (~1 s) instead of Docker's layer-cache walk (5-8 s on a busy 2-core machine).
FRESH_IMAGES_VAR = "STACK_IMAGES_FRESH"


def build_marks(compose_vars: dict[str, str], services: tuple[str, ...], extra_profiles: tuple[str, ...] = (),
                env_file: Path | None = None) -> list[str] | None:
    """Each build service's "<fingerprint>@<image id>": the fingerprint hashes the image and build (context, Dockerfile,
    args) Compose resolves it to for this stack; None when an image is not on this machine or Compose cannot say.
    `env_file`: the one Compose reads instead of the stack's (STACK_ENV_FILE, else .env)."""
    import hashlib

    cmd, env = compose_command(compose_vars, "config", "--format", "json", *services, extra_profiles=extra_profiles)
    if env_file is not None:
        cmd = ["docker", "compose", "--env-file", str(env_file), *cmd[cmd.index("config"):]]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    try:
        resolved = json.loads(out.stdout)["services"] if out.returncode == 0 else {}
        built = [{"image": resolved[s]["image"], "build": resolved[s]["build"]} for s in services]
    except (ValueError, KeyError):  # not one of compose.yaml's build services: built as always
        return None
    ids = run(["docker", "image", "inspect", "--format", "{{.Id}}", "--", *(b["image"] for b in built)])
    if ids.returncode != 0 or len(ids.stdout.split()) != len(built):
        return None
    return [hashlib.sha256(json.dumps(b, sort_keys=True).encode()).hexdigest() + "@" + image_id
            for b, image_id in zip(built, ids.stdout.split())]


def built_fresh(compose_vars: dict[str, str], services: tuple[str, ...], extra_profiles: tuple[str, ...] = ()) -> bool:
    """Every one of these build services' images is one FRESH_IMAGES_VAR vouches for, built as this stack would
    build it and still under its tag: a build would change nothing."""
    vouched = set(filter(None, os.environ.get(FRESH_IMAGES_VAR, "").split(",")))
    marks = build_marks(compose_vars, services, extra_profiles) if vouched else None
    return marks is not None and set(marks) <= vouched


def build(compose_vars: dict[str, str], *services: str, extra_profiles: tuple[str, ...] = (), quiet: bool = False) -> int:
    """`docker compose build` of these build services, unless FRESH_IMAGES_VAR vouches for every one (built_fresh)."""
    if built_fresh(compose_vars, services, extra_profiles):
        return 0
    return compose(compose_vars, *(("--progress", "quiet") if quiet else ()), "build", *services,
                   extra_profiles=extra_profiles)


# Docker's reference grammar, loosely: a name starting with `-` would read as an option, spaces as more arguments.
IMAGE_REFERENCE = re.compile(r"[a-z0-9][a-z0-9._/:-]*(@sha256:[0-9a-f]{64})?", re.I)


def check_custom_images(envs: EnvKinds) -> list[str]:
    """Each ENV_<NAME>_IMAGE is on this machine, or pulled now; else one line saying what to do. Returns the envs
    whose image it pulled (their EXPOSE was not known before)."""
    pulled = []
    for n in envs.custom:
        var, image = naming.image_var(n), envs.images[n]
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
        pulled.append(n)
    return pulled


def exposed_ports(envs: EnvKinds, run=run) -> dict[str, tuple[str, ...]]:
    """The ports each env image not ours declares (its EXPOSE lines: `8004/tcp`, ...), by env, for
    env_ports.resolve; an image not on this machine yet is left out (`make up` pulls it, then asks again)."""
    out = {}
    for n in envs.served_here:
        image = envs.images.get(n)
        if not image or image == local_env_image():  # ours serves on naming.PORT
            continue
        r = run(["docker", "image", "inspect", "--format", "{{json .Config.ExposedPorts}}", "--", image])
        if r.returncode == 0:
            out[n] = tuple(json.loads(r.stdout.strip() or "null") or {})
    return out


def unhealthy_custom_envs(compose_vars: dict[str, str], envs: EnvKinds, ports: dict[str, EnvPort]) -> list[str]:
    """Why each custom env's service is not healthy (an image that is no OpenEnv server, or one serving on another
    port, usually); `ports`: where its health check looked (tools/env_ports.py)."""
    problems = []
    for n in envs.custom:
        cmd, cmd_env = compose_command(compose_vars, "ps", "-a", "--format", "json", naming.service_name(n))
        r = subprocess.run(cmd, cwd=ROOT, env=cmd_env, capture_output=True, text=True)
        states = [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]
        if states and all(s.get("Health") == "healthy" for s in states):
            continue
        seen = ", ".join(sorted({s.get("Health") or s.get("State", "?") for s in states})) or "not started"
        problems.append(f"env-{n} (image {envs.images[n]}) is {seen}: its GET /health never answered 200 on "
                        f"{ports[n]}. Is it an OpenEnv server (openenv's create_app) listening there? `make logs` "
                        "shows its output")
    return problems
