"""Env time per training step on echo: the zero-code path (tools learned from the server) vs the
hand-written echo tool class, side by side in one run against the same echo server.

    .venv/bin/python bench/adapter_overhead.py [--rollouts 8] [--steps 200]

A "step" is what TRL 1.16's GRPOTrainer does with the envs of one generation batch, one call after
another from one thread: reset every rollout, one tool call each, then `get_reward` each. Both
classes are bound exactly as the trainer binds them (`trainer.rollouts.envs_binding.bind`), so the figure is
the trainer's own `time/env_s`. Steps alternate between the two (A, B, A, B, ...) so machine noise
hits both alike. Goal: zero-code within 10 % of hand-written (printed as a ratio, not asserted).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SERVER_START_GUARD_S = 600  # a hang guard only: behind a CPU burner the start took over 60 s


def start_echo_server(sessions: int) -> tuple[subprocess.Popen, str]:
    import requests

    port = free_port()
    env = dict(os.environ, ENV_NAME="echo", HOST="127.0.0.1", PORT=str(port), MAX_CONCURRENT_ENVS=str(sessions),
               LOG_LEVEL="warning")
    proc = subprocess.Popen([sys.executable, "-m", "envs.serve"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_GUARD_S
    while True:
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"echo server exited with {proc.returncode} before answering /health")
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"echo server did not answer /health in {SERVER_START_GUARD_S} s")
        time.sleep(0.2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=8, help="rollouts per generation batch (default 8)")
    p.add_argument("--steps", type=int, default=200, help="steps per class (default 200)")
    args = p.parse_args()

    from envs import registry
    from envs.core.tool import close_session
    from envs.generic import GenericSpec
    from trainer.rollouts.envs_binding import bind
    from trainer.core.metrics import RolloutStats

    proc, url = start_echo_server(2 * args.rollouts)
    try:
        learned = GenericSpec.discover("echo", url)
        classes = {"hand-written EchoTool": registry.get("echo").tool_class, "zero-code (learned)": learned.tool_class}
        rows = {"hand-written EchoTool": registry.get("echo").make_dataset(args.rollouts, 0),
                "zero-code (learned)": learned.make_dataset(args.rollouts, 0)}
        stats = {label: RolloutStats() for label in classes}
        pools = {label: [bind("echo", cls, url, stats[label])() for _ in range(args.rollouts)]
                 for label, cls in classes.items()}
        per_step: dict[str, list[float]] = {label: [] for label in classes}
        for step in range(args.steps + 5):  # the first 5 warm up both and are dropped
            for label, pool in pools.items():
                stats[label].drain()
                for env, row in zip(pool, rows[label]):
                    env.reset(**{k: v for k, v in row.items() if k != "prompt"})
                for env, row in zip(pool, rows[label]):
                    env.echo_message(message=row.get("target", "apple"))
                for env in pool:
                    env.get_reward()
                if step >= 5:
                    per_step[label].append(stats[label].drain()[0].get("env", 0.0))
        for pool in pools.values():
            for env in pool:
                close_session(env)
    finally:
        proc.kill()
        proc.wait()

    print(f"env time per training step on echo ({args.rollouts} rollouts: reset, one echo_message call, "
          f"get_reward each; {args.steps} steps per class, interleaved)")
    medians = {}
    for label, values in per_step.items():
        values.sort()
        medians[label] = statistics.median(values)
        print(f"  {label:24s} median {medians[label] * 1e3:7.2f} ms   p90 {values[int(0.9 * len(values))] * 1e3:7.2f} ms"
              f"   mean {statistics.fmean(values) * 1e3:7.2f} ms")
    ratio = medians["zero-code (learned)"] / medians["hand-written EchoTool"]
    print(f"  ratio zero-code / hand-written: {ratio:.3f} (goal <= 1.10)")


if __name__ == "__main__":
    main()
