"""A real reward model served by the stack (issue 64, item 2): JUDGE_METHOD=reward_model on the vLLM CPU twin.

    .venv/bin/python bench/reward_model.py [--base DIR] [--reward-model DIR] [--episodes 24] [--converted]

  1. the tiny reward model (trainer.tiny_reward_model: a Qwen3ForSequenceClassification with one label, its head
     fitted on the tiny policy's trunk, TINY_MODEL_DIR or --base), made in a temporary folder, or --reward-model's;
  2. served by the twin's image with the judge service's command for JUDGE_METHOD=reward_model (compose.yaml's
     x-judge-serve-flags and tools.judge.POOLING_FLAGS, what `make train` runs on the CPU profile);
  3. the trainer's preflight on it (trainer.judge.preflight.check: /v1/models, a scored test episode, the length check)
     and the trainer's reward function (trainer.judge.reward.judge, the sync path) over held-out echo episodes of three
     kinds (the right first call, a call with another word, no call): mean score per kind, seconds per call, and each
     score beside transformers' own forward of the same checkpoint (the largest difference);
  4. --train-steps N: then N steps of the real trainer (trainer.train, CPU, echo) with JUDGE_METHOD=reward_model at
     that twin and ENV_REWARD_WEIGHT=0 (the reward model alone): per step its reward, the env's (unweighted), failures
     and the judge's cost;
  5. --converted: the tiny causal LM served the same way and scored the same way: what the pooling runner makes of a
     model that is not a classifier.
A benchmark, not a test: it prints figures and never fails on them. Each twin start costs a cold start (~30 s idle on
2 cores, minutes under load): why this is a bench script and not a test on the suite's shared twin (that twin serves
the policy with the generate runner; one vLLM server runs one runner).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SERVED_AS = "/models/tiny-reward-model"
CONCURRENCY = 4  # JUDGE_CONCURRENCY


def episodes_for_judge(items):
    """TRL's reward-function arguments for (prompt, completion, kind) episodes: prompts, completions, environments."""
    from trainer.rollouts.traces import Trace

    envs = []
    for i, _ in enumerate(items):
        trace = Trace("echo", {"seed": i})
        trace.env_reward = None
        envs.append(SimpleNamespace(_trace=trace, _infra_failure=None, env_name="echo"))
    return [p for p, _, _ in items], [c for _, c, _ in items], envs


def score_through_the_trainer(url: str, items) -> tuple[list[float | None], list[dict], float]:
    from envs.core.tool import trace_of
    from trainer.judge.reward import judge
    from trainer.judge.setup import JudgeSetup

    setup = JudgeSetup(base_url=url, method="reward_model", score="choice", template="",
                       judged_envs=frozenset({"echo"}), concurrency=CONCURRENCY, timeout_s=120.0, down_after_s=3600.0,
                       max_tokens=1, cache_size=0, num_generations=1, api_key_file="/nonexistent/key")
    prompts, completions, envs = episodes_for_judge(items)
    t0 = time.monotonic()
    scores = asyncio.run(judge(prompts, completions, environments=envs, setup=setup))
    return scores, [trace_of(env).judge for env in envs], time.monotonic() - t0


def preflight_lines(url: str) -> list[str]:
    from contract.config import RunConfig
    from trainer.judge import preflight

    result = preflight.check(RunConfig.load([], judge_url=url, judge_method="reward_model",
                                            max_completion_length=256), prompt_tokens=64)
    return [f"ok: {line}" for line in result.ok] + [f"ERROR: {line}" for line in result.errors]


def by_kind(values, items) -> dict[str, float]:
    out: dict[str, list[float]] = {}
    for v, (_, _, kind) in zip(values, items):
        if v is not None:
            out.setdefault(kind, []).append(v)
    return {k: round(sum(v) / len(v), 3) for k, v in out.items()}


