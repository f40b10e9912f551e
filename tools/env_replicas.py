"""ENV_<NAME>_REPLICAS=auto: as many containers of an env image as the run needs, measured, not asked for.

`auto` is the default for an env learned from its server (an ENV_<NAME>_IMAGE): upstream OpenEnv images keep
create_app's default of ONE session per container, and the run opens one per rollout. The image is measured once on
a throw-away container (its own private network, the env services' hardening, a loopback port): the capacity its
/health reports, else the sessions it accepts counted up to the run's need (envs.core.probe: bounded in time, every
session closed). Replicas = ceil(sessions the run opens / sessions per container), at most ENV_REPLICAS_MAX.
The measurement is kept in .stack/capacity.json per image id and MAX_CONCURRENT_ENVS, so later runs reuse it.

Pure except `measure` (docker, the probe); tools/derive.py, tools/docker_host.py and tools/fleet.py apply the counts.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from envs.core.settings import DEFAULT_MAX_CONCURRENT_ENVS
from envs import naming
from envs.naming import replicas_var
from tools.env_ports import EnvPort

AUTO = "auto"
MAX_VAR = "ENV_REPLICAS_MAX"
DEFAULT_MAX = 16
START_TIMEOUT_S = 180  # the measured container's /health: an image's start-up (the env services allow 30 s + 6 x 5 s)


class ReplicasError(RuntimeError):
    """One line: the env, the numbers and the fix."""


def auto_envs(dotenv: dict[str, str], learned: list[str], builtin: list[str]) -> list[str]:
    """Envs whose replica count is measured: learned ones unless ENV_<NAME>_REPLICAS is a number, built-in ones only
    when it says `auto` (they report their capacity and take MAX_CONCURRENT_ENVS sessions each)."""
    out = []
    for name in [*learned, *builtin]:
        value = (dotenv.get(replicas_var(name)) or "").strip().lower()
        if value == AUTO or (not value and name in learned):
            out.append(name)
        elif value and not (value.isdigit() and int(value) >= 1):
            raise ReplicasError(f"{replicas_var(name)}={dotenv[replicas_var(name)]!r}: a number of containers (>= 1) or "
                                f"`auto` (measure one container, run as many as the run needs); edit .env")
    return out


def cap(dotenv: dict[str, str]) -> int:
    raw = (dotenv.get(MAX_VAR) or str(DEFAULT_MAX)).strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ReplicasError(f"{MAX_VAR}={raw!r}: the most containers `auto` may start per env (>= 1); edit .env")
    return int(raw)


@dataclass(frozen=True)
class Measurement:
    per_container: int  # sessions one container holds (at least; `exact` False when the count stopped at `upto`)
    upto: int  # sessions asked for when counting; a reported capacity is exact
    source: str  # "reported by /health" | "counted"

    @property
    def exact(self) -> bool:
        return self.source != "counted" or self.per_container < self.upto

    def covers(self, needed: int) -> bool:
        """Still good for a run that needs `needed` sessions (a count that stopped at a lower target is not)."""
        return self.exact or needed <= self.upto


def replicas_for(name: str, needed: int, m: Measurement, most: int) -> tuple[int, str]:
    """(containers, the one line `make up` prints); ReplicasError past the cap or for an image holding no session."""
    var = replicas_var(name)
    if m.per_container < 1:
        raise ReplicasError(f"env {name}: its image accepted no session when measured ({m.source}); `make logs` for "
                            f"env-{name}, or set {var} to a number in .env")
    count = max(1, math.ceil(needed / m.per_container))
    held = f"{m.per_container}{'' if m.exact else '+'} session(s) per container ({m.source})"
    if count > most:
        raise ReplicasError(f"env {name}: {held}, so the {needed} sessions this run opens need {count} containers, more "
                            f"than {MAX_VAR}={most}: raise {MAX_VAR}, lower the batch (PER_DEVICE_TRAIN_BATCH_SIZE, "
                            f"STEPS_PER_GENERATION), or set {var} in .env")
    return count, (f"env {name}: {held}; running {count} container(s) for the {needed} sessions this run opens "
                   f"({var}=auto, at most {MAX_VAR}={most})")


# ------------------------------------------------------------------------------------ the cache
def cache_key(image_id: str, dotenv: dict[str, str]) -> str:
    return f"{image_id}|MAX_CONCURRENT_ENVS={dotenv.get('MAX_CONCURRENT_ENVS') or DEFAULT_MAX_CONCURRENT_ENVS}"


def load_cache(path: Path) -> dict[str, Measurement]:
    try:
        raw = json.loads(path.read_text())
        return {k: Measurement(**v) for k, v in raw.items()}
    except (OSError, ValueError, TypeError):
        return {}


def save_cache(path: Path, cache: dict[str, Measurement]) -> None:
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: vars(m) for k, m in cache.items()}, indent=1))


# ------------------------------------------------------------------------------------ measuring
def hardening_flags(dotenv: dict[str, str], user: str = naming.SERVER_USER) -> list[str]:
    """compose.yaml's env-server hardening, as `docker run` flags (the measured container runs untrusted code too)."""
    return ["--user", user, "--read-only", "--tmpfs", "/tmp:size=64m", "--cap-drop", "ALL", "--security-opt", "no-new-privileges:true",
            "--memory", dotenv.get("ENV_MEM_LIMIT") or "4g", "--pids-limit", "512",
            "-e", f"MAX_CONCURRENT_ENVS={dotenv.get('MAX_CONCURRENT_ENVS') or DEFAULT_MAX_CONCURRENT_ENVS}",
            "-e", f"SESSION_TIMEOUT_S={dotenv.get('ENV_SESSION_TIMEOUT_S') or '600'}"]


