"""`make bench-async`: sync vs async rollouts on `make rehearse`, side by side in one run, with a slow env (each tool
call 250 ms) and with the instant one.

    .venv/bin/python bench/async_figures.py [--steps 12] [--delay 0.25] [--processes 1] [--only sync] [--model DIR]

Each run is `python -m tools rehearse` itself (the vLLM CPU twin as the vllm service, the trainer on CPU, weights by
reload) on one Compose project of its own, with the same seed, batch and number of steps, so every run trains on the
same number of samples. The slow env is our echo server with ENV_STEP_DELAY_S. Per run:
  * optimizer steps per minute, between the first and the last logged step (start-up left out);
  * generated tokens per second and the vLLM busy fraction (share of samples with a request running), from the
    twin's own /metrics, polled every 0.2 s inside its container over the same span;
  * the reward of the last 3 steps (the trainer's `reward`, logged alike in both modes): after the same number of
    trained samples in every run.
Goals printed beside: async >= 1.5x sync's steps per minute on the slow env, reward within 0.05 of sync's.
A benchmark, not a test: it prints the figures and never fails on them. Async runs only where ROLLOUTS is a setting
(#31 item 1); without it the sync half is printed and the async half says why it is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.images import TRAINER_REHEARSE_BUILD, image_of  # noqa: E402

GOALS = {"speedup_slow": 1.5, "reward_gap": 0.05}
READER_IMAGE = image_of(TRAINER_REHEARSE_BUILD)   # make rehearse's trainer image (built by the first run)
POLL = """
import re, sys, time, urllib.request
while True:
    try:
        text = urllib.request.urlopen('http://127.0.0.1:8000/metrics', timeout=5).read().decode()
        def total(name):
            return sum(float(v) for v in re.findall(r'^' + name + r'(?:\\{[^}]*\\})? ([0-9.eE+-]+)$', text, re.M))
        print(time.time(), total('vllm:num_requests_running'), total('vllm:generation_tokens_total'), flush=True)
    except Exception as exc:
        print('#', exc, flush=True)
    time.sleep(0.2)
