"""What `make chaos` (bench/chaos.py) runs and drives: the env replicas (a Compose service or a Swarm fleet), the
fault-injecting proxy in a container (bench/chaos_proxy.py), and the trainer (on this machine, or `make rehearse`'s
container with ROLLOUTS=async). The faults are bench/chaos_faults.py's, the figures bench/chaos_figures.py's."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.chaos_proxy import CONTROL_TOKEN_ENV, ChaosProxy  # noqa: E402
from tools.images import local_env_image  # noqa: E402

TOOL_TIMEOUT_S = 6.0
RESET_TIMEOUT_S = 10.0
SESSION_TIMEOUT_S = 30  # the env servers reap a session idle this long (a half-open one included)
# A run with a judge (--judge): every episode a judge call. The tiny model repeats itself, so with the cache most rows
# were answered from it (run of 2026-12-07: 16 calls, 32 cache hits a step), scored while the judge was dead without a
# call, and the kill found no call in flight for minutes: the fault is about calls, not the cache (tests/trainer cover it)
JUDGE_SETTINGS = {"JUDGE_CACHE_SIZE": "0"}


def log(msg: str) -> None:
    print(f"[chaos] {msg}", flush=True)


def sh(*args: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> str:
    res = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    if check and res.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:4])}... -> {res.returncode}: {res.stderr[-2000:]}")
    return res.stdout.strip()



# ---------------------------------------------------------------------------- the env replicas
class ComposeEnvs:
    """env-echo of the real compose.yaml, N replicas, each on a 127.0.0.1 port (restart: unless-stopped)."""

    def __init__(self, replicas: int, project: str, work: Path) -> None:
        from tools import compose_file, settings
        from tools.env_kinds import env_kinds

        self.project, self.replicas = project, replicas
        env_file = work / "chaos.env"
        env_file.write_text(f"STACK_NAME={settings.load().stack_name}\n"  # IMAGE's: this checkout's stack
                            f"COMPOSE_PROJECT_NAME={project}\nCOMPOSE_PROFILES=echo\nMAX_CONCURRENT_ENVS=64\n"
                            f"ENV_SESSION_TIMEOUT_S={SESSION_TIMEOUT_S}\n")
        envs_file = work / "compose.envs.yaml"  # the env services `make` generates from env-template
        envs_file.write_text(compose_file.yaml_text({"services": compose_file.env_services(env_kinds({"ENV_NAME": "echo"}))}))
        self.compose = ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "-f", str(envs_file),
                        "--env-file", str(env_file)]

    def up(self) -> list[tuple[str, int]]:
        sh(*self.compose, "up", "-d", "--wait", "--scale", f"env-echo={self.replicas}", "env-echo")
        self.containers = self.targets()
        self._published = self._read_ports()
        threading.Thread(target=self._follow_ports, name="chaos-ports", daemon=True).start()
        return self.backends()

    def _read_ports(self) -> dict[str, tuple[str, int]]:
        out = {}
        for cid in self.containers:
            lines = sh("docker", "port", cid, "8000", check=False).splitlines()
            if lines:  # none while the container restarts
                host, port = lines[0].rsplit(":", 1)
                out[cid] = (host, int(port))
        return out

    def _follow_ports(self) -> None:
        """A restarted container gets a new ephemeral host port: the proxy must follow it, as Docker's DNS follows
        a restarted replica's address."""
        while True:
            time.sleep(1)
            self._published = {**self._published, **self._read_ports()}

    def backends(self) -> list[tuple[str, int]]:
        return sorted(self._published.values())

    def backend_of(self, container: str) -> tuple[str, int] | None:
        return self._published.get(container)

    def targets(self) -> list[str]:
        return sh(*self.compose, "ps", "-q", "env-echo").split()

    def proxy(self, backends, seed: int) -> tuple[ChaosProxy, str]:
        proxy = ChaosProxy(self.backends, seed=seed)  # read for every connection
        return proxy, f"http://127.0.0.1:{proxy.port}"

    def held(self, backends, proxy) -> dict[str, int]:
        return {f"{h}:{p}": health(h, p).get("active_sessions", -1) for h, p in self.backends()}

    def down(self) -> None:
        sh(*self.compose, "down", "-v", "--remove-orphans", check=False)


