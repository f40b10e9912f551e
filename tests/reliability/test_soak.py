"""Soak: every session slot busy for SOAK_MINUTES, while a tenth of the clients drop without closing.

N = the server's capacity (MAX_CONCURRENT_ENVS, 32 here) clients play short episodes for
SOAK_MINUTES (CI: 0.5, two rounds of drops; `make soak`: 10). Every DROP_EVERY_S seconds a tenth of them
vanish without a WebSocket close: half abort the TCP connection (a killed process), half go silent with the socket
left open (a frozen process: no frames, no pong); each is replaced by a fresh client, which must
wait for a slot (CAPACITY_REACHED) until the server notices. At the end the server must report every
slot free (/health, waited for: the reaper or the keepalive ping finds the silent ones, however long
that takes here), and then all N sessions connect and the (N+1)-th is refused; the container's memory
at full load (from the first sample with every slot in use) must be flat to the end of the soak.

SOAK_ENVS picks the env servers (default echo; e.g. SOAK_ENVS=echo,wordle,catch).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import threading
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from tests.reliability.common import CAPACITY, VALID_ACTIONS, report

pytestmark = pytest.mark.docker

SOAK_MINUTES = float(os.environ.get("SOAK_MINUTES", "0.5"))
SOAK_ENVS = [e.strip() for e in os.environ.get("SOAK_ENVS", "echo").split(",") if e.strip()]
DROP_EVERY_S = float(os.environ.get("SOAK_DROP_EVERY_S", "10"))
STEP_PAUSE_S = float(os.environ.get("SOAK_STEP_PAUSE_S", "0.05"))  # per client; keeps 2 shared cores usable
MEM_TOLERANCE = float(os.environ.get("SOAK_MEM_TOLERANCE", "0.15"))  # relative
MEM_SLACK_MIB = float(os.environ.get("SOAK_MEM_SLACK_MIB", "24"))  # absolute
# A silent client is found by the idle reaper (SESSION_TIMEOUT_S, checked every timeout/4 >= 5 s) or by the
# server's keepalive ping, whichever comes first; the test waits until the server reports every slot free
# (/health active_sessions), however long that takes here. This deadline only stops a hang (a leaked slot).
RECOVERY_GUARD_S = 600


# ------------------------------------------------------------------ memory sampling
_UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 1e3, "mb": 1e6, "gb": 1e9}


def _bytes(text: str) -> float:
    m = re.match(r"([\d.]+)\s*([a-zA-Z]+)", text.strip())
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def memory_mib(stack, env: str) -> dict:
    """cgroup usage as `docker stats` reports it, and the server process's RSS (PID 1)."""
    cid = stack.containers[env]
    usage = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.MemUsage}}", cid],
                           capture_output=True, text=True, check=True).stdout.split("/")[0]
    status = stack.exec(env, "cat", "/proc/1/status").stdout
    rss_kb = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    return {"cgroup": _bytes(usage) / 2**20, "rss": rss_kb / 1024}


