"""`make chaos`: a real CPU training run against several env replicas while a seeded injector breaks things (#33).

    .venv/bin/python bench/chaos.py [--steps 40] [--replicas 3] [--seed 1] [--rate 1.0] [--fleet compose|swarm]

What runs: the env-echo service of the real compose.yaml with --replicas replicas (Compose's restart policy), or
(--fleet swarm) the same service as a one-node Swarm fleet (tools/fleet.py; its tasks are restarted by Swarm), and
`python -m trainer.train` on this machine (the CPU profile: the tiny model, TRL's GRPOTrainer, our rollout loop),
reaching the replicas through bench/chaos_proxy.py on 127.0.0.1 (nothing leaves this machine). The injector (seeded,
every event logged to <out>/chaos-log.jsonl with its time) draws one fault every `30 / rate` seconds on average:
  kill      SIGKILL an env container's server process from the host (a crash: Compose or Swarm restarts it);
  stop      SIGSTOP one for TOOL_TIMEOUT_S + 3 s, then SIGCONT (a hung server);
  drop      reset one live connection on both sides (proxy);
  half_open freeze one live connection (proxy): the trainer's side times out, the server's stays open;
  delay     every reply 1.5 s late for 10 s (a tail of slow steps, under TOOL_TIMEOUT_S);
and, once, kills the trainer (SIGKILL) mid-step after step --kill-after, then starts it again (RESUME=auto).

    .venv/bin/python bench/chaos.py --rollouts async [--steps 20] [--vllm-restart-after N]   (make chaos ARGS=...)

runs the same injector and figures against `python -m tools rehearse` with ROLLOUTS=async (TRL's AsyncGRPOTrainer in
the trainer container on the vLLM CPU twin) on a Compose project of its own: the replicas as above, the proxy in a
container on their network and on the rehearsal's envnet (the trainer's ENV_URLS points at it by name); the trainer
kill is a `docker kill` of the trainer container, and one more fault, vllm_restart, SIGKILLs the twin after step
--vllm-restart-after: make rehearse's recovery (tools/commands/train.py `recovering`) must recreate it and resume
from the last checkpoint. Episodes in async are the worker's (env/echo/episodes of each step record), infra failures
its rollout/infra_failures, both per step as in sync. Extra figure: the twin's restart, recovered, resumed from.

Figures, each beside its goal (a benchmark: it prints, it never fails on a figure; tests/reliability/test_chaos.py
runs a short version and asserts what must hold):
  replies paired with the wrong request   0     every traced call's result checked against its own request
  episodes lost to infrastructure         <=1 % rollout/infra_failures over every episode trained
  session slots held at the end           0     every replica's /health once the trainer is gone (bounded wait)
  optimizer steps lost or repeated        0     across the trainer kill: steps 1..N logged once each, the resumed
                                                  run continues from its checkpoint, trainer_state ends at N
  stalls ended within bound, diagnosed    all   each stop/half_open: the next step came within its bound and a
                                                  one-line diagnosis is in the trainer's log after it (a stop inside
                                                  a trainer or vLLM restart, or after the last step, is listed
                                                  apart: no step to time it by)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
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
SLOTS_BOUND_S = 100  # a freed slot shows in /health within: the server's ping (20 s) + its timeout (60 s) + margin
KINDS = {"kill": 1.0, "stop": 1.0, "drop": 2.0, "half_open": 1.0, "delay": 1.0}
PING_S = 20 + 60  # the session client's keepalive: an idle socket nobody answers is closed within ping interval + timeout
DIAGNOSIS = ("stalled:", "no reply", "reset failed", "connection lost", "env session failed", "left out of training")
REPLAYED, REPLAY_FAILED = "reset was replayed", "could not start the episode again"  # envs.core.client lines


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
        from tools import compose_file
        from tools.derive import env_kinds

        self.project, self.replicas = project, replicas
        env_file = work / "chaos.env"
        env_file.write_text(f"COMPOSE_PROJECT_NAME={project}\nCOMPOSE_PROFILES=echo\nMAX_CONCURRENT_ENVS=64\n"
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
        return proxy_container(self.proxy_name, self.stack, "tasks.env-echo:8000", seed)

    def held(self, backends, proxy) -> dict[str, int]:
        return proxy.held()

    def backend_of(self, container: str) -> None:
        return None  # the proxy resolves tasks by name: which one a container is, it does not know

    def down(self) -> None:
        sh("docker", "rm", "-f", self.proxy_name, check=False)
        self._fleet("down")
        self.exits.close()


def proxy_container(name: str, network: str, backends: str, seed: int, image: str | None = None,
                    also: tuple[str, ...] = ()) -> tuple["RemoteProxy", str]:
    """bench/chaos_proxy.py in a container `name` on `network` (and the networks `also`), resolving `backends`
    (NAME:PORT) per connection; its port and control port published on 127.0.0.1. Returns the proxy's driver and
    its address from the host."""
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
    return RemoteProxy(control, token), f"http://{listen}"


class RemoteProxy:
    """bench/chaos_proxy.py in a container, driven over its control port (one JSON line per command)."""

    def __init__(self, address: str, token: str) -> None:
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

    def frozen_link(self, link_id: int):
        from types import SimpleNamespace

        got = self.ask(f"frozen {link_id}")
        return None if got is None else SimpleNamespace(**got)

    def held(self) -> dict[str, int]:
        return self.ask("held")

    def waited(self, backend, start: float, end: float) -> bool:
        return bool(self.ask(f"waited {start} {end}"))

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


# ---------------------------------------------------------------------------- the injector
class Injector:
    """Seeded faults at random times while `active`; every event logged (JSONL) with its wall time."""

    def __init__(self, envs, proxy: ChaosProxy, seed: int, rate: float, log_path: Path) -> None:
        self.envs, self.proxy = envs, proxy
        self.random = random.Random(seed)
        self.mean_gap_s = 30.0 / rate
        self.log_path = log_path
        self.events: list[dict] = []
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)

    def record(self, kind: str, **detail) -> dict:
        event = {"time": time.time(), "kind": kind, **detail}
        self.events.append(event)
        with open(self.log_path, "a") as fh:
            fh.write(json.dumps(event) + "\n")
        log(f"inject {kind} {json.dumps(detail)}")
        return event

    def start(self) -> None:
        self.thread.start()

    def end(self) -> None:
        self.stop_event.set()
        self.thread.join(60)

    def _run(self) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        while not self.stop_event.wait(self.random.expovariate(1 / self.mean_gap_s)):
            kind = self.random.choices(kinds, weights)[0]
            try:
                getattr(self, f"fault_{kind}")()
            except Exception as exc:  # a container mid-restart: logged, the run goes on
                self.record(kind, error=f"{type(exc).__name__}: {exc}")

    def fault_kill(self) -> None:
        target = self.random.choice(self.envs.targets())
        pid = pid_of(target)
        if pid:
            os.kill(pid, signal.SIGKILL)
        self.record("kill", container=target[:12], pid=pid)

    def fault_stop(self) -> None:
        target = self.random.choice(self.envs.targets())
        pid = pid_of(target)
        hold = TOOL_TIMEOUT_S + 3
        backend = self.envs.backend_of(target)
        os.kill(pid, signal.SIGSTOP)
        event = self.record("stop", container=target[:12], pid=pid, hold_s=hold, backend=backend)
        time.sleep(hold)  # the fault's length, not a synchronisation
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        event["continued"] = time.time()

    def fault_drop(self) -> None:
        self.record("drop", **(self.proxy.drop() or {"link": None}))

    def fault_half_open(self) -> None:
        self.record("half_open", **(self.proxy.half_open() or {"link": None}))

    def fault_delay(self) -> None:
        self.proxy.delay(1.5, 10.0)
        self.record("delay", seconds=1.5, for_s=10.0)

    def fault_vllm_restart(self, trainer: "Rehearsal", after_step: int) -> None:
        """SIGKILL the twin (a crash): make rehearse's recovery must recreate it and resume (tools/commands/train)."""
        container = trainer.container("vllm")
        sh("docker", "kill", container)
        self.record("vllm_restart", container=container[:12], after_step=after_step)



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