def case(title: str, model_dir: Path, items, reference: list[float] | None, image: str | None,
         train_steps: int = 0, policy: Path | None = None) -> None:
    from bench.judge_learning import serve_judge, stop_judge
    from tools.judge import POOLING_FLAGS

    print(f"\n== {title}: {model_dir} served as {SERVED_AS} with {' '.join(POOLING_FLAGS)}", flush=True)
    t0 = time.monotonic()
    try:
        name, url, started = serve_judge(model_dir, image, served_as=SERVED_AS, extra_flags=POOLING_FLAGS)
    except RuntimeError as exc:
        print(f"  the twin did not come up ({time.monotonic() - t0:.0f} s): {str(exc)[-1500:]}")
        return
    try:
        print(f"  healthy after {started:.0f} s")
        for line in preflight_lines(url):
            print(f"  preflight {line}")
        scores, records, took = score_through_the_trainer(url, items)
        failed = [r["failure"] for r in records if r.get("failure")]
        print(f"  {len(items)} episodes scored by the trainer's reward function in {took:.2f} s "
              f"({took / len(items):.3f} s a call, {CONCURRENCY} in flight); failures {len(failed)}"
              f"{': ' + failed[0] if failed else ''}")
        print(f"  mean score by kind (right call / another word / no call): {by_kind(scores, items)}")
        if records and records[0].get("rationale"):
            print(f"  e.g. verdict {records[0]['verdict']!r}, {records[0]['rationale']}")
        if reference is not None and not failed:
            worst = max(abs(a - b) for a, b in zip(scores, reference))
            print(f"  largest difference from transformers' forward of the same checkpoint: {worst:.2e}")
        if train_steps and policy is not None:
            train_with(policy, url, train_steps)
    finally:
        stop_judge(name)


def train_with(policy: Path, judge_url: str, steps: int) -> None:
    """`steps` steps of trainer.train on echo with the reward model alone (ENV_REWARD_WEIGHT=0), as a CPU run would."""
    from bench.adapter_overhead import start_echo_server
    from bench.learning_curve import train

    proc, env_url = start_echo_server(64)
    try:
        with tempfile.TemporaryDirectory(prefix="bench-reward-model-run-") as out:
            t0 = time.monotonic()
            records = train(policy, env_url, Path(out), "reward-model", steps, 42, extra=(
                "--judge-url", judge_url, "--judge-method", "reward_model", "--env-reward-weight", "0"))
            print(f"  {steps} steps of trainer.train with the reward model alone in {time.monotonic() - t0:.0f} s:")
            for r in records:
                print(f"    step {r['step']}: rewards/judge/mean {r.get('rewards/judge/mean', float('nan')):.3f}, "
                      f"env reward (weight 0) {r.get('env/echo/reward_mean', float('nan')):.3f}, judge "
                      f"{r.get('judge/seconds', 0):.2f}s {r.get('judge/calls', 0):.0f} calls "
                      f"{r.get('judge/tokens', 0):.0f} tok {r.get('judge/cache_hits', 0):.0f} cached "
                      f"{r.get('judge/failures', 0):.0f} failed")
    finally:
        proc.terminate()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default=os.environ.get("TINY_MODEL_DIR", "/work/tiny-qwen3"),
                   help="the tiny policy (its trunk; --converted serves it as it is)")
    p.add_argument("--reward-model", default=None, help="a tiny reward model made earlier (default: make one)")
    p.add_argument("--episodes", type=int, default=24)
    p.add_argument("--converted", action="store_true", help="also serve the causal LM the same way")
    p.add_argument("--train-steps", type=int, default=0, help="then train this many steps from the reward model")
    p.add_argument("--image", default=None, help="the twin's image (default: this stack's, tools.images)")
    args = p.parse_args()

    from trainer import tiny_reward_model as trm

    with tempfile.TemporaryDirectory(prefix="bench-reward-model-") as tmp:
        rm_dir = Path(args.reward_model or Path(tmp) / "tiny-reward-model")
        t0 = time.monotonic()
        if trm.ensure(Path(args.base), rm_dir) != 0:
            sys.exit(1)
        print(f"tiny reward model at {rm_dir} ({time.monotonic() - t0:.0f} s)", flush=True)
        items = trm.episodes(args.episodes, seed=2_000_003)  # held out: the head was fitted on other seeds
        reference = hf_scores(rm_dir, items)
        print(f"transformers' forward, mean score by kind: {by_kind(reference, items)}")
        case("reward model (Qwen3ForSequenceClassification, num_labels 1)", rm_dir, items, reference, args.image,
             args.train_steps, Path(args.base))
        if args.converted:
            case("the causal LM (Qwen3ForCausalLM) under the same flags", Path(args.base), items, None, args.image)


def hf_scores(model_dir: Path, items) -> list[float]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from trainer import tiny_reward_model as trm

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return trm.scores(model, tokenizer, [(trm.request_messages(p, c), k) for p, c, k in items])


if __name__ == "__main__":
    main()
