"""Test helpers: build our images once per session, and start isolated Compose projects.

Container tests run the real compose.yaml through testcontainers' DockerCompose. Each project
gets its own name (grpo-test-*) and env file, and the tests' images their own tags (STACK_NAME below), so tests never
touch a user's `.env`, stack or images, and `.ci/run` can tear down whatever a crashed test left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_ENVS = ROOT / "tests" / "fixtures" / "envs"
sys.path.insert(0, str(ROOT))

# The learning checks' training seeds: LEARN_SEEDS=1,2,3,4,5 runs each check once per seed (how the spreads in their
# docstrings were measured); CI runs the one seed the bars were set for.
LEARN_SEEDS = [int(s) for s in os.environ.get("LEARN_SEEDS", "42").split(",")]

# torch's idle OpenMP threads sleep rather than spin, in the tests' own processes and what they start on the host, as
# in our CPU images (services/trainer/Dockerfile.cpu): the suite runs two parts and containers on shared cores, where
# spinning threads burned them (two CPU training tests side by side: 58.6 s each with libgomp's default, 28.7 s so).
# Set before any test imports torch (libgomp reads it when loaded).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# The tests' stack name (tools/settings.py STACK_NAME): their images are grpo-test/*, whatever the checkout's folder,
# for every `docker compose` and `python -m tools` they run (process variables win over an env file, as in Compose);
# each test's containers are in a project of its own, grpo-test-<id> (COMPOSE_PROJECT_NAME). TEST_STACK_NAME (starting
# grpo-test, which .ci/run's teardown matches) gives a second checkout's tests images of their own on a shared engine.
STACK_NAME = os.environ["STACK_NAME"] = os.environ.get("TEST_STACK_NAME") or "grpo-test"
TRAINER_CPU_IMAGE = f"{STACK_NAME}/trainer:cpu"  # compose.yaml's x-image-tags trainer-cpu (build_images("trainer-cpu"))
BUILD_SERVICES = {
    "env-server": "env-server-image",
    "trainer-cpu": "trainer-cpu-image",
}




class JsonStubHandler:
    """Mixin for an in-process stand-in server's BaseHTTPRequestHandler: `reply(status, body)` answers JSON; no log."""

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a) -> None:
        pass


@contextlib.contextmanager
def stub_http_server(handler: type) -> Iterator[str]:
    """Serve `handler` on 127.0.0.1 (a free port) in a thread; yields its base URL, closed on exit."""
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def docker_ready() -> bool:
    return shutil.which("docker") is not None and subprocess.run(
        ["docker", "info"], capture_output=True
    ).returncode == 0


def _example_env() -> dict[str, str]:
    from tools.errors import parse_env_file

    return parse_env_file(ROOT / ".env.example")


def write_env_file(path: Path, project: str, profiles: list[str], overrides: dict[str, str] | None = None) -> Path:
    values = _example_env()
    values.update(TORCH_INDEX_URL="", STACK_NAME=STACK_NAME, COMPOSE_PROJECT_NAME=project,
                  COMPOSE_PROFILES=",".join(profiles))
    values.update(overrides or {})
    path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return path





_built: set[str] = set()


def build_images(*images: str) -> None:
    """Build our images (cached layers make repeat builds quick); once per test session."""
    from tools.docker_host import setup

    todo = [BUILD_SERVICES[i] for i in images if i not in _built]
    if not todo:
        return
    setup()  # copies the local CPU torch wheel into .wheels/ when the machine has one
    env = dict(os.environ, COMPOSE_PROFILES="build", TORCH_INDEX_URL="")
    if not list((ROOT / ".wheels").glob("torch-*.whl")):
        env.pop("TORCH_INDEX_URL")
    subprocess.run(["docker", "compose", "--env-file", str(ROOT / ".env.example"), "build", *todo],
                   cwd=ROOT, env=env, check=True)
    vouch_fresh(env, *todo)
    _built.update(images)


def vouch_fresh(env: dict[str, str], *services: str) -> None:
    """Tell the stack commands this session runs (docker_host.FRESH_IMAGES_VAR) that these build services' images were
    just built from this checkout (with .env.example and `env`, as built here): each command's build of them, a no-op
    then, is skipped while the image under the tag and its build settings are the ones vouched for."""
    from tools.docker_host import FRESH_IMAGES_VAR, build_marks

    marks = build_marks(env, services, env_file=ROOT / ".env.example") or []
    os.environ[FRESH_IMAGES_VAR] = ",".join(filter(None, [*os.environ.get(FRESH_IMAGES_VAR, "").split(","), *marks]))


