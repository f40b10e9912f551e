"""`make bench-async`: which learns sooner, sync or async rollouts, on `make rehearse`: side by side in one run, the
same seeds, env and model, with a slow env (each tool call 250 ms) and the instant one.

    .venv/bin/python bench/async_figures.py [--seeds 42,7] [--envs slow,instant] [--max-steps 24] [--bar 0.8]
                                            [--check-every 1] [--staleness 1,2] [--cpusets auto] [--model DIR]

Each run is `python -m tools rehearse` itself (the vLLM CPU twin as the vllm service, the trainer on CPU, weights by
reload) on one Compose project, the twin serving the tiny model's own weights again before each run. With
`--cpusets auto` (the default on a machine of 2+ cores) the twin and the trainer get CPU sets of their own (Compose
`cpuset`, REHEARSE_VLLM_CPUSET / REHEARSE_TRAINER_CPUSET): two emulated devices, so generation and training overlap
as on a GPU host; the output says which cores each got. Per run:
  * time to learn: seconds from the start of the first optimizer step until the held-out learning check (greedy exact
    first calls, trainer/after/first_turn.py, CHECK_ROWS held-out rows) first reaches the bar, and the steps and
    trained samples by then. The run saves a checkpoint every --check-every steps (the weights it pushes to vLLM at
    that step) and a container beside it checks each one as soon as it is sealed, dated at the end of its step. Not
    by asking the twin itself: in sync mode a client generating beside the trainer holds cache blocks, and the
    weight push's prefix-cache reset is then refused (the trainer stops, on purpose: trainer/gpu/weight_check.py);
  * trained samples per minute and generated tokens per second (the twin's /metrics) over the logged steps;
  * the generator's busy share (a request running at vLLM, /metrics polled every 0.2 s) and the trainer's, from its
    own step timers: training (forward, backward, optimizer) / pushing weights / waiting for samples;
  * staleness (async: lag p50/p90/max of the trained samples, dropped stale) and the importance-sampling ratio;
  * the reward of the last 3 steps, and reward against trained samples and against wall-clock, one plot per env
    (reports/bench-async-<env>.png).
Equal work per step: the async runs train a sync step's sample count (ASYNC_STEP_SAMPLES=batch; `--async-step-samples
packed` packs each step up to max_model_len as TRL does by default, dozens of samples), and a low learning rate
(--learning-rate 6e-5) makes learning take several steps. Figures are per trained sample or per second. `--staleness`
adds async runs on the slow env (first seed) at each MAX_STALENESS. Goals printed beside: on the slow env async learns
in at most 2/3 of sync's time on each seed, its final reward within the spread of sync's seeds, and its trainer waits
at most 20 % of the run.
A benchmark, not a test: it prints the figures and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tools.images import TRAINER_REHEARSE_BUILD, image_of  # noqa: E402

GOALS = {"learn_ratio_slow": 2 / 3, "trainer_wait_async": 0.20}
SWEEP_LABELS = {"MAX_STALENESS": "staleness", "MAX_INFLIGHT_ROLLOUTS": "inflight"}  # the settings a sweep varies
READER_IMAGE = image_of(TRAINER_REHEARSE_BUILD)   # make rehearse's trainer image (built by the first run)
CHECK_ROWS = 20   # held-out rows per learning check: each check is CHECK_ROWS greedy requests to the twin
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
# In the trainer's image beside the run: the held-out check (greedy exact first calls) of the tiny model, then of each
# checkpoint as soon as the trainer has sealed it (the run keeps only its last 3), in one process (argv: the run's
# folder, rows). One JSON line per model; a checkpoint rotated away mid-check is skipped.
CHECK = """
import json, sys, time
from pathlib import Path
from trainer.after import first_turn
from trainer.run.checkpoints import is_complete
from contract.config import CPU_DEFAULT_MODEL
run, rows = Path(sys.argv[1]), int(sys.argv[2])
print(json.dumps({'step': 0, 'exact': first_turn.evaluate(CPU_DEFAULT_MODEL, rows=rows)['exact_rate']}), flush=True)
seen = set()
while True:
    for ckpt in sorted(run.glob('checkpoint-*'), key=lambda p: int(p.name.rsplit('-', 1)[1])):
        if ckpt.name in seen or not is_complete(ckpt):
            continue
        seen.add(ckpt.name)
        try:
            rate = first_turn.evaluate(str(ckpt), rows=rows)['exact_rate']
        except Exception as exc:
            print('#', ckpt.name, exc, flush=True)
            continue
        print(json.dumps({'step': int(ckpt.name.rsplit('-', 1)[1]), 'exact': rate}), flush=True)
    time.sleep(0.5)
