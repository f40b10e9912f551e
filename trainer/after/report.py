"""Plot a run's reward and tool curves to a PNG (matplotlib, no display).

    python -m trainer.report --run /outputs/echo                 # -> /outputs/echo/report.png
    python -m trainer.report --outputs /outputs [--run echo] --out-dir /reports   # -> /reports/echo.png

Without --run: the most recently updated run under --outputs. Prints what the plot shows in words.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.core.metrics import METRICS_FILE, read_metrics

TIME_PARTS = ("generation", "env", "scoring", "training", "weight_sync")  # the step's parts (eval: after the step)


def _eval_envs(rows) -> list[str]:
    return sorted({k.split("/")[1] for r in rows for k in r if k.startswith("eval/") and k.endswith("/reward_mean")})


def _beside_the_step(rows) -> set[str]:
    """The time parts that are not parts of the step: an async run's env and scoring seconds are the rollout
    worker's, overlapped with training (trainer.core.async_metrics)."""
    return {"env", "scoring"} if any(r.get("rollouts") == "async" for r in rows) else set()


class ReportError(RuntimeError):
    pass


def find_run(outputs: Path, run: str | None) -> Path:
    if run:
        path = Path(run)
        if path.is_dir():
            return path
        path = outputs / run
        if path.is_dir():
            return path
        raise ReportError(f"no run {run!r} under {outputs}; runs there: {', '.join(list_runs(outputs)) or 'none'}")
    runs = [outputs / r for r in list_runs(outputs)]
    if not runs:
        raise ReportError(f"no runs with {METRICS_FILE} under {outputs}: train first (`make train`)")
    return max(runs, key=lambda p: (p / METRICS_FILE).stat().st_mtime)


def list_runs(outputs: Path) -> list[str]:
    if not outputs.is_dir():
        return []
    return sorted(p.name for p in outputs.iterdir() if (p / METRICS_FILE).is_file())


def series(rows, key):
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _window_mean(values, n=5):
    head, tail = values[:n], values[-n:]
    return (sum(head) / len(head) if head else float("nan"), sum(tail) / len(tail) if tail else float("nan"))


def summarize(rows) -> list[str]:
    lines = [f"{len(rows)} logged steps (step {rows[0]['step']} to {rows[-1]['step']})"]
    for key, label in (("reward", "reward"), ("tools/call_frequency", "tool calls per episode"),
                       ("tools/failure_frequency", "tool failure rate"),
                       ("completions/mean_length", "completion tokens")):
        _, ys = series(rows, key)
        if ys:
            first, last = _window_mean(ys)
            lines.append(f"{label}: {first:.3f} (first {min(5, len(ys))} steps) -> {last:.3f} (last {min(5, len(ys))}); "
                         f"max {max(ys):.3f}")
    envs = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("env/") and k.endswith("/reward_mean")})
    for env in envs:
        _, ys = series(rows, f"env/{env}/reward_mean")
        first, last = _window_mean(ys)
        lines.append(f"env {env}: reward {first:.3f} -> {last:.3f}")
    for env in _eval_envs(rows):  # EVAL_EVERY (trainer.run.evaluation)
        xs, ys = series(rows, f"eval/{env}/reward_mean")
        best = max(range(len(ys)), key=ys.__getitem__)
        lines.append(f"eval {env} (held-out episodes, greedy): reward {ys[0]:.3f} at step {xs[0]} -> {ys[-1]:.3f} at "
                     f"step {xs[-1]}; best {ys[best]:.3f} at step {xs[best]}")
    _, evals = series(rows, "time/eval_s")
    _, steps = series(rows, "time/step_s")
    if evals and steps:
        lines.append(f"eval: {len(evals)} evaluations, {sum(evals) / len(evals):.1f}s each, "
                     f"{sum(evals) / (sum(evals) + sum(steps)):.0%} of the logged time")
    if steps:
        parts, beside = [], _beside_the_step(rows)
        for part in TIME_PARTS:
            _, ys = series(rows, f"time/{part}_s")
            if ys:
                parts.append(f"{part} {sum(ys) / len(ys):.2f}s" + (" (rollout worker, overlapped)" if part in beside
                                                                   else ""))
        lines.append(f"step time {sum(steps) / len(steps):.2f}s on average: " + ", ".join(parts))
    return lines