class MemorySampler(threading.Thread):
    """Memory every `every_s`, each sample with the sessions the server reported open just before it."""

    def __init__(self, stack, env: str, every_s: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.stack, self.env, self.every_s = stack, env, every_s
        self.samples: list[tuple[float, dict]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self.stop.is_set():
            try:
                active = self.stack.health(self.env).get("active_sessions")
                self.samples.append((time.monotonic() - t0, {**memory_mib(self.stack, self.env), "active": active}))
            except Exception:
                pass
            self.stop.wait(self.every_s)


# ------------------------------------------------------------------ clients
class Stats:
    def __init__(self) -> None:
        self.episodes = self.steps = self.refused = self.aborted = self.silent = self.errors = 0
        self.connects = 0
        self.problems: list[str] = []
        self.dangling: list = []  # silent sockets: kept referenced so nothing closes them for us


async def request(ws, frame: dict, timeout: float = 60) -> dict:
    """Send a frame and read the reply; a refused session has its error frame queued already."""
    try:
        await ws.send(json.dumps(frame))
    except ConnectionClosed:
        pass
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def play(url: str, env: str, stats: Stats, stop_at: float, drop: asyncio.Event) -> None:
    """One client slot: keeps a session busy until stop_at, replacing itself after a drop."""
    rng = random.Random()
    delay = 0.2
    while time.monotonic() < stop_at:
        try:
            ws = await connect(url, open_timeout=30, max_size=None, ping_interval=None, close_timeout=5)
        except (OSError, InvalidHandshake, asyncio.TimeoutError) as e:
            stats.problems.append(f"connect failed: {type(e).__name__}: {e}")
            await asyncio.sleep(1)
            continue
        stats.connects += 1
        try:
            while time.monotonic() < stop_at:
                msg = await request(ws, {"type": "reset", "data": {"seed": rng.randrange(10**6)}})
                if msg["type"] == "error" and msg["data"].get("code") == "CAPACITY_REACHED":
                    stats.refused += 1
                    await ws.close()
                    await asyncio.sleep(delay * (1 + rng.random()))
                    delay = min(delay * 2, 3.0)
                    break
                assert msg["type"] == "observation", msg
                delay = 0.2
                for _ in range(3):
                    await asyncio.sleep(STEP_PAUSE_S)
                    if drop.is_set():
                        drop.clear()
                        if rng.random() < 0.5:
                            ws.transport.abort()  # killed client: RST, no close frame
                            stats.aborted += 1
                        else:
                            ws.transport.pause_reading()  # frozen client: socket open, silent
                            stats.silent += 1
                            stats.dangling.append(ws)
                        ws = None
                        break
                    msg = await request(ws, {"type": "step", "data": VALID_ACTIONS[env]})
                    if msg["type"] != "observation":
                        stats.errors += 1
                        stats.problems.append(f"step reply {str(msg)[:200]}")
                    stats.steps += 1
                    if msg.get("data", {}).get("done"):
                        break
                if ws is None:
                    break
                stats.episodes += 1
            else:
                await ws.send(json.dumps({"type": "close"}))
                await ws.close()
        except (ConnectionClosed, asyncio.TimeoutError) as e:
            stats.errors += 1
            stats.problems.append(f"session lost: {type(e).__name__}: {e}")


async def open_sessions(url: str, n: int) -> tuple[list, list[dict]]:
    """Open n sessions at once; return the sockets and each one's reply to a reset."""
    socks = await asyncio.gather(*(connect(url, open_timeout=30, max_size=None) for _ in range(n)))

    async def reset(ws):
        try:
            return await request(ws, {"type": "reset", "data": {}})
        except ConnectionClosed as e:
            return {"type": "closed", "data": {"reason": str(e)}}

    return list(socks), list(await asyncio.gather(*(reset(ws) for ws in socks)))


async def soak(url: str, env: str, minutes: float) -> Stats:
    stats = Stats()
    start = time.monotonic()
    stop_at = start + minutes * 60
    drops = [asyncio.Event() for _ in range(CAPACITY)]
    clients = [asyncio.create_task(play(url, env, stats, stop_at, d)) for d in drops]
    n_drop = max(1, CAPACITY // 10)
    rng = random.Random(0)
    # No drops in the last stretch, so the test checks recovery of the last ones too (bounded wait).
    while time.monotonic() < stop_at - 10:
        await asyncio.sleep(DROP_EVERY_S)
        for ev in rng.sample(drops, n_drop):
            ev.set()
    await asyncio.gather(*clients)
    return stats


def until_no_session_open(stack, env: str, what: str) -> float:
    """Until the server reports no session open (/health active_sessions): every close processed, every
    dropped client noticed (an aborted socket at once, a silent one by the reaper or the keepalive ping).
    Returns the seconds it took; RECOVERY_GUARD_S only stops a hang."""
    t0 = time.monotonic()
    assert "active_sessions" in stack.health(env), "the soak waits on /health active_sessions (envs.serve reports it)"
    while (active := stack.health(env)["active_sessions"]) != 0:
        assert time.monotonic() < t0 + RECOVERY_GUARD_S, f"{active} sessions still open {RECOVERY_GUARD_S} s {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


async def capacity_is_back(url: str) -> None:
    """With every slot free: all CAPACITY sessions open at once, and the next one is refused."""
    socks, replies = await open_sessions(url, CAPACITY + 1)
    await asyncio.gather(*(ws.close() for ws in socks), return_exceptions=True)
    ok = sum(r["type"] == "observation" for r in replies)
    refused = [r for r in replies if r["type"] == "error" and r["data"].get("code") == "CAPACITY_REACHED"]
    assert ok <= CAPACITY, f"{ok} sessions open at once with MAX_CONCURRENT_ENVS={CAPACITY}: over-commit"
    assert ok == CAPACITY and len(refused) == 1, (
        f"{ok}/{CAPACITY} sessions opened and {len(refused)} refused with every slot reported free: slots leaked")


@pytest.mark.parametrize("env", SOAK_ENVS)
def test_soak_full_capacity_with_dropped_clients(env_stack, env):
    if env not in env_stack.urls:
        pytest.skip(f"no {env} server")
    url = env_stack.ws(env)
    # the sessions of the tests before this one are freed once the server has processed their closes
    until_no_session_open(env_stack, env, "before the soak")
    before = env_stack.health(env)
    assert before.get("available_slots", CAPACITY) == CAPACITY, f"slots in use before the soak: {before}"

    sampler = None
    if env_stack.in_containers:
        idle_before = memory_mib(env_stack, env)
        sampler = MemorySampler(env_stack, env)
        sampler.start()
    t0 = time.monotonic()
    stats = asyncio.run(soak(url, env, SOAK_MINUTES))
    soak_s = time.monotonic() - t0
    if sampler:
        sampler.stop.set()
        sampler.join()
    recovery_s = until_no_session_open(env_stack, env, "after the soak")
    asyncio.run(capacity_is_back(url))
    until_no_session_open(env_stack, env, "after the capacity check")  # the next test finds every slot free
    after = env_stack.health(env)

    line = (f"soak {env}: {CAPACITY} sessions at full capacity for {soak_s / 60:.1f} min: {stats.episodes} episodes, "
            f"{stats.steps} steps, {stats.connects} connects, {stats.aborted} aborted + {stats.silent} silent drops, "
            f"{stats.refused} CAPACITY_REACHED retries, {stats.errors} errors; all {CAPACITY} slots free again "
            f"{recovery_s:.0f}s after the end; reaped by server: {after.get('reaped_sessions')}")
    report(line)
    assert not stats.problems, stats.problems[:5]
    assert stats.aborted + stats.silent >= max(1, CAPACITY // 10), "no client dropped: the soak tested nothing"
    assert stats.episodes > CAPACITY

    if sampler:
        samples = sampler.samples
        assert len(samples) >= 4, samples
        # Full load starts once every client has a session: from the first sample taken with every slot open.
        full = [i for i, (_, m) in enumerate(samples) if m["active"] == CAPACITY]
        assert full, f"the server never reported all {CAPACITY} slots in use: {[m['active'] for _, m in samples]}"
        load = [m for _, m in samples[full[0]:]]
        head, tail = load[: max(1, len(load) // 3)], load[-max(1, len(load) // 3):]
        start_mib = statistics.median(m["rss"] for m in head)
        end_mib = statistics.median(m["rss"] for m in tail)
        cg_start = statistics.median(m["cgroup"] for m in head)
        cg_end = statistics.median(m["cgroup"] for m in tail)
        idle_after = memory_mib(env_stack, env)
        report(f"soak {env} memory (MiB): idle before rss {idle_before['rss']:.0f} / cgroup {idle_before['cgroup']:.0f}; "
               f"under load start rss {start_mib:.0f} / cgroup {cg_start:.0f}, end rss {end_mib:.0f} / cgroup "
               f"{cg_end:.0f}; idle after rss {idle_after['rss']:.0f} / cgroup {idle_after['cgroup']:.0f}; "
               f"{len(samples)} samples; rss series {[round(m['rss']) for _, m in samples][::max(1, len(samples) // 20)]}")
        limit = start_mib * (1 + MEM_TOLERANCE) + MEM_SLACK_MIB
        assert end_mib <= limit, f"RSS grew under steady load: {start_mib:.0f} -> {end_mib:.0f} MiB (limit {limit:.0f})"
        cg_limit = cg_start * (1 + MEM_TOLERANCE) + MEM_SLACK_MIB
        assert cg_end <= cg_limit, f"container memory grew: {cg_start:.0f} -> {cg_end:.0f} MiB (limit {cg_limit:.0f})"
        state = env_stack.inspect(env)
        assert state["RestartCount"] == 0 and not state["State"]["OOMKilled"], state["State"]