"""
BASE_BACK = """
import json, urllib.request
from contract.config import CPU_DEFAULT_MODEL
req = urllib.request.Request('http://vllm:8000/collective_rpc', json.dumps({'method': 'reload_weights',
      'kwargs': {'weights_path': CPU_DEFAULT_MODEL}}).encode(), {'Content-Type': 'application/json'})
urllib.request.urlopen(req, timeout=300)
"""


def async_available() -> bool:
    from contract.config import RunConfig

    return "rollouts" in RunConfig.model_fields


def cpusets(spec: str) -> dict[str, str]:
    """`auto`: the twin on the first half of this machine's cores, the trainer on the rest (2 cores: 0 and 1);
    `none`: both on every core; `VLLM:TRAINER` (cpuset lists, e.g. 0-1:2-3) as given."""
    if spec == "none":
        return {}
    if spec == "auto":
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            return {}
        half = len(cores) // 2
        vllm, trainer = cores[:half], cores[half:]
        spec = f"{','.join(map(str, vllm))}:{','.join(map(str, trainer))}"
    vllm, _, trainer = spec.partition(":")
    if not vllm or not trainer:
        raise SystemExit(f"--cpusets {spec!r}: give auto, none, or VLLM:TRAINER cpuset lists (e.g. 0:1)")
    return {"REHEARSE_VLLM_CPUSET": vllm, "REHEARSE_TRAINER_CPUSET": trainer}


class Project:
    """One Compose project driven by `python -m tools` with its own env file (never your .env or stack)."""

    def __init__(self, folder: Path, settings: dict[str, str], name: str | None = None,
                 env: dict[str, str] | None = None):
        from tools.errors import parse_env_file

        self.name = name or f"grpo-bench-async-{uuid.uuid4().hex[:6]}"
        self.env = env or {}  # the process environment of every `tools` command (the CPU sets)
        values = {**parse_env_file(ROOT / ".env.example"), **settings, "COMPOSE_PROJECT_NAME": self.name,
                  "TRAIN_MODE": "cpu"}  # rehearse ignores TRAIN_MODE; `down` then probes no GPU
        self.env_file = folder / f"{self.name}.env"
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))

    def tools(self, *args: str, env: dict[str, str] | None = None, log: Path | None = None) -> int:
        """`python -m tools ARGS` on this project; its output goes to `log` (else to this terminal)."""
        run_env = {k: v for k, v in os.environ.items() if k not in ("TRAIN_MODE", "ENV_NAME", "COMPOSE_PROFILES")}
        run_env.update(STACK_ENV_FILE=str(self.env_file), **self.env, **(env or {}))
        cmd = [sys.executable, "-m", "tools", *args]
        if log is None:
            return subprocess.call(cmd, cwd=ROOT, env=run_env)
        with open(log, "w") as out:
            return subprocess.call(cmd, cwd=ROOT, env=run_env, stdout=out, stderr=subprocess.STDOUT)

    def vllm_container(self) -> str | None:
        ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.name}",
                              "--filter", "label=com.docker.compose.service=vllm", "--filter", "health=healthy"],
                             capture_output=True, text=True).stdout.split()
        return ids[0] if ids else None

    def beside_twin(self, *cmd: str) -> subprocess.CompletedProcess:
        """A command in the trainer's image on the twin's network, the models and outputs volumes read-only, on the
        twin's CPU set (what it asks of the twin is generation)."""
        cpuset = self.env.get("REHEARSE_VLLM_CPUSET")
        return subprocess.run(["docker", "run", "--rm", "--network", f"{self.name}_agentnet",
                               *(["--cpuset-cpus", cpuset] if cpuset else []), "-v", f"{self.name}_models:/models:ro", "-v", f"{self.name}_outputs:/outputs:ro",
                               READER_IMAGE, *cmd], capture_output=True, text=True)

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

    def serve_base_model_again(self) -> None:
        """Each run starts from the tiny model: the twin reloads its own weights (a run before pushed others)."""
        if self.vllm_container():
            res = self.beside_twin("python3", "-c", BASE_BACK)
            if res.returncode != 0:
                raise SystemExit(f"the twin did not reload the tiny model's weights:\n{res.stderr[-2000:]}")

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


