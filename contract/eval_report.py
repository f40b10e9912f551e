"""eval.json, the evaluation of a run (`make eval` writes it, `make export` puts its table in the model card).

{"run": str, "checkpoint": str, "step": int, "base_model": str, "threshold": float, "episodes_per_env": int,
 "ks": [1, ..., NUM_GENERATIONS], "seeds": {"<env>": [seed or row index, ...]},
 "rows": [{"model": "base" | "trained", "env": str, "episodes": int, "mean_reward": float, "success_rate": float,
           "pass_at_k": {"1": float, ...}, "tool_calls_per_episode": float, "tool_failures_per_episode": float,
           "tokens_per_episode": float, "infra_failures": int}, ...]}

An episode the env side ended (trainer.rollouts.infra_failures) is not scored: `episodes` and every figure count the scored
ones, `infra_failures` the others; a figure with no scored episode is null (printed n/a).
"""

from __future__ import annotations

import json
from math import comb
from pathlib import Path
from typing import Any

EVAL_FILE = "eval.json"
ROW_KEYS = ("model", "env", "episodes", "mean_reward", "success_rate", "pass_at_k", "tool_calls_per_episode",
            "tool_failures_per_episode", "tokens_per_episode", "infra_failures")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    return 1.0 if n - c < k else 1.0 - comb(n - c, k) / comb(n, k)


def read(run_dir: str | Path) -> dict[str, Any] | None:
    path = Path(run_dir) / EVAL_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write(run_dir: str | Path, data: dict[str, Any]) -> Path:
    path = Path(run_dir) / EVAL_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def markdown_table(data: dict[str, Any]) -> str:
    """Base and trained side by side, one line per env and model (the terminal and the model card show this)."""
    ks = data.get("ks") or []
    head = ["env", "model", "episodes", "mean reward", f"success (> {data['threshold']:g})",
            *(f"pass@{k}" for k in ks), "tool calls/ep", "failures/ep", "tokens/ep", "env-ended (left out)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in sorted(data["rows"], key=lambda r: (r["env"], r["model"] != "base")):
        cells = [row["env"], row["model"], str(row["episodes"]), _shown(row["mean_reward"], ".3f"),
                 _shown(row["success_rate"], ".0%"), *(_shown(row["pass_at_k"].get(str(k)), ".2f") for k in ks),
                 _shown(row["tool_calls_per_episode"], ".2f"), _shown(row["tool_failures_per_episode"], ".2f"),
                 _shown(row["tokens_per_episode"], ".0f"), str(row.get("infra_failures", 0))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _shown(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)  # None: no scored episode (all ended by the env side)
