"""The CPU profile's learning curve on echo, next to its goals (docs/profiles.md "CPU profile: what the learning curve shows").

    .venv/bin/python bench/learning_curve.py [--seeds 42,7] [--model DIR]

For each seed, with the CPU profile's defaults (the tiny model from `trainer.tiny_model`, the real echo server
on loopback, the trainer's own `trainer.train`):
  * a 30-step run (MAX_STEPS' default): mean env reward of the last 10 steps against the first 10;
  * a 100-step run: the share of exact echoes in its last 10 steps (a lower bound from the mean reward), and the
    share of completions cut at the token budget over the run;
  * greedy exact first calls on held-out rows (trainer.after.first_turn) of the base model and of each run's end.
A benchmark, not a test: it prints figures beside the goals and never fails on them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.adapter_overhead import start_echo_server  # noqa: E402

GOALS = {"gain_30": 0.2, "exact_100": 0.8, "clipped": 0.1}


def train(model: Path, url: str, out: Path, run: str, steps: int, seed: int) -> list[dict]:
    """One run through trainer.train in a child process; its step records."""
    argv = ["--train-mode", "cpu", "--model-name", str(model), "--output-dir", str(out), "--env-name", "echo",
            "--env-urls", f"echo={url}", "--run-name", run, "--max-steps", str(steps), "--seed", str(seed),
            "--save-steps", "10000", "--resume", "fresh"]
    subprocess.run([sys.executable, "-m", "trainer.train", *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from trainer.run.metrics import read_metrics

    return read_metrics(out / run)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def exact_share_at_least(row: dict) -> float:
    """Echo's reward is 1.0 for an exact first echo, 0.2 for another message, 0 with no call. From a step's mean
    reward r alone, the share of exact echoes is at least (r - 0.2) / 0.8 (every other episode partial)."""
    from envs.echo import task

    return max(0.0, (row["env/echo/reward_mean"] - task.PARTIAL) / (task.FULL - task.PARTIAL))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,7", help="training seeds, comma-separated (default 42,7)")
    p.add_argument("--model", default=None, help="a tiny model already built (default: build one with the defaults)")
    args = p.parse_args()
    from trainer.after.first_turn import evaluate

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "tiny-qwen3"
        if not args.model:
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        base = evaluate(str(model))["exact_rate"]
        proc, url = start_echo_server(64)
        try:
            for seed in [int(s) for s in args.seeds.split(",")]:
                short = train(model, url, Path(tmp), f"s{seed}-30", 30, seed)
                long = train(model, url, Path(tmp), f"s{seed}-100", 100, seed)
                rewards = [r["env/echo/reward_mean"] for r in short]
                gain = mean(rewards[-10:]) - mean(rewards[:10])
                exact = mean([exact_share_at_least(r) for r in long[-10:]])
                clipped = mean([r["completions/clipped_ratio"] for r in long])
                greedy = evaluate(str(Path(tmp) / f"s{seed}-30" / "checkpoint-30"))["exact_rate"]
                print(f"seed {seed}: 30 steps: reward {mean(rewards[:10]):.3f} (first 10) -> {mean(rewards[-10:]):.3f} (last 10), "
                      f"{gain:+.3f} (goal >= +{GOALS['gain_30']})  |  "
                      f"100 steps: exact echoes in the last 10 steps >= {exact:.2f} (goal >= {GOALS['exact_100']}), "
                      f"clipped {clipped:.3f} (goal <= {GOALS['clipped']})  |  greedy exact first calls "
                      f"on held-out rows: {base:.2f} base -> {greedy:.2f} after 30 steps")
        finally:
            proc.terminate()


if __name__ == "__main__":
    main()