"""


def async_available() -> bool:
    from contract.config import RunConfig

    return "rollouts" in RunConfig.model_fields


class Project:
    """One Compose project driven by `python -m tools` with its own env file (never your .env or stack)."""

    def __init__(self, folder: Path, settings: dict[str, str], name: str | None = None):
        from tools.errors import parse_env_file

        self.name = name or f"grpo-bench-async-{uuid.uuid4().hex[:6]}"
        values = {**parse_env_file(ROOT / ".env.example"), **settings, "COMPOSE_PROJECT_NAME": self.name,
                  "TRAIN_MODE": "cpu"}  # rehearse ignores TRAIN_MODE; `down` then probes no GPU
        self.env_file = folder / f"{self.name}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))

    def tools(self, *args: str, env: dict[str, str] | None = None, quiet: bool = False) -> int:
        run_env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
        run_env.update(STACK_ENV_FILE=str(self.env_file), **(env or {}))
        out = subprocess.DEVNULL if quiet else None
        return subprocess.call([sys.executable, "-m", "tools", *args], cwd=ROOT, env=run_env, stdout=out, stderr=out)

    def vllm_container(self) -> str | None:
        ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
                              "--filter", "label=com.docker.compose.service=vllm", "--filter", "health=healthy"],
                             capture_output=True, text=True).stdout.split()
        return ids[0] if ids else None

    def read(self, path: str) -> str:
        return subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "cat", "-v",
                               f"{self.name}_outputs:/outputs:ro", READER_IMAGE, path],
                              capture_output=True, text=True).stdout

    def seed_model(self, folder: Path) -> None:
        """Put a tiny model made by `python -m trainer.tiny_model` where model-init makes it (model-init then finds it
        complete and skips its minutes of warm-start)."""
        from contract.config import CPU_DEFAULT_MODEL

        volume = f"{self.name}_models"
        subprocess.run(["docker", "volume", "create", "--label", f"com.docker.compose.project={self.name}", "--label",
                        "com.docker.compose.volume=models", volume], check=True, capture_output=True)
        subprocess.run(["docker", "run", "--rm", "--user", "0", "--entrypoint", "sh", "-v", f"{volume}:/models", "-v",
                        f"{folder.resolve()}:/src:ro", READER_IMAGE, "-c",
                        f"cp -r /src {CPU_DEFAULT_MODEL} && chown -R 10001:10001 /models"], check=True, capture_output=True)

    def down(self) -> None:
        # by project name alone: `python -m tools compose` validates the .env first, and this one's TRAIN_MODE=cpu with
        # ROLLOUTS=async is refused there (the containers, the twin among them, were left running)
        down = ["docker", "compose", "-p", self.name, "down", "--volumes", "--remove-orphans"]
        subprocess.run(down, capture_output=True)
        # `compose run --rm` containers (the trainer's, model-init's) are removed by the engine after they exit, which
        # may be after the command returned: remove what is listed, wait (bounded) until the engine is done, then down
        # again for the volumes and network such a late container still held
        listed = ["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.name}"]
        ids = subprocess.run(listed, capture_output=True, text=True).stdout.split()
        if not ids:
            return
        deadline = time.monotonic() + 120
        while ids and time.monotonic() < deadline:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)  # one being removed already: an error
            time.sleep(0.5)
            ids = subprocess.run(listed, capture_output=True, text=True).stdout.split()
        if ids:
            print(f"[bench] containers of {self.name} still there after 120 s: {' '.join(ids)}", flush=True)
        subprocess.run(down, capture_output=True)


class MetricsPoller:
    """vLLM's /metrics polled inside the twin's container (it publishes no port) while a run goes on."""

    def __init__(self, project: Project):
        self.project, self.samples, self.proc = project, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():  # the twin is (re)started by the run itself: wait until it is healthy
            container = self.project.vllm_container()
            if container:
                break
            self.stop.wait(1)
        else:
            return
        self.proc = subprocess.Popen(["docker", "exec", container, "python3", "-c", POLL], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
        for line in self.proc.stdout:
            if not line.startswith("#"):
                self.samples.append(tuple(float(x) for x in line.split()))

    def close(self) -> list[tuple[float, float, float]]:
        self.stop.set()
        if self.proc:
            self.proc.terminate()
        self.thread.join(timeout=10)
        return self.samples


def figures(rows: list[dict], samples: list[tuple[float, float, float]]) -> dict[str, float]:
    """Steps/min over the logged steps, tokens/s and busy share over the same span, reward of the last 3 steps."""
    first, last = rows[0], rows[-1]
    start, end = first["time"] - first.get("step_time", 0.0), last["time"]
    span = [s for s in samples if start <= s[0] <= end]
    tokens = (span[-1][2] - span[0][2]) / (span[-1][0] - span[0][0]) if len(span) > 1 else float("nan")
    busy = sum(s[1] > 0 for s in span) / len(span) if span else float("nan")
    rewards = [r["reward"] for r in rows[-3:]]  # the trainer's reward, logged alike by the sync and async trainers

    def per_step(key: str) -> float:  # where a step's time goes (the trainer's own timers)
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else float("nan")

    return {"steps_per_min": 60 * len(rows) / (end - start), "tokens_per_s": tokens, "busy": busy,
            "reward": sum(rewards) / len(rewards), "steps": len(rows), "gen_s": per_step("time/generation_s"),
            "env_s": per_step("time/env_s"), "train_s": per_step("time/training_s")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run (the same in every run)")
    p.add_argument("--delay", type=float, default=0.25, help="seconds the slow env takes per tool call")
    p.add_argument("--processes", type=int, default=1, help="TRAINER_PROCESSES of every run")
    p.add_argument("--only", choices=("sync", "async"), default=None, help="run one rollout mode only")
    p.add_argument("--model", type=Path, default=None, help="a tiny model already made (trainer.tiny_model) to start "
                   "from; default: model-init makes one (minutes)")
    args = p.parse_args()
    modes = [m for m in ("sync", "async") if args.only in (None, m)]
    missing_async = "async" in modes and not async_available()
    if missing_async:
        modes.remove("async")
    settings = {"ENV_NAME": "echo", "MAX_STEPS": str(args.steps), "SEED": "42", "RESUME": "fresh", "LOGGING_STEPS": "1",
                "SAVE_STEPS": "100000", "TRACE_EVERY": "0", "DATASET_SIZE": "64", "TRAINER_PROCESSES": str(args.processes),
                "VLLM_SERVER_TIMEOUT_S": "900"}
    results: dict[tuple[str, str], dict] = {}
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        project = Project(Path(tmp), settings)
        try:
            if args.model:
                project.seed_model(args.model)
            for env, delay in (("slow", args.delay), ("instant", 0.0)):
                for mode in modes:
                    run = f"{mode}-{env}"
                    print(f"[bench-async] {run}: make rehearse, {args.steps} steps, tool calls {delay * 1000:.0f} ms",
                          flush=True)
                    poller = MetricsPoller(project)
                    t0 = time.monotonic()
                    extra = {"RUN_NAME": run, "ENV_STEP_DELAY_S": str(delay), **({"ROLLOUTS": mode} if async_available() else {})}
                    rc = project.tools("rehearse", env=extra, quiet=True)
                    samples = poller.close()
                    rows = [json.loads(x) for x in project.read(f"/outputs/{run}/metrics.jsonl").splitlines()
                            if '"kind": "step"' in x]
                    if rc != 0 or not rows:
                        print(f"[bench-async] {run}: make rehearse exited {rc} with {len(rows)} steps logged; rerun "
                              f"`STACK_ENV_FILE={project.env_file} python -m tools rehearse` to see why", flush=True)
                        continue
                    try:
                        results[(env, mode)] = figures(rows, samples)
                    except (KeyError, ZeroDivisionError) as exc:  # one run's odd log must not lose the others
                        print(f"[bench-async] {run}: no figures ({exc!r})", flush=True)
                        continue
                    print(f"[bench-async] {run}: done in {time.monotonic() - t0:.0f}s", flush=True)
        finally:
            project.down()
    print(f"\nsync vs async rollouts on make rehearse (echo, {args.steps} steps, TRAINER_PROCESSES={args.processes}):")
    print(f"  {'env':<8} {'rollouts':<8} {'steps/min':>9} {'gen tok/s':>9} {'vLLM busy':>9} {'reward (last 3)':>15}"
          f"   per step: generation / env / training s")
    for (env, mode), f in results.items():
        print(f"  {env:<8} {mode:<8} {f['steps_per_min']:>9.2f} {f['tokens_per_s']:>9.1f} {f['busy']:>9.0%} "
              f"{f['reward']:>15.3f}   {f['gen_s']:.2f} / {f['env_s']:.2f} / {f['train_s']:.2f}")
    if missing_async:
        print("  async: not run: ROLLOUTS is not a setting of this checkout yet (#31 item 1)")
    sync, asy = results.get(("slow", "sync")), results.get(("slow", "async"))
    if sync and asy:
        speedup, gap = asy["steps_per_min"] / sync["steps_per_min"], abs(asy["reward"] - sync["reward"])
        print(f"  slow env: async {speedup:.2f}x sync's steps/min (goal >= {GOALS['speedup_slow']}x: "
              f"{'met' if speedup >= GOALS['speedup_slow'] else 'NOT met'}); reward gap {gap:.3f} (goal <= "
              f"{GOALS['reward_gap']}: {'met' if gap <= GOALS['reward_gap'] else 'NOT met'})")
    else:
        print(f"  goals (need both slow-env runs): async >= {GOALS['speedup_slow']}x sync's steps/min, reward within "
              f"{GOALS['reward_gap']}")


if __name__ == "__main__":
    main()