def plot(rows, out_png: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    ax = axes[0][0]
    xs, ys = series(rows, "reward")
    _, sd = series(rows, "reward_std")
    ax.plot(xs, ys, label="reward (all envs)", color="black", linewidth=2)
    if len(sd) == len(ys):
        ax.fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], color="grey",
                        alpha=0.2, label="± std within batch")
    envs = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("env/") and k.endswith("/reward_mean")})
    if len(envs) > 1:
        for env in envs:
            ax.plot(*series(rows, f"env/{env}/reward_mean"), label=f"reward {env}")
    for env in _eval_envs(rows):  # beside the training curve: held-out episodes, greedy (EVAL_EVERY)
        ax.plot(*series(rows, f"eval/{env}/reward_mean"), marker="o", linestyle="--", label=f"eval {env} (held out)")
    ax.set_title("Reward")
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8)

    ax = axes[0][1]
    ax.plot(*series(rows, "tools/call_frequency"), label="tool calls per episode", color="tab:blue")
    ax.plot(*series(rows, "tools/failure_frequency"), label="tool failure rate", color="tab:red")
    for env in envs:
        ax.plot(*series(rows, f"env/{env}/episode_length"), linestyle="--", label=f"env calls per episode ({env})")
    ax.set_title("Tool use")
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8)

    ax = axes[1][0]
    ax.plot(*series(rows, "completions/mean_length"), label="mean completion tokens", color="tab:green")
    ax.plot(*series(rows, "completions/max_length"), label="max completion tokens", color="tab:green",
            linestyle=":")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens (model-generated)")
    twin = ax.twinx()
    twin.plot(*series(rows, "completions/clipped_ratio"), label="clipped (hit MAX_COMPLETION_LENGTH)",
              color="tab:orange")
    twin.set_ylim(0, 1.05)
    twin.set_ylabel("fraction clipped")
    ax.set_title("Episode length (tokens)")
    ax.set_xlabel("step")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="best", fontsize=8)

    ax = axes[1][1]
    bottom, beside = None, _beside_the_step(rows)
    for part in TIME_PARTS:
        xs, ys = series(rows, f"time/{part}_s")
        if not ys or not any(ys) or part in beside:  # the stack adds up to the step: only its own parts
            continue
        ax.bar(xs, ys, bottom=bottom, label=part, width=0.9)
        bottom = ys if bottom is None else [b + y for b, y in zip(bottom, ys)]
    xs, ys = series(rows, "time/eval_s")
    if ys:  # after its step, on top of it
        at = dict(zip(*series(rows, "time/step_s")))
        ax.bar(xs, ys, bottom=[at.get(x, 0.0) for x in xs], label="eval (after the step)", width=0.9, color="tab:purple")
    ax.set_title("Step time split (s)")
    ax.set_xlabel("step")
    ax.legend(loc="best", fontsize=8)

    fig.suptitle(title)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.splitlines()[0])
    p.add_argument("--run", help="run folder, or a run name under --outputs (default: the latest run)")
    p.add_argument("--outputs", default="/outputs", help="where runs live (default /outputs)")
    p.add_argument("--out-dir", help="write <out-dir>/<run>.png (default: <run>/report.png)")
    args = p.parse_args(argv)
    try:
        run_dir = find_run(Path(args.outputs), args.run)
        rows = read_metrics(run_dir)
        if not rows:
            raise ReportError(f"{run_dir / METRICS_FILE} has no logged steps yet: train first (`make train`)")
    except ReportError as exc:
        print(f"[report] {exc}", file=sys.stderr)
        return 1
    out_png = Path(args.out_dir) / f"{run_dir.name}.png" if args.out_dir else run_dir / "report.png"
    plot(rows, out_png, f"run {run_dir.name} ({rows[-1].get('mode', '?')})")
    print(f"[report] wrote {out_png}")
    for line in summarize(rows):
        print(f"[report] {line}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