class Watcher:
    """A line-printing command started once the container it follows is there (`ready`), its lines kept while a run
    goes on, and started again if that container is replaced."""

    def __init__(self, project: Project):
        self.project, self.lines, self.proc = project, [], None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def ready(self) -> str | None:
        """The container the command follows, once there: the twin, healthy."""
        return self.project.vllm_container()

    def command(self, container: str) -> list[str]:
        raise NotImplementedError

    def _run(self) -> None:
        # the twin is (re)started by the run itself (`make rehearse` recreates a container whose settings changed):
        # wait until one is healthy, follow it, and again after it is gone, until the run ends
        while not self.stop.is_set():
            container = self.ready()
            if not container:
                self.stop.wait(1)
                continue
            self.proc = subprocess.Popen(self.command(container), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                         text=True)
            for line in self.proc.stdout:
                if line.strip() and not line.startswith("#"):
                    self.lines.append(line)
            self.proc.wait()
            self.stop.wait(1)

    def close(self) -> list[str]:
        self.stop.set()
        self.ended()
        if self.proc:
            self.proc.terminate()
        self.thread.join(timeout=10)
        return self.lines

    def ended(self) -> None:
        """What ends the command's container where terminating its docker client does not."""


class MetricsPoller(Watcher):
    """vLLM's /metrics polled inside the twin's container (it publishes no port): (time, running, tokens total)."""

    def command(self, container: str) -> list[str]:
        return ["docker", "exec", container, "python3", "-c", POLL]

    def samples(self) -> list[tuple[float, float, float]]:
        return [tuple(float(x) for x in line.split()) for line in self.close()]


# ---------------------------------------------------------------------------- figures (pure: tests/tools/test_bench_async.py)
def trained_samples(row: dict) -> float:
    """Samples one step trained: async, the lag histogram of the trained samples (async/samples_at_lag/<k>); sync,
    the episodes of its generation batch (env/<env>/episodes: one sample each)."""
    lags = [v for k, v in row.items() if k.startswith("async/samples_at_lag/") and isinstance(v, (int, float))]
    if lags:
        return float(sum(lags))
    return float(sum(v for k, v in row.items() if k.startswith("env/") and k.endswith("/episodes")
                     and isinstance(v, (int, float))))


def run_start(rows: list[dict]) -> float:
    """When the first optimizer step started (its record's time less its step time)."""
    return rows[0]["time"] - rows[0].get("step_time", rows[0].get("time/step_s", 0.0))


def time_to_learn(rows: list[dict], checks: list[dict], bar: float) -> dict:
    """The first check at or above `bar`: seconds after the first step started, the steps logged and the samples
    trained by then (None where the run never reached it)."""
    start = run_start(rows)
    hit = next((c for c in sorted(checks, key=lambda c: c["time"]) if c["exact"] >= bar), None)
    if hit is None:
        return {"seconds": None, "steps": None, "samples": None}
    samples = sum(trained_samples(r) for r in rows if r["step"] <= hit["step"])
    return {"seconds": max(0.0, hit["time"] - start), "steps": hit["step"], "samples": samples}


def trainer_shares(rows: list[dict]) -> dict[str, float]:
    """Shares of the logged span (first step's start to the last step's end) the trainer spent training (forward,
    backward, optimizer: time/training_s), pushing weights (time/weight_sync_s) and waiting for samples (the rest)."""
    span = rows[-1]["time"] - run_start(rows)
    if span <= 0:
        return {"training": float("nan"), "pushing": float("nan"), "waiting": float("nan")}
    training = sum(r.get("time/training_s", 0.0) for r in rows) / span
    pushing = sum(r.get("time/weight_sync_s", 0.0) for r in rows) / span
    return {"training": training, "pushing": pushing, "waiting": max(0.0, 1.0 - training - pushing)}


