"""`make bench-async-stress`: what async's off-policy correction (OFF_POLICY_CORRECTION) and stale-sample admission
(ASYNC_ADMISSION) do under stress, on `make rehearse` (the vLLM CPU twin as the vllm service, the trainer on CPU),
beside sync rollouts on the same seeds: issue 65 items 3 and 5.

    .venv/bin/python bench/async_stress.py [--seeds 42,7] [--max-steps 12] [--staleness 8] [--learning-rate 5e-4]
                                           [--corrections none,two_sided] [--admissions bounded] [--extra token_tis]

The stress: the slow echo env (each tool call --delay, 250 ms), a high MAX_STALENESS (8: TRL's default in flight is
then 8 steps' samples, so many finish late), a learning rate 2.5x the CPU default (the policy moves further per step,
so a stale sample's ratio to it drifts further), a sync step's sample count per async step (ASYNC_STEP_SAMPLES=batch).
Runs, in this order (each prints its line as it ends, so a cut-short bench still says what it measured): per seed,
sync; async with each --corrections (ASYNC_ADMISSION=free); async with each --admissions (the default correction);
then async with each --extra correction on every seed. Per run, from its metrics.jsonl:

  * the loss's bound: the trained tokens' ratio to the sampler (max over the run, the highest p99), the share of
    tokens whose weight the correction changed, the largest weight a token got (x |A|) against the cap, KL to the
    sampler (mean and max): trainer.core.off_policy's off_policy/* figures;
  * staleness: lag p50/max of the trained samples, samples dropped stale against samples trained;
  * the drop's bias: mean reward and completion tokens of the episodes generated (async/generated_*) against those
    trained (reward, async/trained_tokens), each weighted by its count; sync trains what it generates;
  * learning: the reward curve (means over quarters of the run) and the final reward (mean of the last 3 steps).

Goals printed beside (issue 65): the corrected runs' max weight at or under its cap; their final reward within the
spread of sync's seeds; the chosen admission cuts the trained-vs-generated gap. A benchmark, not a test: it prints
the figures and never fails on them. On a 2-core machine a run takes 3-6 minutes (twin start once, then each run).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.async_figures import Project, cpusets  # noqa: E402

NAN = float("nan")


def _values(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]


def _weighted(rows: list[dict], key: str, weight) -> float:
    pairs = [(float(r[key]), weight(r)) for r in rows if isinstance(r.get(key), (int, float))
             and not math.isnan(r[key]) and weight(r) > 0]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else NAN


def trained(row: dict) -> float:
    """Samples the step trained: async, its lag histogram; sync, the episodes of its batch."""
    lags = [v for k, v in row.items() if k.startswith("async/samples_at_lag/") and isinstance(v, (int, float))]
    if lags:
        return float(sum(lags))
    return float(sum(v for k, v in row.items() if k.startswith("env/") and k.endswith("/episodes")
                     and isinstance(v, (int, float))))


def generated(row: dict) -> float:
    return float(sum(v for k, v in row.items() if k.startswith("env/") and k.endswith("/episodes")
                     and isinstance(v, (int, float))))


def stress_figures(rows: list[dict]) -> dict:
    """One run's figures from its step records (pure: tests/trainer/test_bench_async.py)."""
    rewards = [float(r["reward"]) for r in rows if isinstance(r.get("reward"), (int, float))]
    quarters = [rewards[i * len(rewards) // 4:(i + 1) * len(rewards) // 4] for i in range(4)]
    is_async = any(k.startswith("async/") for r in rows for k in r)
    trained_reward = _weighted(rows, "reward", trained)
    if is_async:
        gen_reward = _weighted(rows, "async/generated_reward", generated)
        gen_tokens = _weighted(rows, "async/generated_tokens", generated)
        trained_tokens = _weighted(rows, "async/trained_tokens", trained)
    else:  # sync trains every episode it generates
        gen_reward, gen_tokens = trained_reward, _weighted(rows, "completions/mean_length", trained)
        trained_tokens = gen_tokens
    caps = _values(rows, "off_policy/weight_cap")
    return {
        "steps": len(rows),
        "ratio_max": max(_values(rows, "off_policy/ratio_max"), default=NAN),
        "ratio_p99": max(_values(rows, "off_policy/ratio_p99"), default=NAN),
        "clipped_share": _weighted(rows, "off_policy/clipped_share", trained),
        "weight_max": max(_values(rows, "off_policy/weight_max"), default=NAN),
        "weight_cap": caps[0] if caps else NAN,
        "kl_mean": _weighted(rows, "off_policy/kl_to_sampler", trained),
        "kl_max": max(_values(rows, "off_policy/kl_to_sampler"), default=NAN),
        "lag_p50": _weighted(rows, "async/staleness_p50", trained),
        "lag_max": max(_values(rows, "async/staleness_max"), default=NAN),
        "dropped": sum(_values(rows, "async/dropped_stale")),
        "trained": sum(trained(r) for r in rows),
        "generated": sum(generated(r) for r in rows) if is_async else sum(trained(r) for r in rows),
        "generated_reward": gen_reward, "trained_reward": trained_reward,
        "generated_tokens": gen_tokens, "trained_tokens": trained_tokens,
        "admission_wait_s": _weighted(rows, "async/admission_wait_s", generated),
        "wall_s": rows[-1]["time"] - rows[0]["time"] + rows[0].get("time/step_s", 0.0) if rows else NAN,
        "curve": [sum(q) / len(q) if q else NAN for q in quarters],
        "final_reward": sum(rewards[-3:]) / len(rewards[-3:]) if rewards else NAN,
    }


def verdicts(results: dict[str, dict], default_label: str) -> list[str]:
    """The goals: the bounded runs' weight at or under the cap; final reward within sync's seeds' spread; the
    bias (trained minus generated reward and tokens) of each admission."""
    lines = []
    sync = [f["final_reward"] for k, f in results.items() if k.startswith("sync")]
    low, high = (min(sync), max(sync)) if sync else (NAN, NAN)
    for key, f in results.items():
        if key.startswith("sync"):
            continue
        parts = []
        if not math.isnan(f["weight_cap"]):
            ok = f["weight_max"] <= f["weight_cap"] + 1e-6
            parts.append(f"max weight {f['weight_max']:.2f} {'<=' if ok else 'ABOVE'} cap {f['weight_cap']:.2f}")
        else:
            parts.append(f"max weight {f['weight_max']:.2f}, no cap (correction none)")
        if len(sync) >= 2:
            within = low <= f["final_reward"] <= high
            parts.append(f"final reward {f['final_reward']:.3f} {'within' if within else 'NOT within'} sync's "
                         f"{low:.3f}..{high:.3f}")
        parts.append(f"trained-generated reward {f['trained_reward'] - f['generated_reward']:+.3f}, tokens "
                     f"{f['trained_tokens'] - f['generated_tokens']:+.1f}")
        lines.append(f"{key}: " + "; ".join(parts))
    lines.append(f"(default under test: {default_label})")
    return lines


def table(results: dict[str, dict]) -> list[str]:
    head = (f"  {'run':<30} {'ratio max/p99':>14} {'clipped':>7} {'weight max/cap':>14} {'KL mean/max':>13} "
            f"{'lag p50/max':>11} {'drop/trained/gen':>16} {'reward gen->trained':>19} {'tokens gen->trained':>19} "
            f"{'held s':>6} {'reward curve (quarters)':>25} {'final':>6} {'wall s':>6}")
    out = [head]
    for key, f in results.items():
        curve = " ".join(f"{v:.2f}" for v in f["curve"])
        out.append(
            f"  {key:<30} {f['ratio_max']:>6.2f}/{f['ratio_p99']:<7.2f} {f['clipped_share']:>7.1%} "
            f"{f['weight_max']:>6.2f}/{f['weight_cap']:<7.2f} {f['kl_mean']:>6.3f}/{f['kl_max']:<6.3f} "
            f"{f['lag_p50']:>5.1f}/{f['lag_max']:<5.0f} {f['dropped']:>5.0f}/{f['trained']:.0f}/{f['generated']:<5.0f} "
            f"{f['generated_reward']:>8.3f}->{f['trained_reward']:<8.3f} {f['generated_tokens']:>8.1f}->"
            f"{f['trained_tokens']:<8.1f} {f['admission_wait_s']:>6.2f} {curve:>25} {f['final_reward']:>6.3f} "
            f"{f['wall_s']:>6.0f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="42,7")
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--staleness", type=int, default=8, help="MAX_STALENESS of the async runs")
    p.add_argument("--learning-rate", default="5e-4", help="LEARNING_RATE of every run (CPU default: 2e-4)")
    p.add_argument("--delay", type=float, default=0.25, help="seconds the slow env takes per tool call")
    p.add_argument("--corrections", default="none,two_sided", help="OFF_POLICY_CORRECTION of the async runs")
    p.add_argument("--admissions", default="bounded", help="ASYNC_ADMISSION values run beside free (TRL's; the "
                   "--corrections runs use it), with the default correction")
    p.add_argument("--extra", default="", help="more corrections, run last on every seed (e.g. token_tis)")
    p.add_argument("--step-samples", choices=("batch", "packed"), default="batch", help="ASYNC_STEP_SAMPLES of the "
                   "async runs (batch: a sync step's count, comparable step by step; packed: the default)")
    p.add_argument("--cpusets", default="auto", help="auto, none, or VLLM:TRAINER cpuset lists")
    p.add_argument("--model", type=Path, default=None, help="a tiny model already made (trainer.tiny_model)")
    p.add_argument("--json", type=Path, default=ROOT / "reports" / "bench-async-stress.json")
    p.add_argument("--logs", type=Path, default=ROOT / "reports" / "bench-async-logs")
    p.add_argument("--skip", default="", help="runs of the plan not to run, by label (e.g. \"sync 42,async none "
                   "free 42\": measured already)")
    p.add_argument("--report", type=Path, nargs="+", default=None, help="print the table and goals of saved --json "
                   "files together (benches cut short included) and run nothing")
    args = p.parse_args()
    from contract.config.off_policy import DEFAULTS

    if args.report:
        saved: dict[str, dict] = {}
        for path in args.report:
            saved.update(json.loads(path.read_text()))
        report(dict(sorted(saved.items(), key=lambda kv: (kv[0].split()[-1], kv[0]))),
               f"OFF_POLICY_CORRECTION={DEFAULTS['async']}")
        return

    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    split = lambda text: [x.strip() for x in text.split(",") if x.strip()]  # noqa: E731
    plan: list[tuple[str, dict[str, str]]] = []
    for seed in seeds:
        plan.append((f"sync {seed}", {"ROLLOUTS": "sync", "SEED": str(seed)}))
        for correction in split(args.corrections):
            plan.append((f"async {correction} free {seed}", {"OFF_POLICY_CORRECTION": correction,
                                                             "ASYNC_ADMISSION": "free", "SEED": str(seed)}))
        for admission in split(args.admissions):
            plan.append((f"async {DEFAULTS['async']} {admission} {seed}", {"ASYNC_ADMISSION": admission,
                                                                             "SEED": str(seed)}))
    for correction in split(args.extra):
        plan += [(f"async {correction} free {seed}", {"OFF_POLICY_CORRECTION": correction, "ASYNC_ADMISSION": "free",
                                                      "SEED": str(seed)}) for seed in seeds]
    skip = set(split(args.skip))
    plan = [(label, variant) for label, variant in plan if label not in skip]
    sets = cpusets(args.cpusets)
    settings = {"ENV_NAME": "echo", "MAX_STEPS": str(args.max_steps), "RESUME": "fresh", "LOGGING_STEPS": "1",
                "TRACE_EVERY": "0", "DATASET_SIZE": "64", "VLLM_SERVER_TIMEOUT_S": "900", "VLLM_MAX_MODEL_LEN": "512",
                "LEARNING_RATE": args.learning_rate, "ENV_STEP_DELAY_S": str(args.delay), "SAVE_STEPS": "1000"}
    async_settings = {"ROLLOUTS": "async", "MAX_STALENESS": str(args.staleness), "ASYNC_STEP_SAMPLES": args.step_samples}
    print(f"[bench-async-stress] {len(plan)} runs: slow echo ({args.delay * 1000:.0f} ms a call), {args.max_steps} steps, "
          f"LEARNING_RATE={args.learning_rate}, async MAX_STALENESS={args.staleness}; CPU sets {sets or 'none'}",
          flush=True)
    results: dict[str, dict] = {}
    args.logs.mkdir(parents=True, exist_ok=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-async-stress-") as tmp:
        project = Project(Path(tmp), settings, env=sets)
        try:
            if args.model:
                project.seed_model(args.model)
            for label, variant in plan:
                run = label.replace(" ", "-")
                extra = {**(async_settings if variant.get("ROLLOUTS") != "sync" else {}), **variant, "RUN_NAME": run}
                project.serve_base_model_again()
                t0 = time.monotonic()
                rc = project.tools("rehearse", env=extra, log=args.logs / f"stress-{run}.log")
                text = project.read(f"/outputs/{run}/metrics.jsonl")
                rows = [json.loads(x) for x in text.splitlines() if '"kind": "step"' in x]
                if rc != 0 or not rows:
                    print(f"[bench-async-stress] {label}: make rehearse exited {rc} with {len(rows)} steps logged "
                          f"(log: {args.logs / f'stress-{run}.log'})", flush=True)
                    continue
                results[label] = stress_figures(rows)
                print(f"[bench-async-stress] {label}: {time.monotonic() - t0:.0f} s", flush=True)
                print("\n".join(table({label: results[label]})[1:]), flush=True)
                args.json.write_text(json.dumps(results, indent=1))
        finally:
            project.down()
    print(f"\nasync under stress on make rehearse (slow echo, {args.max_steps} steps, LEARNING_RATE={args.learning_rate}, "
          f"MAX_STALENESS={args.staleness}, ASYNC_STEP_SAMPLES={args.step_samples}), beside sync on the same seeds:")
    report(results, f"OFF_POLICY_CORRECTION={DEFAULTS['async']}")


def report(results: dict[str, dict], default_label: str) -> None:
    print("\n".join(table(results)))
    for line in verdicts(results, default_label):
        print(f"  {line}")


if __name__ == "__main__":
    main()