def measure(image: str, needed: int, dotenv: dict[str, str], run: Callable[..., subprocess.CompletedProcess],
            say: Callable[[str], None], *, port: EnvPort, builtin_env: str | None = None,
            user: str = naming.SERVER_USER) -> Measurement:
    """Start one container of `image` on a private network with `port` (its server's, tools/env_ports.py) published on
    loopback, wait for its /health, and measure. `builtin_env`: our env-server image serves the env its ENV_NAME
    names (an upstream image is not told one)."""
    from envs.core import probe

    tag = f"grpo-capacity-{uuid.uuid4().hex[:8]}"
    say(f"measuring how many sessions one {image} container holds (once per image; .stack/capacity.json)")
    if run(["docker", "network", "create", "--label", "grpo-capacity=1", tag]).returncode != 0:
        raise ReplicasError(f"measuring {image}: `docker network create` failed")
    try:
        r = run(["docker", "run", "-d", "--name", tag, "--label", "grpo-capacity=1", "--network", tag,
                 "-p", f"127.0.0.1::{port.port}", "-e", f"PORT={port.port}", *hardening_flags(dotenv, user),
                 *(["-e", f"ENV_NAME={builtin_env}"] if builtin_env else []), "--", image])
        if r.returncode != 0:
            raise ReplicasError(f"measuring {image}: the container did not start ({(r.stderr.strip() or '?')[-300:]})")
        published = run(["docker", "port", tag, f"{port.port}/tcp"]).stdout.split("\n")[0].rsplit(":", 1)[-1]
        url = f"http://127.0.0.1:{published}"
        capacity = wait_healthy(url, tag, run, port)
        if capacity is not None:
            return Measurement(capacity, capacity, "reported by /health")
        accepted, problem = probe.count_sessions(url, needed)
        if not accepted:  # no /ws: an OpenEnv server serving only HTTP holds MCP sessions there, if at all
            from envs.core import http_mcp

            over_http = http_mcp.count_sessions(url, needed)
            accepted, problem = over_http if over_http[0] else (accepted, problem)
        if problem and not accepted:
            raise ReplicasError(f"measuring {image}: {http_only_reason(url, port) or problem}")
        return Measurement(accepted, needed, "counted")
    finally:
        run(["docker", "rm", "-f", tag])
        run(["docker", "network", "rm", tag])


def http_only_reason(url: str, port: EnvPort) -> str | None:
    """Why a server that opened no session on /ws nor over HTTP cannot be trained, where it serves OpenEnv's HTTP
    routes only (the line discovery gives, envs.generic.http_only), instead of the /ws handshake's refusal; None for
    any other server (its session problem is the line)."""
    from envs.generic import http_only

    found = http_only.survey(url)
    return None if found.trainable else http_only.refusal(f"its server on port {port.port}", found)


def wait_healthy(url: str, container: str, run: Callable[..., subprocess.CompletedProcess], port: EnvPort) -> int | None:
    """Until GET /health answers 200 (its reported capacity, or None); ReplicasError if the container exits first,
    naming `port` (the container's, published at `url`) and where it came from."""
    from envs.core import probe

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            status, body = probe.get_json(f"{url}/health", probe.HEALTH_DEADLINE_S, probe.MAX_HEALTH_BYTES)
            if status == 200:
                body = body if isinstance(body, dict) else {}
                return next((body[k] for k in ("max_concurrent_envs", "max_sessions", "capacity")
                             if isinstance(body.get(k), int)), None)
        except probe.ProbeError:
            pass
        running = run(["docker", "inspect", "-f", "{{.State.Running}}", container]).stdout.strip()
        if running != "true" or time.monotonic() > deadline:
            logs = run(["docker", "logs", "--tail", "20", container])
            raise ReplicasError(f"the measured container never answered GET /health ("
                                f"{'exited' if running != 'true' else f'{START_TIMEOUT_S} s'}) on {port}: is it an "
                                f"OpenEnv server listening there? last log lines: "
                                f"{last_log_lines(logs.stdout + logs.stderr)!r}")
        time.sleep(0.5)


# An access-log line of a GET /health (uvicorn: `INFO: 127.0.0.1:40312 - "GET /health HTTP/1.1" 200 OK`): in a
# container that never answered ours, these are the image's own HEALTHCHECK, on its own port, not our probe's.
HEALTH_ACCESS_LINE = re.compile(r'"GET /health[ ?][^"]*"')


def last_log_lines(text: str, count: int = 5, chars: int = 300) -> str:
    """A container's last `count` log lines (at most `chars`) to quote, without the access-log lines of GET /health."""
    lines = [line for line in text.strip().splitlines() if not HEALTH_ACCESS_LINE.search(line)]
    return "\n".join(lines[-count:])[-chars:]
