"""Env-server fleets on Docker Swarm, in figures: `make bench-fleet` (docs/fleets.md).

Deploys echo fleets with tools/fleet.py (the `make fleet-up` path, from an env file) on this engine's swarm
(a one-node swarm is initialised for the run when there is none, and left afterwards), and loads them with
bench/env_load.py from a container on the fleet's overlay network, spreading sessions over the tasks that
`tasks.env-echo` resolves to, as the trainer does:

  throughput  the same closed-loop load on 1, 2 and 4 tasks                     printed: steps/s, ratio to 1 task
  capacity    16 tasks x 256 sessions = 4,096 sessions connect, reset and step   goal: 0 errors

On one machine the tasks share its cores with the load generator, so the throughput ratio says what
one host gains from more tasks (little, on 2 cores); across machines each task brings its own cores.
Everything it started is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools import fleet
from tools.images import local_env_image

STACK = "grpo-bench-fleet"
IMAGE = local_env_image()


def deploy(env_file: Path, tasks: int, capacity: int) -> None:
    # FLEET_ALLOW_NEW_PRIVILEGES: only our own echo image runs, on whatever daemon this machine has
    env_file.write_text(f"ENV_NAME=echo\nENV_FLEET=swarm\nFLEET_STACK={STACK}\nENV_ECHO_REPLICAS={tasks}\n"
                        f"MAX_CONCURRENT_ENVS={capacity}\nENV_MEM_LIMIT=1g\nFLEET_ALLOW_NEW_PRIVILEGES=1\n")
    res = subprocess.run([sys.executable, "-m", "tools", "fleet", "up"], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, STACK_ENV_FILE=str(env_file)))
    if res.returncode != 0:
        raise SystemExit(f"fleet up ({tasks} tasks) failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")


def load(tasks: int, sessions: int, steps: int, procs: int, label: str) -> dict:
    """bench/env_load.py in a container on the fleet's network (the host cannot route to overlay addresses)."""
    with tempfile.TemporaryDirectory() as out:
        os.chmod(out, 0o777)  # the image's uid 10001 writes the figures here
        cmd = ["docker", "run", "--rm", "--network", STACK, "-v", f"{ROOT}:/src:ro", "-v", f"{out}:/out", "-w", "/src",
               "-e", "PYTHONDONTWRITEBYTECODE=1", "--entrypoint", "python", IMAGE, "bench/env_load.py", "--env", "echo",
               "--url", "http://tasks.env-echo:8000", "--fleet", "--fleet-size", str(tasks), "--sessions", str(sessions), "--steps", str(steps),
               "--procs", str(procs), "--json", "/out/figures.json"]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise SystemExit(f"load ({label}) failed:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        figures = json.loads((Path(out) / "figures.json").read_text())[0]
    figures["label"] = label
    return figures


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", type=int, default=16, help="capacity run: fleet tasks")
    p.add_argument("--sessions-per-task", type=int, default=256, help="capacity run: sessions per task")
    p.add_argument("--capacity-steps", type=int, default=3, help="capacity run: steps per session")
    p.add_argument("--throughput-tasks", default="1,2,4", help="throughput runs: fleet sizes")
    p.add_argument("--throughput-sessions", type=int, default=256)
    p.add_argument("--throughput-steps", type=int, default=100, help="steps per session")
    p.add_argument("--procs", type=int, default=8, help="load-generator processes")
    a = p.parse_args()

    lines, ok = [], True
    with fleet.local_swarm() as created, tempfile.TemporaryDirectory() as tmp:
        env_file = Path(tmp) / "bench-fleet.env"
        print(f"[bench] swarm: {'initialised for this run' if created else 'this engine is a manager already'}")
        try:
            # Growing fleets only: a task being stopped by a scale-down would still hold sessions for a moment.
            base = None
            for n in [int(x) for x in a.throughput_tasks.split(",")]:
                deploy(env_file, n, a.throughput_sessions)
                r = load(n, a.throughput_sessions, a.throughput_steps, a.procs, f"{n} task(s)")
                base = base or r["steps_per_s"]
                lines.append(f"throughput {n:>2} task(s): {r['steps_per_s']:>7.0f} steps/s ({r['steps_per_s'] / base:.2f}x "
                             f"1 task), p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, errors {r['errors']}"
                             f"  ({a.throughput_sessions} sessions, closed loop)")
            sessions = a.tasks * a.sessions_per_task
            deploy(env_file, a.tasks, a.sessions_per_task)
            r = load(a.tasks, sessions, a.capacity_steps, max(a.procs, a.tasks),
                     f"capacity {a.tasks} x {a.sessions_per_task}")
            ok = r["sessions"] == sessions and r["errors"] == 0
            lines.append(f"capacity   {r['sessions']:>5} of {sessions} sessions held by {a.tasks} tasks, set-up "
                         f"{r['setup_s']:.1f} s, {r['steps']} steps, errors {r['errors']}   goal: {sessions} with 0 "
                         f"errors -> {'met' if ok else 'MISSED'}")
            for e in r["error_samples"]:
                lines.append(f"           error: {e}")
        finally:
            subprocess.run([sys.executable, "-m", "tools", "fleet", "down"], cwd=ROOT, capture_output=True,
                           env=dict(os.environ, STACK_ENV_FILE=str(env_file)))
    cores = os.cpu_count()
    print(f"[bench] fleet figures (one machine, {cores} cores, load generator on the same cores):")
    print("\n".join("  " + line for line in lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
