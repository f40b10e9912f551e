"""Load an OpenEnv server over /ws and print what it costs.

    python bench/env_load.py --env echo --url http://127.0.0.1:PORT --container NAME \
        --sessions 64 --steps 200 [--baseline URL --baseline-pid PID]

Opens N sessions (connect + reset), then each runs M steps with a valid policy (resetting when an
episode ends; `--one-episode` instead plays exactly one episode per session). Prints: sessions, set-up
time, steps/s, p50/p99 step latency, errors, server CPU seconds per step (from /proc/<pid>/stat of the
server process: `--container` resolves it with docker inspect, `--pid` for a local process) and
memory per idle session (server RSS growth after the N sessions connected and reset, / N).
With `--baseline` the same load runs against a second server and the ratios are printed.

The load is spread over `--procs` client processes; each reports its own CPU use, so the output says
whether the client (not the server) was the bottleneck.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CLK = os.sysconf("SC_CLK_TCK")


def server_pid(container: str | None, pid: int | None) -> int | None:
    if pid:
        return pid
    if container:
        out = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", container], capture_output=True, text=True)
        return int(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    return None


def proc_cpu_s(pid: int | None) -> float:
    if not pid:
        return float("nan")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime + stime, all threads


def proc_rss_mb(pid: int | None) -> float:
    if not pid:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Policy:
    """Valid actions per env, as ready-made JSON frames (keeps the client cheap)."""

    def __init__(self, env: str, rng: random.Random) -> None:
        self.env, self.rng = env, rng
        if env == "wordle":
            from envs.wordle.words import SECRET_WORDS

            self.words = list(SECRET_WORDS)
        self.begin()

    def begin(self) -> None:
        if self.env == "wordle":
            self.left = self.rng.sample(self.words, 6)  # no repeats: every guess is valid

    def reset_frame(self) -> str:
        return json.dumps({"type": "reset", "data": {"seed": self.rng.randrange(2**31)}})

    def step_frame(self) -> str:
        if self.env == "echo":
            data = {"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "apple"}}
        elif self.env == "wordle":
            data = {"message": f"[{self.left.pop()}]"}
        else:
            data = {"action_id": self.rng.randrange(3), "game_name": "catch", "game_params": {}}
        return json.dumps({"type": "step", "data": data})


async def run_client(args: dict, n: int, seed: int, conn) -> None:
    from websockets.asyncio.client import connect

    url = args["url"].rstrip("/").replace("http://", "ws://") + "/ws"
    rng = random.Random(seed)
    errors: list[str] = []
    lat: list[float] = []
    episodes = 0

    async def open_one():
        ws = await connect(url, open_timeout=120, ping_interval=20, ping_timeout=120, max_size=None, proxy=None)
        pol = Policy(args["env"], random.Random(rng.random()))
        await ws.send(pol.reset_frame())
        reply = json.loads(await ws.recv())
        if reply.get("type") == "error":
            errors.append(reply["data"].get("code", "?"))
        return ws, pol

    t0 = time.perf_counter()
    results = await asyncio.gather(*(open_one() for _ in range(n)), return_exceptions=True)
    sessions = [r for r in results if not isinstance(r, BaseException)]
    errors += [type(r).__name__ + ": " + str(r)[:120] for r in results if isinstance(r, BaseException)]
    conn.send(("ready", time.perf_counter() - t0, len(sessions)))
    conn.recv()  # go

    async def step_once(ws, pol) -> bool:
        """One step (and the reset after an episode ends); False when this session is finished."""
        nonlocal episodes
        frame = pol.step_frame()
        t = time.perf_counter()
        try:
            await ws.send(frame)
            reply = json.loads(await ws.recv())
        except Exception as e:
            errors.append(type(e).__name__ + ": " + str(e)[:120])
            return False
        lat.append(time.perf_counter() - t)
        if reply.get("type") == "error":
            errors.append(reply["data"].get("code", "?") + ": " + str(reply["data"].get("message"))[:120])
            return False
        if reply["data"].get("done"):
            episodes += 1
            if args["one_episode"]:
                return False
            pol.begin()
            await ws.send(pol.reset_frame())
            await ws.recv()
        return True

    def rounds():
        return itertools.count() if args["one_episode"] else range(args["steps"])

    async def drive(ws, pol):
        for _ in rounds():
            if not await step_once(ws, pol):
                return
            if args["think_s"]:
                await asyncio.sleep(args["think_s"])  # a rollout generates between tool calls

    async def in_turn():
        # TRL 1.16's _tool_call_loop: the batch's tool calls run one after another, then the model generates
        live = list(sessions)
        for _ in rounds():
            live = [s for s in live if await step_once(*s)]
            if not live:
                return
            if args["think_s"]:
                await asyncio.sleep(args["think_s"])

    c0 = time.process_time()
    t1 = time.perf_counter()
    if args["in_turn"]:
        await in_turn()
    else:
        await asyncio.gather(*(drive(ws, pol) for ws, pol in sessions))
    wall = time.perf_counter() - t1
    client_cpu = time.process_time() - c0
    await asyncio.gather(*(ws.close() for ws, _ in sessions), return_exceptions=True)
    conn.send(("done", lat, errors, wall, client_cpu, episodes))


def _client_main(args: dict, n: int, seed: int, conn) -> None:
    asyncio.run(run_client(args, n, seed, conn))


def run_load(url: str, pid: int | None, a: argparse.Namespace, label: str, replicas: list[str] | None = None) -> dict:
    """`replicas`: several servers of one env (a fleet's tasks): client process i loads replicas[i % len]."""
    replicas = replicas or [url]
    args = {"url": url, "env": a.env, "steps": a.steps, "one_episode": a.one_episode, "think_s": a.think_ms / 1000,
            "in_turn": a.in_turn}
    procs = 1 if a.in_turn else max(1, min(a.procs, a.sessions))
    shares = [a.sessions // procs + (i < a.sessions % procs) for i in range(procs)]
    rss0 = proc_rss_mb(pid)
    ctx = mp.get_context("fork")
    pipes, workers = [], []
    t0 = time.perf_counter()
    for i, n in enumerate(shares):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client_main, args=({**args, "url": replicas[i % len(replicas)]}, n, a.seed * 1000 + i,
                                                   child), daemon=True)
        p.start()
        pipes.append(parent)
        workers.append(p)
    ready = [c.recv() for c in pipes]
    setup_s = time.perf_counter() - t0
    connected = sum(r[2] for r in ready)
    time.sleep(1.0)  # let allocations settle before reading idle memory
    rss1 = proc_rss_mb(pid)
    cpu0 = proc_cpu_s(pid)
    t1 = time.perf_counter()
    for c in pipes:
        c.send("go")
    done = [c.recv() for c in pipes]
    wall = time.perf_counter() - t1
    cpu1 = proc_cpu_s(pid)
    for p in workers:
        p.join(10)
    lat = sorted(x for d in done for x in d[1])
    errors = [e for d in done for e in d[2]]
    steps = len(lat)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] * 1000 if lat else float("nan")

    out = {
        "label": label,
        "url": url,
        "sessions": connected,
        "setup_s": setup_s,
        "steps": steps,
        "episodes": sum(d[5] for d in done),
        "steps_per_s": steps / wall if wall else float("nan"),
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
        "errors": len(errors),
        "error_samples": sorted(set(errors))[:5],
        "server_cpu_ms_per_step": (cpu1 - cpu0) / steps * 1000 if steps else float("nan"),
        "server_cpu_util": (cpu1 - cpu0) / wall if wall else float("nan"),
        "client_cpu_util_per_proc": [round(d[4] / d[3], 2) if d[3] else 0 for d in done],
        "idle_mem_kb_per_session": (rss1 - rss0) * 1024 / connected if connected else float("nan"),
        "server_rss_mb": rss1,
    }
    return out