class SwarmEnvs:
    """The same env service as a one-node Swarm fleet (tools/fleet.py, the `make fleet-up` path), N tasks restarted
    by Swarm. The host cannot route to the fleet's overlay, so the proxy runs in a container on it
    (bench/chaos_proxy.py resolving `tasks.env-echo` per connection) with its port and control port on 127.0.0.1.
    A kill is a task's: its server process dies and Swarm replaces the task."""

    IMAGE = local_env_image()

    def __init__(self, replicas: int, project: str, work: Path) -> None:
        import contextlib

        self.stack, self.replicas = project, replicas
        self.env_file = work / "chaos-fleet.env"
        # FLEET_ALLOW_NEW_PRIVILEGES: only our own echo image runs, on whatever daemon this machine has
        self.env_file.write_text(f"ENV_NAME=echo\nENV_FLEET=swarm\nFLEET_STACK={project}\nENV_ECHO_REPLICAS={replicas}\n"
                                 f"MAX_CONCURRENT_ENVS=64\nENV_SESSION_TIMEOUT_S={SESSION_TIMEOUT_S}\nENV_MEM_LIMIT=1g\n"
                                 "FLEET_ALLOW_NEW_PRIVILEGES=1\n")
        self.exits = contextlib.ExitStack()
        self.proxy_name = f"{project}-proxy"

    def _fleet(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "tools", "fleet", command], cwd=ROOT, capture_output=True,
                              text=True, env=dict(os.environ, STACK_ENV_FILE=str(self.env_file)))

    def up(self) -> None:
        from tools import fleet

        created = self.exits.enter_context(fleet.local_swarm())
        log(f"swarm: {'initialised for this run' if created else 'this engine is a manager already'}")
        res = self._fleet("up")
        if res.returncode != 0:
            raise SystemExit(f"fleet up failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        return None

    def targets(self) -> list[str]:
        return sh("docker", "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={self.stack}_env-echo").split()

    def proxy(self, backends, seed: int) -> tuple["RemoteProxy", str]:
        return proxy_container(self.proxy_name, self.stack, "tasks.env-echo:8000", seed, from_host=True)

    def held(self, backends, proxy) -> dict[str, int]:
        return proxy.held()

    def backend_of(self, container: str) -> None:
        return None  # the proxy resolves tasks by name: which one a container is, it does not know

    def down(self) -> None:
        sh("docker", "rm", "-f", self.proxy_name, check=False)
        self._fleet("down")
        self.exits.close()


def proxy_container(name: str, network: str, backends: str, seed: int, image: str | None = None,
                    also: tuple[str, ...] = (), from_host: bool = False) -> tuple["RemoteProxy", str]:
    """bench/chaos_proxy.py in a container `name` on `network` (and the networks `also`), resolving `backends`
    (NAME:PORT) per connection; its port and control port published on 127.0.0.1. Returns the proxy's driver and
    its address from the host. `from_host`: the trainer runs on the host and comes in through the published port."""
    sh("docker", "rm", "-f", name, check=False)
    token = secrets.token_hex(16)  # the control port is on the env network too: only the injector may drive it
    # Only the proxy's one file is mounted (the checkout holds .env and its ENV_URLS credentials); limits as an env's.
    sh("docker", "run", "-d", "--name", name, "--network", network, "-p", "127.0.0.1::9000",
       "-p", "127.0.0.1::9001", "-v", f"{ROOT / 'bench' / 'chaos_proxy.py'}:/proxy/chaos_proxy.py:ro",
       "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true", "--memory", "256m",
       "--pids-limit", "64", "-e", "PYTHONDONTWRITEBYTECODE=1", "-e", CONTROL_TOKEN_ENV, "--no-healthcheck",
       "--entrypoint", "python", image or local_env_image(), "/proxy/chaos_proxy.py",
       "--backends", backends, "--seed", str(seed), env={**os.environ, CONTROL_TOKEN_ENV: token})
    for other in also:
        sh("docker", "network", "connect", other, name)
    listen = sh("docker", "port", name, "9000").splitlines()[0]
    control = sh("docker", "port", name, "9001").splitlines()[0]
    return RemoteProxy(control, token, sees_trainer_ports=not from_host), f"http://{listen}"


class RemoteProxy:
    """bench/chaos_proxy.py in a container, driven over its control port (one JSON line per command).
    `sees_trainer_ports`: False when the trainer reaches it through Docker's published port (the fleet's proxy, from
    the host): the links' peers are then Docker's port forwarder, not the sockets the trainer's log lines name."""

    def __init__(self, address: str, token: str, sees_trainer_ports: bool = True) -> None:
        self.sees_trainer_ports = sees_trainer_ports
        import socket as socket_module

        host, port = address.rsplit(":", 1)
        deadline = time.monotonic() + 60  # the container's python starting: a hang guard only
        while True:
            try:
                self.sock = socket_module.create_connection((host, int(port)), timeout=30)
                self.file = self.sock.makefile("rw")
                if self._ask(f"token {token}") != {}:
                    raise RuntimeError("the chaos proxy refused the control token")
                self._ask("held")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        self.lock = threading.Lock()
        self.frozen: list = []

    def _ask(self, line: str):
        self.file.write(line + "\n")
        self.file.flush()
        answer = self.file.readline()
        if not answer:
            raise ConnectionError("the chaos proxy's control port closed")
        return json.loads(answer)

    def ask(self, line: str):
        with self.lock:
            return self._ask(line)

    def drop(self):
        return self.ask("drop")

    def half_open(self):
        return self.ask("half_open")

    def delay(self, seconds: float, for_s: float) -> None:
        self.ask(f"delay {seconds} {for_s}")

    def hostile_frames(self, kind: str):
        return self.ask(f"hostile {kind}")

    def link_ends(self, link_id: int) -> dict | None:
        return self.ask(f"ends {link_id}")

    def frozen_link(self, link_id: int):
        from types import SimpleNamespace

        got = self.ask(f"frozen {link_id}")
        return None if got is None else SimpleNamespace(**got)

    def held(self) -> dict[str, int]:
        return self.ask("held")

    def waited(self, backend, start: float, end: float) -> list[str]:
        return self.ask(f"waited {start} {end}") or []

    def close(self) -> None:
        self.ask("close")


def pid_of(container: str) -> int:
    return int(sh("docker", "inspect", "-f", "{{.State.Pid}}", container))


def health(host: str, port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=3) as r:
            return json.loads(r.read())
    except (OSError, ValueError):
        return {}




# ---------------------------------------------------------------------------- the trainer
class Trainer:
    """`python -m trainer.train` on this machine; each output line kept with the time it was read."""

    def __init__(self, model: Path, url: str, out: Path, steps: int, seed: int) -> None:
        self.out, self.steps = out, steps
        self.env = dict(os.environ, TRAIN_MODE="cpu", MODEL_NAME=str(model), OUTPUT_DIR=str(out), RUN_NAME="chaos",
                        ENV_NAME="echo", ENV_URLS=f"echo={url}", MAX_STEPS=str(steps), SAVE_STEPS="2",
                        TOOL_TIMEOUT_S=str(TOOL_TIMEOUT_S), RESET_TIMEOUT_S=str(RESET_TIMEOUT_S), TRACE_EVERY="1",
                        TRACE_SAMPLES="64", SEED=str(seed), REPORT_TO="none", TRL_EXPERIMENTAL_SILENCE="1",
                        PYTHONPATH=str(ROOT))
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, resume: str) -> None:
        self.starts += 1
        self.proc = subprocess.Popen([sys.executable, "-m", "trainer.train", "--resume", resume], cwd=ROOT,
                                     env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def steps_logged(self) -> list[dict]:
        from trainer.core.metrics import read_metrics

        return read_metrics(self.out / "chaos")

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


TWIN_STATE = """
import urllib.request as u
for route in ("/is_paused", "/metrics"):
    try:
        text = u.urlopen("http://vllm:8000" + route, timeout=10).read().decode()
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
    print(route, "\\n".join(line for line in text.splitlines() if route == "/is_paused" or line.startswith(
        ("vllm:num_requests", "vllm:generation_tokens_total", "vllm:prompt_tokens_total", "process_start_time"))))
"""


class Rehearsal:
    """`python -m tools rehearse` with ROLLOUTS=async (TRL's AsyncGRPOTrainer in the trainer container, on the vLLM
    CPU twin) on a Compose project of its own, its ENV_URLS at the chaos proxy's container; Trainer's interface: the
    command's output lines with their time, the steps logged (read inside the running trainer container), a kill (of
    the trainer container) and a start again (RESUME=auto). `out` gets the run's folder copied from the outputs
    volume at the end (`collect`), so the figures read it as the sync run's."""

    def __init__(self, model: Path, proxy_url: str, work: Path, steps: int, seed: int, project: str,
                 judge: str | None = None) -> None:
        from bench.async_figures import Project

        self.out, self.steps = work / "outputs", steps
        self.project = Project(work, {
            "ENV_NAME": "echo", "ENV_URLS": f"echo={proxy_url}", "ROLLOUTS": "async", "RUN_NAME": "chaos",
            "TRAINER_PROCESSES": "1", "MAX_STEPS": str(steps), "SAVE_STEPS": "2", "LOGGING_STEPS": "1",
            "TOOL_TIMEOUT_S": str(TOOL_TIMEOUT_S), "RESET_TIMEOUT_S": str(RESET_TIMEOUT_S), "TRACE_EVERY": "1",
            "TRACE_SAMPLES": "64", "SEED": str(seed), "REPORT_TO": "none", "VLLM_SERVER_TIMEOUT_S": "600",
            # faults, not learning: a step of PER_DEVICE_TRAIN_BATCH_SIZE samples, as a sync one (ASYNC_STEP_SAMPLES=batch;
            # packed fills a step up to max_model_len tokens: ~120 samples at 512, ~500 at 4096 on the CPU twin); 512
            # holds the longest echo episode (~410 tokens)
            "ASYNC_STEP_SAMPLES": "batch", "VLLM_MAX_MODEL_LEN": "512",
            # the worker one step ahead, not MAX_STALENESS's 4: with a lead of 4 it could finish every episode of a short
            # run before the step its link faults wait for is logged (CI: drop, half_open, hostile_frames found no link)
            "MAX_STALENESS": "1",
            # a run with a judge: make rehearse serves it on the twin (tools/judge.py), killed once (judge_restart)
            **({"JUDGE_MODEL": judge} if judge else {})},
            name=f"{project}-rehearse")
        if judge:  # beside the settings above, appended to the same env file
            with open(self.project.env_file, "a") as fh:
                fh.writelines(f"{k}={v}\n" for k, v in JUDGE_SETTINGS.items())
        # the trainer reaches the proxy on its envnet: made here, labelled as Compose makes it, so the proxy can join
        # it before the run starts (Compose then takes it as its own)
        self.envnet = f"{self.project.name}_envnet"
        sh("docker", "network", "create", "--label", f"com.docker.compose.project={self.project.name}",
           "--label", "com.docker.compose.network=envnet", self.envnet)
        self.project.seed_model(model)  # model-init finds it complete
        self.lines: list[tuple[float, str]] = []
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self._rows: list[dict] = []
        self.collected = False  # the run's folder copied out of its volume (collect): the figures read it there

    def start(self, resume: str) -> None:
        self.starts += 1
        run_env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
        run_env.update(STACK_ENV_FILE=str(self.project.env_file), RESUME=resume)
        self.proc = subprocess.Popen([sys.executable, "-m", "tools", "rehearse"], cwd=ROOT, env=run_env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def container(self, service: str) -> str:
        ids = sh("docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project.name}",
                 "--filter", f"label=com.docker.compose.service={service}").split()
        return ids[0] if ids else ""

    def steps_logged(self) -> list[dict]:
        """The run's step records: once collected, from the run's folder (as the sync Trainer reads them); while it
        runs, read in its trainer container, the last good read while there is none (a restart) or the read failed
        (a container on its way out: its empty answer is not "no step")."""
        from trainer.core.metrics import read_metrics

        if self.collected:
            return read_metrics(self.out / "chaos")
        container = self.container("trainer")
        if container:
            res = subprocess.run(["docker", "exec", container, "cat", "/outputs/chaos/metrics.jsonl"],
                                 capture_output=True, text=True, timeout=120)
            if res.returncode == 0:
                rows = []
                for line in res.stdout.splitlines():
                    try:
                        rows.append(json.loads(line))
                    except ValueError:  # a line cut mid-write
                        continue
                self._rows = [r for r in rows if r.get("kind") == "step"]
        return self._rows

    def state(self) -> str:
        """What a hang message shows beside the command's last lines: each thread's stack in every process of the
        trainer container (trainer.core.hang_dump: SIGUSR1), then the project's containers and their status."""
        from trainer.core import hang_dump

        container = self.container("trainer")
        if container:
            seen = len(self.lines)
            sh("docker", "exec", container, "sh", "-c", hang_dump.SIGNAL_HANDLERS, check=False, timeout=60)
            deadline = time.monotonic() + 20  # the stacks come through the command's output pipe
            while time.monotonic() < deadline and not any("most recent call first" in text
                                                          for _, text in self.lines[seen:]):
                time.sleep(0.5)
            time.sleep(2)  # the rest of the dump after its first line (a diagnosis after a hang, not a test's wait)
            stacks = "\n".join(text for _, text in self.lines[seen:])
            # the twin as the trainer sees it (agentnet only): paused? requests waiting, tokens made so far
            twin = sh("docker", "exec", container, "python3", "-c", TWIN_STATE, check=False, timeout=60)
        else:
            stacks = twin = "(no trainer container)"
        vllm = self.container("vllm")
        twin_log = sh("docker", "logs", "--tail", "30", vllm, check=False, timeout=60) if vllm else "(no vllm container)"
        containers = sh("docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={self.project.name}",
                        "--format", "{{.Names}} {{.Status}}", check=False, timeout=60)
        return (f"stacks (SIGUSR1):\n{stacks}\nthe twin:\n{twin}\nits last lines:\n{twin_log}\n"
                f"containers:\n{containers}")

    def kill(self) -> None:
        """SIGKILL the trainer container mid-step; the command, its trainer gone, exits."""
        container = self.container("trainer")
        if container:
            sh("docker", "kill", container, check=False)
        self.proc.wait()

    def collect(self) -> None:
        from bench.async_figures import READER_IMAGE  # make rehearse's trainer image

        self.out.mkdir(parents=True, exist_ok=True)
        sh("docker", "run", "--rm", "--user", "0", "--network", "none", "--entrypoint", "sh", "-v",
           f"{self.project.name}_outputs:/outputs:ro", "-v", f"{self.out}:/dst", READER_IMAGE, "-c",
           f"cp -r /outputs/chaos /dst/ && chown -R {os.getuid()}:{os.getgid()} /dst/chaos")
        self.collected = True

    def down(self) -> None:
        if self.proc is not None and self.proc.poll() is None:  # a run ended early (a guard): its trainer too
            self.kill()
        self.project.down()
        sh("docker", "network", "rm", self.envnet, check=False)


def make_model(cache: Path) -> Path:
    """The CPU profile's tiny model, made once per cache folder (trainer.tiny_model skips a complete one)."""
    model = cache / "tiny-qwen3"
    log(f"the tiny model in {model}")
    subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model), "--env", "echo"], cwd=ROOT,
                   check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    return model
