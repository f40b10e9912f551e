"""The env-server figures, all in one run, each next to its goal: `make bench`.

Starts our three env servers from the real compose.yaml (project `grpo-bench`, images as built by
`make build`) and stock OpenEnv's echo server (bench/stock_echo_server.py, in the same image, so
both sides run in the same kind of container), then loads them with bench/env_load.py:

  wordle-connect  64 sessions connect + reset            goal: set-up < 5 s, no keepalive failures
  wordle-256      256 sessions play one episode each      goal: 0 errors
  echo-vs-stock   64 sessions, closed loop, both servers  goal: server CPU/step <= 2/3 of stock, p99 no worse
  catch-rollout   64 sessions, 100 ms think per step, x3  goal: p99 < 20 ms in each run
  catch-in-turn   64 sessions stepping one after another  goal: p99 < 20 ms (how TRL 1.16 drives them)
  catch-closed    64 sessions, closed loop                no goal: the server's ceiling, for reference

"Think" is the time a rollout spends generating between two tool calls. In catch-rollout all 64
sessions start together and think equally long, so steps arrive in bursts of up to 64: stricter than
TRL 1.16, whose tool loop calls a batch's tools one after another (catch-in-turn). The first burst is
fully synchronised and is 2 % of a run's steps, so p99 is about the middle of that burst: how fast
one server (with the load generator on the same cores) drains 64 simultaneous steps. The closed
loop keeps 64 steps in flight at all times; its latency is queueing (64 / steps per second), which
says how much headroom a server has.

Servers are reached at their container addresses when the host can route there (as the trainer
reaches them on the compose network), else through their published 127.0.0.1 ports.
Memory per idle session is printed for every env. Figures go to stdout and, with --json, to a file.
Everything it started is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.env_load import run_load, server_pid, show  # noqa: E402
from tools import compose_file, settings  # noqa: E402
from tools.env_kinds import env_kinds  # noqa: E402
from tools.images import local_env_image  # noqa: E402

PROJECT = "grpo-bench"
IMAGE = local_env_image()
STOCK = f"{PROJECT}-stock-echo"
CATCH_RUNS = 3


def sh(*cmd: str, check: bool = True) -> str:
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if check and res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}):\n{res.stderr[-2000:]}")
    return res.stdout.strip()


def direct_url(container: str, port: int, fallback: str) -> str:
    """The container's own address, as the trainer reaches it on the compose network, when this host
    can route to it (Linux); else the published 127.0.0.1 port, which adds docker-proxy's copy."""
    ip = sh("docker", "inspect", "-f", "{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}", container,
            check=False).split()
    for addr in ip:
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return f"http://{addr}:{port}"
        except OSError:
            pass
    return fallback


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not become healthy in {timeout:.0f} s")