@contextlib.contextmanager
def compose_stack(
    tmp_path: Path,
    profiles: list[str],
    services: list[str] | None = None,
    overrides: dict[str, str] | None = None,
    wait: bool = True,
) -> Iterator[object]:
    """Start an isolated project of the real compose.yaml; always torn down with its volumes."""
    from testcontainers.compose import DockerCompose

    project = f"grpo-test-{uuid.uuid4().hex[:8]}"
    env_file = write_env_file(tmp_path / f"{project}.env", project, profiles, overrides)
    files = [str(f) for f in stack_compose_files(profiles, tmp_path)]
    stack = DockerCompose(str(ROOT), compose_file_name=files, env_file=str(env_file),
                          services=services, wait=wait)
    stack.project = project  # type: ignore[attr-defined]
    stack.files = files  # type: ignore[attr-defined]
    try:
        stack.start()
        yield stack
    finally:
        with contextlib.suppress(Exception):
            stack.stop(down=True)
        subprocess.run(["docker", "compose", "-p", project, "down", "--volumes", "--remove-orphans"],
                       cwd=ROOT, capture_output=True)


def service_url(stack, service: str, port: int = 8000) -> str:
    host, host_port = stack.get_service_host_and_port(service, port)
    return f"http://{host or '127.0.0.1'}:{host_port}"