def figures(rows: list[dict], samples: list[tuple[float, float, float]], checks: list[dict], bar: float) -> dict:
    start, end = run_start(rows), rows[-1]["time"]
    span = [s for s in samples if start <= s[0] <= end]
    tokens = (span[-1][2] - span[0][2]) / (span[-1][0] - span[0][0]) if len(span) > 1 else float("nan")
    trained = [trained_samples(r) for r in rows]

    def values(key: str) -> list[float]:
        return [r[key] for r in rows if isinstance(r.get(key), (int, float))]

    def mean(key: str) -> float:
        v = values(key)
        return sum(v) / len(v) if v else float("nan")

    rewards = [r["reward"] for r in rows[-3:]]  # the trainer's reward, logged alike by the sync and async trainers
    cumulative = [sum(trained[: i + 1]) for i in range(len(rows))]
    return {
        "learn": time_to_learn(rows, checks, bar),
        "checks": [(c["time"] - start, c["step"], c["exact"]) for c in checks],
        "steps": len(rows), "samples": sum(trained), "wall_s": end - start,
        "samples_per_min": 60 * sum(trained) / (end - start), "tokens_per_s": tokens,
        "vllm_busy": sum(s[1] > 0 for s in span) / len(span) if span else float("nan"),
        "trainer": trainer_shares(rows),
        "staleness": {"p50": mean("async/staleness_p50"), "p90": mean("async/staleness_p90"),
                      "max": max(values("async/staleness_max"), default=float("nan")),
                      "dropped": sum(values("async/dropped_stale"))},
        # async: TRL's per-token ratio of its clipped loss; sync: vLLM's importance-sampling correction
        "is_ratio": mean("ratio") if values("ratio") else mean("sampling/importance_sampling_ratio/mean"),
        "reward": sum(rewards) / len(rewards),
        "curve": [(c, r["time"] - start, r["reward"]) for c, r in zip(cumulative, rows)],
    }


def verdicts(results: dict[tuple, dict]) -> list[str]:
    """The goals on the slow env, seed by seed: async's time to learn <= 2/3 of sync's, its final reward within the
    spread of sync's seeds (their min..max), its trainer waiting <= 20 % of the run."""
    lines = []
    seeds = sorted({key[2] for key in results if key[0] == "slow"})
    sync_rewards = [results[k]["reward"] for k in results if k[:2] == ("slow", "sync") and len(k) == 3]
    for seed in seeds:
        sync, asy = results.get(("slow", "sync", seed)), results.get(("slow", "async", seed))
        if not sync or not asy:
            lines.append(f"seed {seed}: needs both slow-env runs")
            continue
        s, a = sync["learn"]["seconds"], asy["learn"]["seconds"]
        if s is None or a is None:
            lines.append(f"seed {seed}: time to learn not measured (sync {s}, async {a}: the bar was not reached)")
        else:
            ok = a <= GOALS["learn_ratio_slow"] * s
            lines.append(f"seed {seed}: async learned in {a:.0f} s, sync in {s:.0f} s: {s / max(a, 1e-9):.2f}x faster "
                         f"(goal >= 1.5x: {'met' if ok else 'NOT met'})")
        wait = asy["trainer"]["waiting"]
        lines.append(f"seed {seed}: async trainer waiting {wait:.0%} of the run (sync {sync['trainer']['waiting']:.0%}; "
                     f"goal <= {GOALS['trainer_wait_async']:.0%}: {'met' if wait <= GOALS['trainer_wait_async'] else 'NOT met'})")
        if len(sync_rewards) >= 2:
            low, high = min(sync_rewards), max(sync_rewards)
            ok = low <= asy["reward"] <= high
            lines.append(f"seed {seed}: async final reward {asy['reward']:.3f}, sync's seeds {low:.3f}..{high:.3f} "
                         f"({'within' if ok else 'NOT within'})")
    return lines


