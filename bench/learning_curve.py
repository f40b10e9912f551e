"""The CPU profile's learning curve on echo, next to its goals (docs/profiles.md "CPU profile: what the learning curve shows").

    .venv/bin/python bench/learning_curve.py [--seeds 42,7] [--model DIR] [--judge also|only|no]
    .venv/bin/python bench/learning_curve.py --compare-zero-std [--envs echo,catch] [--steps 30] [--seeds 42,7]
    .venv/bin/python bench/learning_curve.py --compare-zero-std --envs catch --model DIR  (DIR from
        `python -m trainer.tiny_model --warm-on catch --out DIR`: the echo-warmed model never calls catch's tool)

For each seed, with the CPU profile's defaults (the tiny model from `trainer.tiny_model`, the real echo server
on loopback, the trainer's own `trainer.train`):
  * a 30-step run (MAX_STEPS' default): mean env reward of the last 10 steps against the first 10;
  * a 100-step run: the share of exact echoes in its last 10 steps (a lower bound from the mean reward), and the
    share of completions cut at the token budget over the run;
  * greedy exact first calls on held-out rows (trainer.after.first_turn) of the base model and of each run's end.
With --compare-zero-std, instead: ZERO_STD_GROUPS=keep vs drop (#43), the same seed, model and env per pair, each
env served in-process on loopback (with the episode settings of EPISODE_ARGS): per run the mean env reward of steps
1-10, 11-20, ..., the mean share of flat groups (frac_reward_zero_std) and, at the end, greedy exact first calls where
the env's expert first call can be read from its prompt (FIRST_CALL_ENVS), else the mean reward of the last 10 steps.
Then (--judge also, the default; --judge only: alone) the judge case, bench/judge_learning.py: the same seeds, 20
steps each, learning from the tiny judge alone (ENV_REWARD_WEIGHT=0) served on the vLLM CPU twin (Docker).
A benchmark, not a test: it prints figures beside the goals and never fails on them.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.adapter_overhead import start_echo_server  # noqa: E402

GOALS = {"gain_30": 0.2, "exact_100": 0.8, "clipped": 0.1}
JUDGE_STEPS = 20  # the judge case's runs: its reward has risen by step 10 (docs/judge.md)
WINDOW = 10  # steps per point of the compared reward curves
# Envs whose expert first call can be read from the prompt trainer.after.first_turn renders (echo's word); catch's
# needs the reset board, which that prompt lacks, and wordle's is the hidden secret.
FIRST_CALL_ENVS = ("echo",)
# What a whole episode of an env needs beyond the CPU defaults (256 tokens, 4 tool rounds: echo's one call fits).
# Catch: the game ends after 9 moves, one call per turn in the warm-start's demos, ~310 tokens with its tiny model's
# tokenizer; under the defaults no game ever ends, so every reward is 0 whatever the model does.
EPISODE_ARGS = {"catch": ("--max-completion-length", "768", "--max-tool-calling-iterations", "9")}


def train(model: Path, url: str, out: Path, run: str, steps: int, seed: int, env: str = "echo",
          extra: tuple[str, ...] = ()) -> list[dict]:
    """One run through trainer.train in a child process; its step records."""
    argv = ["--train-mode", "cpu", "--model-name", str(model), "--output-dir", str(out), "--env-name", env,
            "--env-urls", f"{env}={url}", "--run-name", run, "--max-steps", str(steps), "--seed", str(seed),
            "--save-steps", "10000", "--resume", "fresh", *extra]
    subprocess.run([sys.executable, "-m", "trainer.train", *argv], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    from trainer.core.metrics import read_metrics

    return read_metrics(out / run)


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def exact_share_at_least(row: dict) -> float:
    """Echo's reward is 1.0 for an exact first echo, 0.2 for another message, 0 with no call. From a step's mean
    reward r alone, the share of exact echoes is at least (r - 0.2) / 0.8 (every other episode partial)."""
    from envs.echo import task

    return max(0.0, (row["env/echo/reward_mean"] - task.PARTIAL) / (task.FULL - task.PARTIAL))


def window_means(values: list[float], width: int = WINDOW) -> list[float]:
    """Means of consecutive `width`-step windows (steps 1-10, 11-20, ...; a shorter last window is its own point)."""
    if width < 1:
        raise ValueError(f"window width must be >= 1, got {width}")
    return [mean(values[i:i + width]) for i in range(0, len(values), width)]


def compare_row(env: str, seed: int, mode: str, records: list[dict], end: str) -> str:
    """One run's line of the keep-vs-drop table: its reward curve, its mean flat-group share, its end figure."""
    curve = "  ".join(f"{v:.3f}" for v in window_means([r[f"env/{env}/reward_mean"] for r in records]))
    flat = mean([r["frac_reward_zero_std"] for r in records if "frac_reward_zero_std" in r])
    return f"{env:<7}{seed:<6}{mode:<6}{curve}  |  {flat:.2f}  |  {end}"