def compose_config(*profiles: str, env_file: str = ".env.example") -> dict:
    """`docker compose --env-file ENV config` for these profiles, parsed (never grepped), with the env services
    `make` generates for them."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="grpo-config-") as folder:
        cmd = ["docker", "compose", "--env-file", env_file, *compose_file_args(stack_compose_files(profiles, Path(folder)))]
        for p in profiles:
            cmd += ["--profile", p]
        out = subprocess.run([*cmd, "config", "--format", "json"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


class EnvFileStack:
    """A stack driven like a user drives it: an env file and `python -m tools` (STACK_ENV_FILE points at it)."""

    def __init__(self, tmp_path, overrides: dict[str, str]) -> None:
        self.project = f"grpo-test-{uuid.uuid4().hex[:8]}"
        self.env_file = write_env_file(tmp_path / f"{self.project}.env", self.project, [], overrides)

    def stack(self, *args: str, env: dict[str, str] | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tools", *args], cwd=ROOT, env=self.environment(env),
                              capture_output=True, text=True, timeout=timeout)

    def environment(self, env: dict[str, str] | None = None) -> dict[str, str]:
        """`python -m tools`' environment: this stack's env file, `env` over it, none of the test run's own picks."""
        run_env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
        run_env.update(STACK_ENV_FILE=str(self.env_file), **(env or {}))
        return run_env

    def read(self, path: str) -> str:
        res = self.stack("compose", "run", "--rm", "--no-deps", "--entrypoint", "cat", "trainer-cpu", path)
        return res.stdout if res.returncode == 0 else ""

    def down(self) -> None:
        self.stack("compose", "--profile", "*", "down", "--volumes", "--remove-orphans")
        # a volume only a command's generated file declares (make rehearse's `weights`) is not in the model `down`
        # reads: each rehearsal module left one behind
        left = subprocess.run(["docker", "volume", "ls", "-q", "--filter",
                               f"label=com.docker.compose.project={self.project}"], capture_output=True, text=True)
        if left.stdout.split():
            subprocess.run(["docker", "volume", "rm", *left.stdout.split()], capture_output=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_gradio(module: str) -> list[str]:
    """`python -m module` with Gradio left out: upstream's openenv.core.env_server imports it (its web UI, off unless
    ENABLE_WEB_INTERFACE) whenever it is installed, two thirds of a fixture server's start-up, half of the openenv
    CLI's run; envs/serve.py leaves it out alike."""
    return [sys.executable, "-c", f"import sys, runpy; sys.modules['gradio'] = None; "
            f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"]


def start_fixture(name: str, port: int, **env: str) -> subprocess.Popen:
    """Serve tests/fixtures/envs/<name> with uvicorn on 127.0.0.1:port; return once /health answers. A server that
    exits fails at once; the deadline is only a hang guard: under a CPU burner the host part, at its low priority,
    once took more than 120 s to start three of these side by side (the test then failed, nothing was wrong)."""
    import requests

    proc = subprocess.Popen(
        [*without_gradio("uvicorn"), "app:app", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
        cwd=FIXTURE_ENVS / name, env=dict(os.environ, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while True:
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except requests.RequestException:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise AssertionError(f"fixture {name} did not start") from None
            time.sleep(0.2)


def make_tiny_model(out: Path) -> Path:
    """The CPU profile's own tiny model (`python -m trainer.tiny_model`, what its model-init job runs) at `out`, reused
    when already there; world-readable, since the vllm-cpu container (uid 10001) mounts it read-only."""
    from trainer import tiny_model

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # `make test`'s two parts share one (TINY_MODEL_DIR) and may ask for it at once: one makes it, the other waits
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tiny_model.is_complete(out):  # its marker, written last: a folder cut short is made again
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(out)], cwd=ROOT, check=True)
        out.chmod(0o755)
        for p in out.rglob("*"):
            p.chmod(0o755 if p.is_dir() else 0o644)
    return out


JUDGE_BUILD_BOUND_S = 3600  # the tiny judge's SFT: ~2 CPU-minutes, on idle CPU beside the suite (a bound, not a wait)


def wait_for_file(path: Path, bound_s: float, what: str) -> None:
    """Until `path` exists (a job beside this one writes it when it ends), at most `bound_s`."""
    deadline = time.monotonic() + bound_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not done after {bound_s:.0f} s")
        time.sleep(1)


def make_tiny_judge(out: Path) -> Path:
    """The CPU profile's tiny judge (`python -m trainer.tiny_judge`, what model-init runs for
    JUDGE_MODEL=/models/tiny-judge) at `out` (TINY_JUDGE_DIR: there instead), reused when complete; world-readable for
    the twin (uid 10001)."""
    from trainer.tiny_judge import is_complete

    out = Path(os.environ.get("TINY_JUDGE_DIR") or out)  # like TINY_MODEL_DIR: one made earlier, or where to make it
    done = os.environ.pop("TINY_JUDGE_DONE", "")  # `make test` makes it beside the tests: wait for that, once
    if done:
        wait_for_file(Path(done), JUDGE_BUILD_BOUND_S, f"the tiny judge `make test` makes beside the tests ({out})")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:  # one maker at a time (make_tiny_model says why)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_complete(out):
            subprocess.run([sys.executable, "-m", "trainer.tiny_judge", "--out", str(out)], cwd=ROOT, check=True)
        for p in [out, *out.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
    return out


def seed_models_volume(project: str, tiny_model_dir: Path, image: str) -> None:
    """`project`'s `models` volume, labelled as Compose makes it, holding the session's tiny model where model-init
    makes it (the same model: make_tiny_model runs model-init's code), so model-init finds it complete and exits in
    seconds instead of minutes, as on a user's second run. Only tests/trainer/test_cpu_training_docker.py runs
    model-init for real. `image`: one of ours (it has `sh` and `cp`)."""
    from contract.config import CPU_DEFAULT_MODEL

    volume = f"{project}_models"
    subprocess.run(["docker", "volume", "create", "--label", f"com.docker.compose.project={project}",
                    "--label", "com.docker.compose.volume=models", volume], check=True, capture_output=True)
    subprocess.run(["docker", "run", "--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{volume}:/models",
                    "-v", f"{Path(tiny_model_dir).resolve()}:/src:ro", image,
                    "-c", f"cp -r /src {CPU_DEFAULT_MODEL} && chown -R 10001:10001 /models"],
                   check=True, capture_output=True)


def stack_compose_files(profiles: list[str] | tuple[str, ...], folder: Path) -> list[Path]:
    """compose.yaml and, as `make` generates it (tools/plan.py), a file with an env-<name> service for each built-in
    env among `profiles` ("*": all of them): compose.yaml holds only their template."""
    from envs import registry
    from tools import compose_file
    from tools.env_kinds import env_kinds

    envs = list(registry.names()) if "*" in profiles else [p for p in profiles if registry.is_builtin(p)]
    if not envs:
        return [ROOT / "compose.yaml"]
    path = folder / f"compose.envs.{'-'.join(envs)}.yaml"
    path.write_text(compose_file.yaml_text({"services": compose_file.env_services(env_kinds({"ENV_NAME": ",".join(envs)}))}))
    return [ROOT / "compose.yaml", path]


def compose_file_args(files: list[Path]) -> list[str]:
    return [arg for f in files for arg in ("-f", str(f))]


def commit_download_cache(cache, model_dir, repo_id: str, commit: str):
    """A hub cache exactly as `snapshot_download(repo_id, revision=<commit>)` leaves it: files in blobs/ named by
    their hash, snapshots/<commit>/ linking to them, and no refs/ (only a branch or tag download writes refs)."""
    import hashlib
    import os

    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for path in sorted(model_dir.iterdir()):
        data = path.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / path.name)
    return snapshot