class Rehearsal:
    """`python -m tools rehearse` with ROLLOUTS=async (TRL's AsyncGRPOTrainer in the trainer container, on the vLLM
    CPU twin) on a Compose project of its own, its ENV_URLS at the chaos proxy's container; Trainer's interface: the
    command's output lines with their time, the steps logged (read inside the running trainer container), a kill (of
    the trainer container) and a start again (RESUME=auto). `out` gets the run's folder copied from the outputs
    volume at the end (`collect`), so the figures read it as the sync run's."""

    def __init__(self, model: Path, proxy_url: str, work: Path, steps: int, seed: int, project: str) -> None:
        from bench.async_figures import Project

        self.out, self.steps = work / "outputs", steps
        self.project = Project(work, {
            "ENV_NAME": "echo", "ENV_URLS": f"echo={proxy_url}", "ROLLOUTS": "async", "RUN_NAME": "chaos",
            "TRAINER_PROCESSES": "1", "MAX_STEPS": str(steps), "SAVE_STEPS": "2", "LOGGING_STEPS": "1",
            "TOOL_TIMEOUT_S": str(TOOL_TIMEOUT_S), "RESET_TIMEOUT_S": str(RESET_TIMEOUT_S), "TRACE_EVERY": "1",
            "TRACE_SAMPLES": "64", "SEED": str(seed), "REPORT_TO": "none", "VLLM_SERVER_TIMEOUT_S": "600",
            # TRL's async trainer fills a step up to max_model_len tokens: ~500 samples a step at 4096 on the CPU twin;
            # 512 holds the longest echo episode (~410 tokens) and makes a step ~8x smaller (faults, not learning)
            "VLLM_MAX_MODEL_LEN": "512"},
            name=f"{project}-rehearse")
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