def load(url: str, container: str, label: str, **kw) -> dict:
    a = argparse.Namespace(env=kw["env"], sessions=kw.get("sessions", 64), steps=kw.get("steps", 100),
                           one_episode=kw.get("one_episode", False), think_ms=kw.get("think_ms", 0.0),
                           procs=2, seed=kw.get("seed", 0), in_turn=kw.get("in_turn", False))
    r = run_load(url, server_pid(container, None), a, label)
    show(r)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write every result here")
    p.add_argument("--keep", action="store_true", help="leave the servers running afterwards")
    a = p.parse_args()

    if not sh("docker", "images", "-q", IMAGE, check=False):
        raise SystemExit(f"image {IMAGE} is missing: run `make build` first.")
    env_file = Path(tempfile.mkdtemp()) / "bench.env"
    # Capacity above the 256-session Wordle run; idle reaping off so a slow run cannot lose sessions.
    env_file.write_text(f"STACK_NAME={settings.load().stack_name}\nCOMPOSE_PROJECT_NAME={PROJECT}\n"  # IMAGE's stack
                        "COMPOSE_PROFILES=echo,wordle,catch\n"
                        "MAX_CONCURRENT_ENVS=300\nENV_SESSION_TIMEOUT_S=0\n")
    envs_file = env_file.parent / "compose.envs.yaml"  # the env services `make` generates from env-template
    envs_file.write_text(compose_file.yaml_text({"services": compose_file.env_services(env_kinds({"ENV_NAME": "echo,wordle,catch"}))}))
    compose = ["docker", "compose", "-f", str(ROOT / "compose.yaml"), "-f", str(envs_file), "--env-file", str(env_file)]
    results: dict[str, dict] = {}
    try:
        sh(*compose, "up", "-d", "--wait", "env-echo", "env-wordle", "env-catch")
        sh("docker", "rm", "-f", STOCK, check=False)
        # Stock server: same image, same hardening as ours, reached the same way (a 127.0.0.1 port).
        sh("docker", "run", "-d", "--name", STOCK, "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
           "-e", "MAX_CONCURRENT_ENVS=300", "-v", f"{ROOT / 'bench'}:/bench:ro", "-p", "127.0.0.1::8100",
           "--entrypoint", "python", IMAGE, "/bench/stock_echo_server.py", "--host", "0.0.0.0", "--port", "8100")
        published = {s: "http://" + sh(*compose, "port", f"env-{s}", "8000") for s in ("echo", "wordle", "catch")}
        published["stock"] = "http://" + sh("docker", "port", STOCK, "8100").splitlines()[0]
        names = {s: f"{PROJECT}-env-{s}-1" for s in ("echo", "wordle", "catch")}
        names["stock"] = STOCK
        for url in published.values():
            wait_healthy(url)
        urls = {s: direct_url(names[s], 8100 if s == "stock" else 8000, published[s]) for s in names}
        print("servers: " + ", ".join(f"{s} {u}" for s, u in urls.items()))

        # Catch first, while the machine is quiet: its goal is a latency, the others are counts and ratios
        print(f"== catch-rollout: 64 sessions, 100 ms think between steps, {CATCH_RUNS} runs (goal: p99 < 20 ms)")
        for i in range(CATCH_RUNS):  # a few runs: one run's p99 is the slowest ~30 of 3,200 steps
            results[f"catch-rollout-{i + 1}"] = load(urls["catch"], names["catch"], f"catch think 100 ms, run {i + 1}",
                                                     env="catch", steps=50, think_ms=100, seed=i)
        print("== catch-in-turn: 64 sessions stepping one after another, as TRL 1.16's tool loop calls them")
        results["catch-in-turn"] = load(urls["catch"], names["catch"], "catch in turn", env="catch", steps=30,
                                        think_ms=100, in_turn=True)
        print("== catch-closed: 64 sessions, closed loop (no goal: the ceiling)")
        results["catch-closed"] = load(urls["catch"], names["catch"], "catch closed loop", env="catch", steps=200)
        print("== wordle-connect: 64 sessions connect + reset (goal: < 5 s, no errors)")
        results["wordle-connect"] = load(urls["wordle"], names["wordle"], "wordle 64", env="wordle", steps=1)
        print("== wordle-256: 256 sessions, one episode each (goal: 0 errors)")
        results["wordle-256"] = load(urls["wordle"], names["wordle"], "wordle 256", env="wordle", sessions=256,
                                     one_episode=True)
        print("== echo-vs-stock: 64 sessions, closed loop (goal: CPU/step <= 2/3 of stock, p99 no worse)")
        results["echo"] = load(urls["echo"], names["echo"], "ours", env="echo", steps=100)
        results["echo-stock"] = load(urls["stock"], names["stock"], "stock", env="echo", steps=100)
        sh("docker", "rm", "-f", STOCK, check=False)  # it is still working off its backlog; stop it now
    finally:
        if not a.keep:
            sh("docker", "rm", "-f", STOCK, check=False)
            sh(*compose, "down", "-v", "--remove-orphans", check=False)

    ours, stock = results["echo"], results["echo-stock"]
    rows = [
        ("Wordle 64 sessions set-up", f"{results['wordle-connect']['setup_s']:.2f} s, "
         f"{results['wordle-connect']['errors']} errors", "< 5 s, 0 errors",
         results["wordle-connect"]["setup_s"] < 5 and results["wordle-connect"]["errors"] == 0),
        ("Wordle 256 sessions, 1 episode each", f"{results['wordle-256']['episodes']}/256 episodes, "
         f"{results['wordle-256']['errors']} errors", "256/256, 0 errors",
         results["wordle-256"]["episodes"] == 256 and results["wordle-256"]["errors"] == 0),
        ("Echo server CPU per step, ours/stock", f"{ours['server_cpu_ms_per_step']:.3f} / "
         f"{stock['server_cpu_ms_per_step']:.3f} ms = {ours['server_cpu_ms_per_step'] / stock['server_cpu_ms_per_step']:.2f}",
         "<= 0.67", ours["server_cpu_ms_per_step"] <= stock["server_cpu_ms_per_step"] * 2 / 3),
        ("Echo p99, ours/stock", f"{ours['p99_ms']:.1f} / {stock['p99_ms']:.1f} ms", "ours <= stock",
         ours["p99_ms"] <= stock["p99_ms"]),
        *[(f"Catch p99, 64 sessions, 100 ms think, run {i + 1}", f"{r['p99_ms']:.1f} ms (p50 {r['p50_ms']:.1f})",
           "< 20 ms", r["p99_ms"] < 20) for i, r in enumerate(results[f"catch-rollout-{j + 1}"] for j in range(CATCH_RUNS))],
        ("Catch p99, 64 sessions in turn (TRL's pattern)", f"{results['catch-in-turn']['p99_ms']:.1f} ms "
         f"(p50 {results['catch-in-turn']['p50_ms']:.1f})", "< 20 ms", results["catch-in-turn"]["p99_ms"] < 20),
        ("Catch closed loop (ceiling)", f"{results['catch-closed']['steps_per_s']:.0f} steps/s, p99 "
         f"{results['catch-closed']['p99_ms']:.1f} ms, {results['catch-closed']['server_cpu_ms_per_step']:.3f} ms CPU/step",
         "-", None),
    ]
    for env in ("echo", "wordle", "catch"):
        key = {"echo": "echo", "wordle": "wordle-connect", "catch": "catch-rollout-1"}[env]
        rows.append((f"{env} idle memory per session", f"{results[key]['idle_mem_kb_per_session']:.0f} KiB"
                     + (f" (stock {stock['idle_mem_kb_per_session']:.0f} KiB)" if env == "echo" else ""), "-", None))
    print("\n== summary")
    width = max(len(r[0]) for r in rows)
    for name, got, goal, ok in rows:
        mark = "" if ok is None else ("  met" if ok else "  NOT MET")
        print(f"  {name:<{width}}  {got:<48} goal {goal}{mark}")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