def show(r: dict) -> None:
    print(
        f"[{r['label']}] {r['url']}\n"
        f"  sessions {r['sessions']}  set-up {r['setup_s']:.2f} s  steps {r['steps']}  episodes {r['episodes']}"
        f"  steps/s {r['steps_per_s']:.0f}  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  errors {r['errors']}\n"
        f"  server CPU {r['server_cpu_ms_per_step']:.3f} ms/step (server at {r['server_cpu_util']:.0%} of a core;"
        f" client procs at {r['client_cpu_util_per_proc']} of a core)\n"
        f"  idle memory {r['idle_mem_kb_per_session']:.0f} KiB/session (server RSS {r['server_rss_mb']:.0f} MiB)"
    )
    for e in r["error_samples"]:
        print("  error:", e)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--env", required=True, choices=["echo", "wordle", "catch"])
    p.add_argument("--url", required=True)
    p.add_argument("--container", help="docker container of --url (for server CPU and memory)")
    p.add_argument("--pid", type=int, help="local process id of --url's server")
    p.add_argument("--baseline", help="URL of a second server to load the same way")
    p.add_argument("--baseline-container")
    p.add_argument("--baseline-pid", type=int)
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=100, help="steps per session")
    p.add_argument("--one-episode", action="store_true", help="each session plays one episode, then stops")
    p.add_argument("--think-ms", type=float, default=0.0,
                   help="pause per session between steps (0 = closed loop: every session always has a step in flight)")
    p.add_argument("--in-turn", action="store_true",
                   help="sessions step one after another (TRL's tool loop over a batch), not all at once")
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--fleet", action="store_true",
                   help="--url names a fleet service: spread the sessions over every address it resolves to")
    p.add_argument("--fleet-size", type=int, default=1, help="with --fleet: wait until the name resolves to this many")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    a = p.parse_args()

    replicas = None
    if a.fleet:  # every task behind the name, as the trainer's session clients spread over them
        from envs.core.replicas import resolve

        deadline = time.monotonic() + 120
        while len(replicas := resolve(a.url)) < a.fleet_size and time.monotonic() < deadline:
            time.sleep(1)  # Docker's DNS lists a task once it is healthy
        if len(replicas) < a.fleet_size:
            raise SystemExit(f"{a.url} resolves to {len(replicas)} addresses, not the {a.fleet_size} expected")
        a.procs = max(a.procs, len(replicas))
    results = [run_load(a.url, server_pid(a.container, a.pid), a, "target", replicas)]
    show(results[0])
    if a.baseline:
        results.append(run_load(a.baseline, server_pid(a.baseline_container, a.baseline_pid), a, "baseline"))
        show(results[1])
        t, b = results
        print(
            "  ratios target/baseline: server CPU per step "
            f"{t['server_cpu_ms_per_step'] / b['server_cpu_ms_per_step']:.2f}, p99 {t['p99_ms'] / b['p99_ms']:.2f}, "
            f"p50 {t['p50_ms'] / b['p50_ms']:.2f}, steps/s {t['steps_per_s'] / b['steps_per_s']:.2f}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