def compare_zero_std(model: Path, out: Path, envs: list[str], seeds: list[int], steps: int) -> None:
    """ZERO_STD_GROUPS keep vs drop, each pair on the same seed, model and env (see the module docstring)."""
    from trainer.after.first_turn import evaluate
    from trainer.tiny_model import local_env_server

    started = time.monotonic()
    windows = ", ".join(f"{i + 1}-{min(i + WINDOW, steps)}" for i in range(0, steps, WINDOW))
    print(f"ZERO_STD_GROUPS keep vs drop, {steps} steps per run; columns: env, seed, mode, mean env reward of steps "
          f"{windows}  |  mean frac_reward_zero_std  |  at the end")
    for env in envs:
        base = evaluate(str(model), env)["exact_rate"] if env in FIRST_CALL_ENVS else None
        stack = contextlib.ExitStack()
        try:
            url = stack.enter_context(local_env_server(env, 64))
        except Exception as exc:  # noqa: BLE001 - e.g. wordle without its NLTK data (its image has it): one line
            why = next((line.strip() for line in str(exc).splitlines() if any(c.isalpha() for c in line)), "")
            print(f"{env}: skipped, its server does not start on this host: {type(exc).__name__}: {why}")
            continue
        with stack:
            if env in EPISODE_ARGS:
                print(f"{env}: {' '.join(EPISODE_ARGS[env])}")
            for seed in seeds:
                for mode in ("keep", "drop"):
                    run = f"{env}-s{seed}-{mode}"
                    records = train(model, url, out, run, steps, seed, env,
                                    ("--zero-std-groups", mode, *EPISODE_ARGS.get(env, ())))
                    if base is None:
                        last = mean([r[f"env/{env}/reward_mean"] for r in records[-WINDOW:]])
                        end = f"reward of the last {WINDOW} steps {last:.3f}"
                    else:
                        after = evaluate(str(out / run / f"checkpoint-{steps}"), env)["exact_rate"]
                        end = f"greedy exact first calls {base:.2f} base -> {after:.2f}"
                    print(compare_row(env, seed, mode, records, end), flush=True)
    print(f"wall time {time.monotonic() - started:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,7", help="training seeds, comma-separated (default 42,7)")
    p.add_argument("--model", default=None, help="a tiny model already built (default: build one with the defaults)")
    p.add_argument("--compare-zero-std", action="store_true",
                   help="only ZERO_STD_GROUPS keep vs drop, side by side per env and seed")
    p.add_argument("--envs", default="echo,catch", help="built-in envs for --compare-zero-std (default echo,catch)")
    p.add_argument("--steps", type=int, default=30, help="steps per run for --compare-zero-std (default 30)")
    p.add_argument("--judge", choices=("also", "only", "no"), default="also",
                   help="the judge case (bench/judge_learning.py: learning from the tiny judge alone on the twin, "
                        "needs Docker): after the env's figures (also, the default), alone (only), or not (no)")
    args = p.parse_args()
    from envs import registry
    from bench.judge_learning import judge_case
    from trainer.after.first_turn import evaluate

    seeds = [int(s) for s in args.seeds.split(",")]
    envs = [e.strip() for e in args.envs.split(",") if e.strip()]
    unknown = [e for e in envs if not registry.is_builtin(e)]
    if unknown or not envs:
        p.error(f"--envs takes built-in envs, comma-separated ({', '.join(registry.names())}); got {args.envs!r}")
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "tiny-qwen3"
        if not args.model:
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        if args.compare_zero_std:
            compare_zero_std(model, Path(tmp), envs, seeds, args.steps)
            return
        if args.judge == "only":
            judge_case(model, None, seeds, JUDGE_STEPS, Path(tmp))
            return
        base = evaluate(str(model))["exact_rate"]
        proc, url = start_echo_server(64)
        try:
            for seed in seeds:
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
        if args.judge == "also":
            judge_case(model, None, seeds, JUDGE_STEPS, Path(tmp))


if __name__ == "__main__":
    main()