# ---------------------------------------------------------------------------- figures
def paired_wrong(rows: list[dict]) -> tuple[int, int]:
    """(calls checked, calls whose reply is not their own request's): echo answers with the message it was sent."""
    checked = wrong = 0
    for row in rows:
        for call in row.get("tool_calls", []):
            if call.get("failed"):
                continue
            message = (call.get("arguments") or {}).get("message")
            if not isinstance(message, str):
                continue
            checked += 1
            result = call.get("result")
            if call["tool"] == "echo_message":
                ok = result == message
            else:
                try:
                    ok = json.loads(result).get("message") == message
                except (ValueError, AttributeError):
                    ok = False
            wrong += not ok
    return checked, wrong


def figures(args, trainer: Trainer, injector: Injector, killed_at: dict, slots: dict, wall_s: float,
            generation_batch: int) -> dict:
    from trainer.rollouts import traces as rollouts

    rows = trainer.steps_logged()
    steps = [r["step"] for r in rows]
    traces = rollouts.read(trainer.out / "chaos" / rollouts.ROLLOUTS_FILE) \
        if (trainer.out / "chaos" / rollouts.ROLLOUTS_FILE).exists() else []
    checked, wrong = paired_wrong(traces)
    infra = sum(int(r.get("rollout/infra_failures") or 0) for r in rows)
    # sync: every step trains one generation batch; async: the worker's episodes scored in each step's logging window
    # (env/echo/episodes), infra-ended ones included (their samples are dropped before the queue)
    episodes = len(rows) * generation_batch if generation_batch else \
        sum(int(r.get("env/echo/episodes") or 0) for r in rows)
    state = json.loads((trainer.out / "chaos" / f"checkpoint-{args.steps}" / "trainer_state.json").read_text()) \
        if (trainer.out / "chaos" / f"checkpoint-{args.steps}" / "trainer_state.json").exists() else {}
    lost = sorted(set(range(1, args.steps + 1)) - set(steps))
    repeated = sorted({s for s in steps if steps.count(s) > 1})
    # stalls: a stopped server: the next step came within its bound; a half-open link: the trainer's side closed it
    # within its bound (a call's TOOL_TIMEOUT_S, a reset's RESET_TIMEOUT_S, an idle socket's keepalive). Diagnosis:
    # a line of the trainer's saying what failed, from the stall's start to its end (+5 s).
    bounds = {"stop": TOOL_TIMEOUT_S + 5 + 2 * RESET_TIMEOUT_S + args.step_allowance_s,
              "half_open": max(TOOL_TIMEOUT_S + 5, 2 * RESET_TIMEOUT_S, PING_S) + 5}
    # A restart (the trainer killed, the vLLM twin killed) logs no step until the run is back, and none comes after
    # the last: a stop inside a restart or after the last step is not timed by a next step (that would time the
    # restart, or never end), it is listed apart.
    restarts = [(e["time"], next((r["time"] for r in rows if r["time"] > e["time"]), time.time()))
                for e in injector.events if e["kind"] in ("trainer_kill", "vllm_restart") and not e.get("error")]
    if rows:
        restarts.append((rows[-1]["time"], math.inf))
    stalls, during_restart = [], []
    for event in injector.events:
        if event["kind"] not in bounds or event.get("error") or event.get("link", 1) is None:
            continue
        start = event["time"]
        if event["kind"] == "stop" and any(a <= event.get("continued", start) and start <= b for a, b in restarts):
            during_restart.append({"kind": "stop", "at": start})
            continue
        link = None
        if event["kind"] == "stop":
            after = [r["time"] for r in rows if r["time"] > start]
            end = after[0] if after else None
        else:
            link = injector.proxy.frozen_link(event["link"])
            end = link.client_gone_at if link is not None else None
        took = None if end is None else end - start
        window_end = (end if end is not None else time.time()) + 5
        if event["kind"] == "stop":
            window_end = max(window_end, event.get("continued", start) + 5)
            backend = tuple(event["backend"]) if event.get("backend") else None
            waited = injector.proxy.waited(backend, start, event.get("continued", window_end))
        else:  # a frozen link: a request went into it (a ping does not count), or it was idle until closed
            waited = bool(getattr(link, "waited", False)) if link is not None else True
        diagnosed = [text for t, text in trainer.lines if start <= t <= window_end and any(d in text for d in DIAGNOSIS)]
        stalls.append({"kind": event["kind"], "ended_after_s": took, "bound_s": bounds[event["kind"]],
                       "within": took is not None and took <= bounds[event["kind"]], "waited": waited,
                       "diagnosis": diagnosed[0][:240] if diagnosed else None})
    return {
        "wall_s": round(wall_s), "steps": args.steps, "replicas": args.replicas, "seed": args.seed, "rate": args.rate,
        "faults": {k: sum(1 for e in injector.events if e["kind"] == k and not e.get("error")) for k in KINDS},
        "trainer_kill": killed_at,
        "calls_checked": checked, "replies_paired_wrong": wrong,
        "episodes": episodes, "infra_failures": infra, "infra_share": infra / episodes if episodes else None,
        "slots_held_at_end": slots,
        "steps_lost": lost, "steps_repeated": repeated, "final_global_step": state.get("global_step"),
        "stalls": stalls, "stalls_during_restart": during_restart,
        "lost_by_cause": lost_by_cause(traces, rows, injector.events),
        # saved only when the replay finished inside the rollout loop's bound (else the loop had given up on it)
        "replayed": sum(replay_in_time(text) for _, text in trainer.lines),
        "replay_failed": sum(REPLAY_FAILED in text for _, text in trainer.lines),
        "rollouts": args.rollouts, "vllm_restart": vllm_restart_figure(injector.events, trainer.lines),
    }


