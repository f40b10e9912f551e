"""Learning from the judge alone on CPU (issue 64, item 7): `make bench-learning`'s judge case.

    .venv/bin/python bench/judge_learning.py [--seeds 42,7] [--steps 20] [--model DIR] [--judge DIR]

The policy is the CPU profile's tiny model (trainer.tiny_model), the judge the tiny judge (trainer.tiny_judge) served
by the vLLM CPU twin's image with the judge service's flags (compose.yaml `judge`, its default --max-model-len), the
trainer the real trainer.train with ENV_REWARD_WEIGHT=0 and JUDGE_URL at the twin: the env still computes its reward
(logged as env/echo/reward_mean), but it weighs 0, so every advantage comes from the judge's score. Per seed:
  * the judge's reward (rewards/judge/mean) and the env's (unweighted) over steps 1-10, 11-20, ...;
  * the judge's agreement with the env's grade on the run's traced episodes (right call 9, another word 3, no call 0,
    against echo's 1.0 / 0.2 / 0);
  * greedy first turns on held-out rows (trainer.after.first_turn) of the base model and of the run's end: the share
    that calls the tool, and the share whose first call is exactly the expert's;
  * the judge's cost per step (calls, seconds, tokens: what the step line prints) and its failures.
A benchmark, not a test: it prints figures beside the goals and never fails on them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOALS = {"gain": 0.2, "greedy_after": 0.8}
WINDOW = 5  # the judge case rises within its first 10 steps: 5-step points show it
SERVED_AS = "/models/tiny-judge"  # trainer.tiny_judge.TINY_JUDGE_DIR: the name the CPU profile's judge serves it by
ENV_GRADES = {1.0: "9", 0.2: "3", 0.0: "0"}  # echo's reward -> the digit the tiny judge was taught for it


def serve_judge(model_dir: Path, image: str | None = None, timeout_s: float = 600, served_as: str = SERVED_AS,
                extra_flags: tuple[str, ...] = ()) -> tuple[str, str, float]:
    """The twin's image serving `model_dir` as the judge service does on the CPU profile (as `served_as`, with
    `extra_flags` after the service's: tools.judge.POOLING_FLAGS for a reward model); (container, URL, seconds to
    healthy). Published on 127.0.0.1 only."""
    import requests

    from tools.images import TWIN_BUILD, image_of

    image = image or image_of(TWIN_BUILD)
    name = f"grpo-test-judge-{uuid.uuid4().hex[:8]}"
    t0 = time.monotonic()
    subprocess.run(["docker", "run", "-d", "--name", name, "--label", "grpo-test=1", "-p", "127.0.0.1::8000",
                    "--shm-size", "1g", "-e", "VLLM_CPU_KVCACHE_SPACE=1", "-e", "HF_HUB_OFFLINE=1",
                    "-v", f"{Path(model_dir).resolve()}:{served_as}:ro", image, served_as, *judge_flags(served_as),
                    *extra_flags],
                   check=True, capture_output=True)
    port = subprocess.run(["docker", "port", name, "8000/tcp"], capture_output=True, text=True,
                          check=True).stdout.split("\n")[0].rsplit(":", 1)[1]
    url = f"http://127.0.0.1:{port}"
    while True:
        running = subprocess.run(["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True,
                                 text=True).stdout.strip()
        if running != "true" or time.monotonic() - t0 > timeout_s:
            logs = subprocess.run(["docker", "logs", "--tail", "40", name], capture_output=True, text=True)
            stop_judge(name)
            raise RuntimeError(f"the judge's twin did not become healthy:\n{logs.stdout[-3000:]}{logs.stderr[-3000:]}")
        try:
            if requests.get(f"{url}/health", timeout=3).status_code == 200:
                return name, f"{url}/v1", time.monotonic() - t0
        except requests.RequestException:
            pass
        time.sleep(1)


def judge_flags(served_as: str = SERVED_AS) -> list[str]:
    """compose.yaml's judge command (x-judge-serve-flags) as the CPU profile resolves it for JUDGE_MODEL=`served_as`
    and every other setting at its default (--revision=main included: vLLM takes it for a local folder)."""
    import re

    from tools.images import compose_yaml_services

    flags = [re.sub(r"\$\{JUDGE_MODEL:-[^}]*\}", served_as, flag)
             for flag in compose_yaml_services()["judge"]["command"]]
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", flag) for flag in flags]


def stop_judge(name: str) -> None:
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)


def judge_args(url: str) -> tuple[str, ...]:
    """The run's judge settings: the judge alone (the env's reward weighs 0)."""
    return ("--judge-url", url, "--env-reward-weight", "0")


def agreement(run_dir: Path) -> tuple[float, int]:
    """(share of traced, judged episodes whose judge digit is the env's grade, how many)."""
    hits = total = 0
    for path in run_dir.rglob("rollouts.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            judged, env = row.get("judge") or {}, row.get("env_reward")
            if judged.get("verdict") is None or env not in ENV_GRADES:
                continue
            total += 1
            hits += judged["verdict"] == ENV_GRADES[env]
    return (hits / total if total else float("nan")), total


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def run_seed(model: Path, url: str, judge_url: str, out: Path, seed: int, steps: int) -> dict:
    from bench.learning_curve import train, window_means
    from trainer.after.first_turn import evaluate

    run = f"judge-s{seed}"
    t0 = time.monotonic()
    records = train(model, url, out, run, steps, seed, extra=judge_args(judge_url))
    wall = time.monotonic() - t0
    judged = [r["rewards/judge/mean"] for r in records]
    env = [r["env/echo/reward_mean"] for r in records]
    agree, n = agreement(out / run)
    greedy = evaluate(str(out / run / f"checkpoint-{steps}"))
    return {
        "seed": seed, "judge_curve": window_means(judged, WINDOW), "env_curve": window_means(env, WINDOW),
        "gain": mean(judged[-WINDOW:]) - mean(judged[:WINDOW]), "env_gain": mean(env[-WINDOW:]) - mean(env[:WINDOW]),
        "greedy_after": greedy["exact_rate"], "greedy_calls_after": greedy["tool_call_rate"],
        "agreement": agree, "judged": n, "failures": sum(r.get("judge/failures", 0) for r in records),
        "calls": mean([r.get("judge/calls", 0) for r in records]), "seconds": mean([r.get("judge/seconds", 0)
                                                                                   for r in records]),
        "tokens": mean([r.get("judge/tokens", 0) for r in records]), "wall_s": wall,
    }


def report(figures: dict, base: dict) -> str:
    curve = " ".join(f"{v:.3f}" for v in figures["judge_curve"])
    env = " ".join(f"{v:.3f}" for v in figures["env_curve"])
    return (f"seed {figures['seed']}: judge reward by {WINDOW} steps {curve} ({figures['gain']:+.3f}, goal >= "
            f"+{GOALS['gain']}); env reward (weight 0) {env} ({figures['env_gain']:+.3f})  |  greedy first turns "
            f"calling the tool {base['tool_call_rate']:.2f} base -> {figures['greedy_calls_after']:.2f}, exact first "
            f"calls {base['exact_rate']:.2f} -> {figures['greedy_after']:.2f} (goal >= {GOALS['greedy_after']})  |  "
            f"judge agrees "
            f"with the env's grade on {figures['agreement']:.2f} of {figures['judged']} traced episodes, "
            f"{figures['failures']:.0f} failed calls  |  per step {figures['calls']:.1f} calls "
            f"{figures['seconds']:.2f}s {figures['tokens']:.0f} tok; run {figures['wall_s']:.0f}s")


def judge_case(model: Path, judge: Path | None, seeds: list[int], steps: int, tmp: Path) -> None:
    """The judge case's lines: `model` the policy, `judge` the tiny judge (None: build one in `tmp`)."""
    from bench.adapter_overhead import start_echo_server
    from trainer.after.first_turn import evaluate

    if judge is None:
        judge = tmp / "tiny-judge"
        subprocess.run([sys.executable, "-m", "trainer.tiny_judge", "--out", str(judge)], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    base = evaluate(str(model))
    meta = json.loads((judge / "tiny_judge.json").read_text())
    name, judge_url, started = serve_judge(judge)
    print(f"judge alone (ENV_REWARD_WEIGHT=0): {judge} on the vLLM CPU twin, healthy after {started:.0f}s; its "
          f"held-out grades right: {meta['held_out_accuracy']}", flush=True)
    proc, url = start_echo_server(64)
    try:
        for seed in seeds:
            print(report(run_seed(model, url, judge_url, tmp, seed, steps), base), flush=True)
    finally:
        proc.terminate()
        stop_judge(name)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,7", help="training seeds, comma-separated (default 42,7)")
    p.add_argument("--steps", type=int, default=20, help="steps per run (default 20)")
    p.add_argument("--model", default=None, help="the policy, a tiny model already built (default: build one)")
    p.add_argument("--judge", default=None, help="the judge, a tiny judge already built (default: build one)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else Path(tmp) / "tiny-qwen3"
        if not args.model:
            subprocess.run([sys.executable, "-m", "trainer.tiny_model", "--out", str(model)], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL)
        judge_case(model, Path(args.judge) if args.judge else None, [int(s) for s in args.seeds.split(",")],
                   args.steps, Path(tmp))


if __name__ == "__main__":
    main()