def plot(results: dict[tuple, dict], out: Path) -> list[Path]:
    """Reward against trained samples and against wall-clock, one figure per env."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for env in sorted({key[0] for key in results}):
        fig, (by_samples, by_time) = plt.subplots(1, 2, figsize=(11, 4))
        for key, f in sorted(results.items(), key=lambda kv: str(kv[0])):
            if key[0] != env:
                continue
            label = " ".join(str(k) for k in key[1:])
            samples, seconds, reward = zip(*f["curve"])
            by_samples.plot(samples, reward, marker=".", label=label)
            by_time.plot(seconds, reward, marker=".", label=label)
        by_samples.set(xlabel="trained samples", ylabel="reward", title=f"{env} env: reward per trained sample")
        by_time.set(xlabel="seconds since the first step", ylabel="reward", title=f"{env} env: reward over time")
        by_samples.legend(fontsize=8)
        fig.tight_layout()
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"bench-async-{env}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


# ---------------------------------------------------------------------------- the runs
class LearningChecker(Watcher):
    """CHECK for the run `run`, in a container beside the twin (on the twin's CPU set: the trainer's stays its own),
    reading the outputs volume while the run goes on."""

    def __init__(self, project: Project, run: str):
        self.run_name, self.name = run, f"{project.name}-check"
        super().__init__(project)

    def ready(self) -> str | None:
        """The run's trainer container, running: the outputs volume is then Compose's (made for the trainer)."""
        ids = subprocess.run(["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={self.project.name}",
                              "--filter", "label=com.docker.compose.service=trainer"], capture_output=True,
                             text=True).stdout.split()
        return ids[0] if ids else None

    def command(self, container: str) -> list[str]:
        cpuset = self.project.env.get("REHEARSE_VLLM_CPUSET")
        return ["docker", "run", "--rm", "--name", self.name, "--network", "none",
                *(["--cpuset-cpus", cpuset] if cpuset else []), "-v", f"{self.project.name}_models:/models:ro",
                "-v", f"{self.project.name}_outputs:/outputs:ro", READER_IMAGE, "python3", "-c", CHECK,
                f"/outputs/{self.run_name}", str(CHECK_ROWS)]

    def ended(self) -> None:
        subprocess.run(["docker", "rm", "-f", self.name], capture_output=True)

    def checks(self, rows: list[dict], every: int, bound_s: float = 300.0) -> list[dict]:
        """Once the run is over: its last checkpoint checked (bounded), then each check at the time its model was
        there: the tiny model at the first step's start, a checkpoint at the end of its step (the weights the trainer
        pushed to vLLM then)."""
        last = rows[-1]["step"] // every * every
        deadline = time.monotonic() + bound_s
        while last and time.monotonic() < deadline and not any(
                line.startswith("{") and json.loads(line)["step"] >= last for line in list(self.lines)):
            time.sleep(0.5)
        ended = {r["step"]: r["time"] for r in rows}
        checks = []
        for line in self.close():
            if line.startswith("{"):
                c = json.loads(line)
                at = run_start(rows) if c["step"] == 0 else ended.get(c["step"])
                if at is not None:
                    checks.append({"time": at, **c})
        return checks


def one_run(project: Project, run: str, settings: dict[str, str], every: int, bar: float, logs: Path) -> dict | None:
    project.serve_base_model_again()
    poller, checker = MetricsPoller(project), LearningChecker(project, run)
    t0 = time.monotonic()
    log = logs / f"{run}.log"
    # a checkpoint every `every` steps: the learning checks' models (SAVE_STEPS)
    rc = project.tools("rehearse", env={"RUN_NAME": run, "SAVE_STEPS": str(every), **settings}, log=log)
    samples = poller.samples()
    rows = [json.loads(x) for x in project.read(f"/outputs/{run}/metrics.jsonl").splitlines() if '"kind": "step"' in x]
    if rows:
        checks = checker.checks(rows, every)
    else:
        checker.close()
    if rc != 0 or not rows:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        print(f"[bench-async] {run}: make rehearse exited {rc} with {len(rows)} steps logged ({log}); its last "
              f"lines:\n{tail}", flush=True)
        return None
    try:
        f = figures(rows, samples, checks, bar)
    except (KeyError, ZeroDivisionError, IndexError) as exc:  # one run's odd log must not lose the others
        print(f"[bench-async] {run}: no figures ({exc!r})", flush=True)
        return None
    learned = f["learn"]["seconds"]
    print(f"[bench-async] {run}: done in {time.monotonic() - t0:.0f}s; {f['steps']} steps, {f['samples']:.0f} samples; "
          f"checks {[(round(t), s, round(e, 2)) for t, s, e in f['checks']]}; "
          f"learned {'in %.0f s' % learned if learned is not None else 'not within the run'}", flush=True)
    return f


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,7", help="SEED of each run pair (comma-separated)")
    p.add_argument("--envs", default="slow,instant", help="slow (tool calls take --delay), instant, or both")
    p.add_argument("--max-steps", type=int, default=24, help="MAX_STEPS of every run (a run may learn before)")
    p.add_argument("--bar", type=float, default=0.8, help="the learning check's bar (greedy exact first calls)")
    p.add_argument("--check-every", type=int, default=1, help="steps between two learning checks (checkpoints)")
    p.add_argument("--delay", type=float, default=0.25, help="seconds the slow env takes per tool call")
    p.add_argument("--staleness", default="", help="more async runs on the slow env (first seed) at these "
                   "MAX_STALENESS values, e.g. 1,2 (the default's is among the main runs)")
    p.add_argument("--inflight", default="", help="more async runs on the slow env (every seed) at these "
                   "MAX_INFLIGHT_ROLLOUTS values, e.g. 8,16 (empty: TRL's default, MAX_STALENESS x samples a step)")
    p.add_argument("--cpusets", default="auto", help="auto (twin and trainer on halves of the cores), none, or "
                   "VLLM:TRAINER cpuset lists")
    p.add_argument("--async-step-samples", choices=("batch", "packed"), default="batch",
                   help="ASYNC_STEP_SAMPLES of the async runs: batch (a sync step's sample count: equal work per step, "
                   "the default here) or packed (as many as fit in max_model_len)")
    p.add_argument("--learning-rate", default="6e-5", help="LEARNING_RATE of every run (low enough that learning "
                   "takes several steps: about 6 for sync here; at the CPU default the tiny model learns echo in 2)")
    p.add_argument("--processes", type=int, default=1, help="TRAINER_PROCESSES of every run")
    p.add_argument("--only", choices=("sync", "async"), default=None, help="run one rollout mode only")
    p.add_argument("--model", type=Path, default=None, help="a tiny model already made (trainer.tiny_model) to start "
                   "from; default: model-init makes one (minutes)")
    p.add_argument("--json", type=Path, default=None, help="also write every run's figures here")
    p.add_argument("--plots", type=Path, default=ROOT / "reports", help="where the reward plots go")
    p.add_argument("--logs", type=Path, default=ROOT / "reports" / "bench-async-logs",
                   help="each run's `make rehearse` output")
    args = p.parse_args()
    from contract.config import default

    modes = [m for m in ("sync", "async") if args.only in (None, m)]
    missing_async = "async" in modes and not async_available()
    if missing_async:
        modes.remove("async")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    delays = {"slow": args.delay, "instant": 0.0}
    envs = [e.strip() for e in args.envs.split(",") if e.strip() in delays]
    default_staleness = default("max_staleness") if async_available() else None
    sweep = [int(s) for s in args.staleness.split(",") if s.strip() and int(s) != default_staleness]
    sets = cpusets(args.cpusets)
    print(f"[bench-async] CPU sets: " + (f"twin (vllm) on cores {sets['REHEARSE_VLLM_CPUSET']}, trainer on "
          f"{sets['REHEARSE_TRAINER_CPUSET']}, the learning check on the twin's" if sets else
          "none: the twin and the trainer share every core"), flush=True)
    # VLLM_MAX_MODEL_LEN=512: async packs each step up to it (the longest echo episode is ~410 tokens), so a step
    # holds dozens of samples rather than hundreds; every figure is per sample or per second anyway
    settings = {"ENV_NAME": "echo", "MAX_STEPS": str(args.max_steps), "RESUME": "fresh", "LOGGING_STEPS": "1",
                "TRACE_EVERY": "0", "DATASET_SIZE": "64", "TRAINER_PROCESSES": str(args.processes),
                "VLLM_SERVER_TIMEOUT_S": "900", "VLLM_MAX_MODEL_LEN": "512", "LEARNING_RATE": args.learning_rate}
    # (env, mode, seed, the variant's own settings): the main runs, then the sweeps' async runs on the slow env
    plan: list[tuple[str, str, int, dict[str, str]]] = [(env, mode, seed, {}) for env in envs for seed in seeds
                                                         for mode in modes]
    if "async" in modes and "slow" in envs:
        plan += [("slow", "async", seeds[0], {"MAX_STALENESS": str(s)}) for s in sweep]
        plan += [("slow", "async", seed, {"MAX_INFLIGHT_ROLLOUTS": str(int(n))}) for n in args.inflight.split(",")
                 if n.strip() for seed in seeds]
    results: dict[tuple, dict] = {}
    args.logs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-async-") as tmp:
        project = Project(Path(tmp), settings, env=sets)
        try:
            if args.model:
                project.seed_model(args.model)
            for env, mode, seed, variant in plan:
                label = " ".join(f"{SWEEP_LABELS[k]} {v}" for k, v in variant.items())  # "staleness 2", "inflight 8"
                run = f"{mode}-{env}-{seed}" + "".join(f"-{SWEEP_LABELS[k]}{v}" for k, v in variant.items())
                print(f"[bench-async] {run}: make rehearse, up to {args.max_steps} steps, tool calls "
                      f"{delays[env] * 1000:.0f} ms, seed {seed}", flush=True)
                extra = {"ENV_STEP_DELAY_S": str(delays[env]), "SEED": str(seed),
                         **({"ROLLOUTS": mode} if async_available() else {}),
                         **({"ASYNC_STEP_SAMPLES": args.async_step_samples} if mode == "async" else {}),
                         **variant}
                f = one_run(project, run, extra, args.check_every, args.bar, args.logs)
                if f:
                    key = (env, mode, seed) + ((label,) if label else ())
                    results[key] = f
        finally:
            project.down()
    print(f"\nsync vs async rollouts on make rehearse (echo, up to {args.max_steps} steps, TRAINER_PROCESSES="
          f"{args.processes}, learning bar {args.bar} on {CHECK_ROWS} held-out rows every {args.check_every} steps):")
    print(f"  {'env':<8} {'run':<22} {'learned s':>9} {'samples':>8} {'samples/min':>11} {'tok/s':>6} {'vLLM busy':>9} "
          f"{'trainer train/push/wait':>23} {'lag p50/p90/max':>15} {'drop':>4} {'ratio':>6} {'reward':>7}")
    for key, f in results.items():
        learned = f["learn"]["seconds"]
        t, s = f["trainer"], f["staleness"]
        lag = "-" if s["p50"] != s["p50"] else f"{s['p50']:.1f}/{s['p90']:.1f}/{s['max']:.0f}"  # sync: no lag
        print(f"  {key[0]:<8} {' '.join(str(k) for k in key[1:]):<22} "
              f"{('%.0f' % learned) if learned is not None else '-':>9} "
              f"{('%.0f' % f['learn']['samples']) if learned is not None else '-':>8} "
              f"{f['samples_per_min']:>11.1f} {f['tokens_per_s']:>6.1f} {f['vllm_busy']:>9.0%} "
              f"{t['training']:>9.0%}/{t['pushing']:.0%}/{t['waiting']:.0%} "
              f"{lag:>15} {s['dropped']:>4.0f} {f['is_ratio']:>6.3f} {f['reward']:>7.3f}")
    if missing_async:
        print("  async: not run: ROLLOUTS is not a setting of this checkout yet (#31 item 1)")
    for line in verdicts(results):
        print(f"  {line}")
    if results:
        for path in plot(results, args.plots):
            print(f"  plot: {path}")
    if args.json:
        args.json.write_text(json.dumps([{"key": list(k), **f} for k, f in results.items()], indent=1))


if __name__ == "__main__":
    main()