def vllm_restart_figure(events: list[dict], lines: list[tuple[float, str]]) -> dict | None:
    """The twin killed once (async): whether make rehearse stopped the trainer for it (exit 77), restarted vLLM, and
    which checkpoint the run resumed from after it (None: no restart was injected)."""
    kill = next((e for e in events if e["kind"] == "vllm_restart" and not e.get("error")), None)
    if kill is None:
        return None
    after = [text for t, text in lines if t >= kill["time"]]
    resumed = next((m for text in after if (m := re.search(r"resuming from \S+/checkpoint-(\d+)", text))), None)
    return {"after_step": kill["after_step"],
            "trainer_stopped": any("went away mid-run" in text for text in after),
            "restarted": any("restarting the vllm service" in text for text in after),
            "resumed_from": int(resumed.group(1)) if resumed else None}


def replay_in_time(line: str) -> bool:
    """A client line saying an episode was replayed inside the rollout loop's bound (else the loop gave up first)."""
    m = re.search(r"([0-9.]+) s into the step", line) if REPLAYED in line else None
    return m is not None and float(m.group(1)) < TOOL_TIMEOUT_S


CAUSES = (("no reply within TOOL_TIMEOUT_S", "call past TOOL_TIMEOUT_S"), ("reset failed", "reset failed"),
          ("SESSION_LOST", "session lost mid-episode"), ("connection lost", "connection lost mid-call"),
          ("no reply", "no reply"), ("CAPACITY_REACHED", "no capacity"))


def cause_of(reason: str) -> str:
    return next((name for key, name in CAUSES if key in reason), "other")


def lost_by_cause(traces: list[dict], rows: list[dict], events: list[dict]) -> dict[str, dict[str, int]]:
    """Episodes the env side ended, by what the trainer saw (the trace's reason) and by the faults injected while
    their step ran (between the step before's record and theirs): {reason: {faults: n}}."""
    ends = {r["step"]: r["time"] for r in rows}
    out: dict[str, dict[str, int]] = {}
    for row in traces:
        if not row.get("infra_failure"):
            continue
        step = row.get("step")
        lo, hi = ends.get(step - 1, 0.0) if step else 0.0, ends.get(step, float("inf"))
        kinds = sorted({e["kind"] for e in events if lo <= e["time"] <= hi and not e.get("error")}) or ["none"]
        by = out.setdefault(cause_of(row["infra_failure"]), {})
        by["+".join(kinds)] = by.get("+".join(kinds), 0) + 1
    return out


def print_figures(f: dict) -> None:
    def line(name, value, goal, ok):
        print(f"  {name:<44} {value:<28} goal {goal:<8} {'ok' if ok else 'MISSED'}")

    mode = " (async rollouts)" if f.get("rollouts") == "async" else ""  # sync: the line as before
    print(f"== chaos figures{mode}: {f['steps']} steps, {f['replicas']} replicas, seed {f['seed']}, rate {f['rate']}, "
          f"{f['wall_s']} s; faults {f['faults']}; trainer killed {f['trainer_kill']}")
    line("replies paired with the wrong request", f"{f['replies_paired_wrong']} of {f['calls_checked']} checked",
         "0", f["replies_paired_wrong"] == 0)
    share = f["infra_share"]
    line("episodes lost to infrastructure", f"{f['infra_failures']} of {f['episodes']} ({(share or 0):.1%})", "<=1 %",
         share is not None and share <= 0.01)
    held = f["slots_held_at_end"]
    line("session slots held at the end", f"{sum(held['held'].values())} ({held['after_s']:.0f} s after exit)", "0",
         sum(held["held"].values()) == 0)
    lr = len(f["steps_lost"]) + len(f["steps_repeated"])
    line("optimizer steps lost/repeated (trainer kill)", f"{len(f['steps_lost'])}/{len(f['steps_repeated'])}, "
         f"final step {f['final_global_step']}", "0", lr == 0 and f["final_global_step"] == f["steps"])
    within = [s for s in f["stalls"] if s["within"]]
    line("stalls ended within their bound", f"{len(within)} of {len(f['stalls'])}", "all",
         len(within) == len(f["stalls"]))
    # a stall nothing waited on (a stopped server no request reached, a frozen link closed idle): nothing to say
    felt = [s for s in f["stalls"] if s.get("waited", True)]
    diagnosed = [s for s in felt if s["diagnosis"]]
    line("stalls diagnosed (one line each)", f"{len(diagnosed)} of {len(felt)} (+{len(f['stalls']) - len(felt)} "
         "nothing waited on)", "all", len(diagnosed) == len(felt))
    if f.get("stalls_during_restart"):
        print(f"    + {len(f['stalls_during_restart'])} stop(s) during a restart (trainer or vLLM killed, no step until "
              "the run is back) or after the last step: not timed")
    for s in f["stalls"]:
        took = "never" if s["ended_after_s"] is None else f"{s['ended_after_s']:.1f} s"
        print(f"    {s['kind']}: ended after {took} (bound {s['bound_s']:.0f} s); "
              f"{'waited on' if s.get('waited', True) else 'nothing waited on it'}; diagnosis: {s['diagnosis']}")
    print(f"  episodes lost, by what ended them and the faults of their step: {json.dumps(f['lost_by_cause'])}")
    print(f"  episodes saved by replaying their reset on a fresh session (lost before this fix): {f['replayed']}"
          f" (a replay that failed: {f['replay_failed']})")
    if f.get("rollouts") == "async":
        v = f["vllm_restart"] or {}
        line("vLLM twin killed mid-run, recovered", f"after step {v.get('after_step')}: resumed from checkpoint-"
             f"{v.get('resumed_from')}" if v else "not injected", "yes",
             bool(v) and v["restarted"] and v["resumed_from"] is not None and f["final_global_step"] == f["steps"])


# ---------------------------------------------------------------------------- the run
def run(args) -> dict:
    from contract.config import RunConfig

    work = Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(Path(args.model_cache))
    envs = (SwarmEnvs if args.fleet == "swarm" else ComposeEnvs)(args.replicas, args.project, work)
    proxy = trainer = None
    rehearsal = args.rollouts == "async"
    t0 = time.monotonic()
    try:
        backends = envs.up()
        log(f"{args.replicas} env-echo replicas ({args.fleet})"
            + (f" on {', '.join(f'{h}:{p}' for h, p in backends)}" if backends else ""))
        if rehearsal:  # the trainer container reaches the proxy's container by name on its envnet
            proxy_name = f"{args.project}-proxy"
            trainer = Rehearsal(model, f"http://{proxy_name}:9000", work, args.steps, args.seed, args.project)
            proxy, _ = proxy_container(proxy_name, f"{args.project}_envnet", "env-echo:8000", args.seed,
                                       also=(trainer.envnet,))
            generation_batch = None  # async: episodes read from the step records (figures)
        else:
            proxy, url = envs.proxy(backends, args.seed)
            trainer = Trainer(model, url, work / "outputs", args.steps, args.seed)
            generation_batch = RunConfig.load([], **{"env_name": "echo"}).generation_batch_size
        injector = Injector(envs, proxy, args.seed, args.rate, work / "chaos-log.jsonl")
        trainer.start("fresh")
        injector.start()
        killed_at: dict = {}
        vllm_killed = False
        rng = random.Random(args.seed + 1)
        deadline = time.monotonic() + args.guard_s  # a hang guard only
        while trainer.proc.poll() is None:
            done = trainer.steps_logged()
            if rehearsal and not vllm_killed and done and done[-1]["step"] >= args.vllm_restart_after:
                vllm_killed = time.monotonic()
                injector.fault_vllm_restart(trainer, done[-1]["step"])
            if rehearsal and vllm_killed and time.monotonic() - vllm_killed > args.vllm_bound_s and not any(
                    "restarting the vllm service" in text for _, text in trainer.lines):
                trainer.kill()  # a stall past its bound: one line, not a wait for ever
                raise SystemExit(f"the trainer did not stop for the killed vLLM twin within {args.vllm_bound_s:.0f} s "
                                 f"(no exit 77, no restart): see {work}")
            # async: the trainer kill once the vLLM restart was recovered from (a step logged after the resume)
            recovered = not rehearsal or (vllm_killed and any("resuming from" in text for _, text in trainer.lines))
            if args.kill_after and not killed_at and recovered and done and done[-1]["step"] >= args.kill_after:
                time.sleep(rng.uniform(0.5, 2.0))  # somewhere inside the next step (the fault's timing, drawn)
                if trainer.proc.poll() is None:
                    last = trainer.steps_logged()[-1]["step"]
                    trainer.kill()
                    killed_at = {"after_step": last, "time": time.time()}
                    injector.record("trainer_kill", after_step=last)
                    trainer.start("auto")
            if time.monotonic() > deadline:
                trainer.kill()
                raise SystemExit(f"the run did not finish in {args.guard_s} s (a hang): see {work}")
            time.sleep(0.5)
        injector.end()
        exit_code = trainer.proc.returncode
        if rehearsal:
            trainer.collect()
        if exit_code != 0:
            tail = "\n".join(text for _, text in trainer.lines[-30:])
            raise SystemExit(f"the trainer exited {exit_code}:\n{tail}")
        proxy.close()  # frozen links stay: the servers must free their slots by themselves
        start = time.monotonic()
        while True:  # until every replica shows no session, or the bound
            held = envs.held(backends, proxy)
            if all(v == 0 for v in held.values()) or time.monotonic() - start > SLOTS_BOUND_S:
                break
            time.sleep(1)
        slots = {"held": held, "after_s": time.monotonic() - start}
        result = figures(args, trainer, injector, killed_at, slots, time.monotonic() - t0, generation_batch)
        (work / "chaos-figures.json").write_text(json.dumps(result, indent=2))
        (work / "trainer.log").write_text("\n".join(f"{t:.3f} {text}" for t, text in trainer.lines))
        print_figures(result)
        log(f"log of faults: {work / 'chaos-log.jsonl'}; trainer log: {work / 'trainer.log'}")
        return result
    finally:
        if isinstance(proxy, ChaosProxy):
            for link in proxy.frozen:
                link.server.transport.abort()
        if not args.keep:
            if isinstance(proxy, RemoteProxy) and rehearsal:
                sh("docker", "rm", "-f", f"{args.project}-proxy", check=False)
            if isinstance(trainer, Rehearsal):
                trainer.down()
            envs.down()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rate", type=float, default=1.0, help="faults per 30 s (default 1: the default injection rate)")
    p.add_argument("--kill-after", type=int, default=None, help="kill the trainer after this step (default: steps/2; 0: no trainer kill)")
    p.add_argument("--fleet", choices=["compose", "swarm"], default="compose")
    p.add_argument("--rollouts", choices=["sync", "async"], default="sync", help="async: a `make rehearse` run with "
                   "ROLLOUTS=async (the vLLM CPU twin), and the twin killed once mid-run (vllm_restart)")
    p.add_argument("--vllm-restart-after", type=int, default=None, help="async: kill the twin after this step "
                   "(default: steps/4); the trainer kill comes once the run resumed from it")
    p.add_argument("--vllm-bound-s", type=float, default=300.0, help="async: the trainer must stop for the killed "
                   "twin (exit 77, make rehearse restarts it) within this (else the run ends with one line)")
    p.add_argument("--project", default="grpo-test-chaos")
    p.add_argument("--out", default=None, help="work folder (default: a new temporary one)")
    p.add_argument("--model-cache", default=str(Path(tempfile.gettempdir()) / "grpo-chaos-model"))
    p.add_argument("--step-allowance-s", type=float, default=60.0, help="a step's own time on this machine, added to "
                   "the stall bound (a busy 2-core machine takes tens of seconds per step)")
    p.add_argument("--guard-s", type=float, default=3600)
    p.add_argument("--keep", action="store_true", help="leave the env containers running")
    args = p.parse_args(argv)
    if args.kill_after is None:
        args.kill_after = max(1, args.steps // 2)
    if args.vllm_restart_after is None:
        args.vllm_restart_after = max(1, args.steps // 4)
    if args.rollouts == "async" and args.fleet != "compose":
        p.error("--rollouts async runs on the compose fleet (make rehearse's own project)")
    return args


if __name__ == "__main__":
    run(parse_args())
