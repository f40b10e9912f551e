"""Rollout traces: what the model actually did in an episode, kept in `/outputs/<run>/rollouts.jsonl`.

At the first step and every TRACE_EVERY steps (`traced`) the trainer writes TRACE_SAMPLES rollouts of the batch it
trains on (default: one GRPO group, so the rollouts compared with each other are seen together), one JSON object per
line:

    step, env, reset (the row's reset kwargs: the `seed` its whole group shares, envs.generic.task), prompt (chat
    messages), turns (the assistant turns and tool results, as TRL's completion messages), tool_calls ([{tool,
    arguments, result, failed}] in order), step_rewards (the env's per-step rewards where it reports them, else null),
    env_reward (the episode's reward from the env), reward (what GRPO used: the sum of every reward function; null for
    an episode left out), rewards ({function: value}), infra_failure (why the env side ended the episode, which
    training then left out: trainer.rollouts.infra_failures; else null), judge (a judge on: {score, verdict,
    rationale, failure, flagged, cached} of trainer.judge.reward, a failed call's row left out; else null)

ROLLOUTS=async: the rollout worker writes them (trainer.async_grpo.async_run), TRACE_SAMPLES rollouts (groups as they
are scored) of the first and each TRACE_EVERY-th policy version, with `policy_version` (how many weight updates the generating policy
had) and `step` = policy_version + 1 (the step a sync run would have traced them at; the trainer may train them a few
steps later, up to MAX_STALENESS).

`python -m trainer.rollouts --outputs /outputs [--run NAME] [--step N]` prints them readably (`make rollouts`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from envs.core import tool as env_tool
from envs.core.untrusted import escape_controls, one_line

ROLLOUTS_FILE = "rollouts.jsonl"
REQUIRED = {"step": int, "env": str, "reset": dict, "prompt": list, "turns": list, "tool_calls": list,
            "env_reward": (int, float, type(None)), "reward": (int, float, type(None)), "rewards": dict}
RESULT_CHARS = 2000  # a tool result kept in a trace; longer ones are cut (the model saw them whole)


def traced(step: int, every: int) -> bool:
    """Is `step` (1-based) one to trace: the first, so a short first run shows what the model did, and every
    `every`-th (TRACE_EVERY; 0: none)."""
    return bool(every) and (step == 1 or step % every == 0)


class Trace:
    """One episode as its env session saw it: reset kwargs and each tool call (kept on the bound tool instance)."""

    def __init__(self, env: str, reset: dict[str, Any]) -> None:
        self.env, self.reset = env, reset
        self.calls: list[dict[str, Any]] = []
        self.env_reward: float | None = None
        self.infra_failure: str | None = None  # set by the binding: why the env side ended the episode
        self.call_count = self.failure_count = 0  # the binding's counts at the reward (`scored`)
        self.judge: dict[str, Any] | None = None  # the judge's record of the episode (trainer.judge.reward)

    def scored(self, env_reward: float, call_count: int, failure_count: int) -> None:
        """The episode's env reward and its tool calls and failed calls as the binding counted them (calls made after
        its session closed included, which `calls` leaves out)."""
        self.env_reward, self.call_count, self.failure_count = env_reward, call_count, failure_count

    def call(self, tool: str, arguments: dict[str, Any], result: Any, failed: bool) -> None:
        self.calls.append({"tool": tool, "arguments": arguments, "result": _text(result)[:RESULT_CHARS],
                           "failed": failed})


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _jsonable(value: Any) -> Any:
    # NaN and ±Infinity (an env's step reward, a reward function's "not scored") become null: the file is strict JSON.
    return json.loads(json.dumps(value, default=str), parse_constant=lambda _: None)


def rows(step: int, prompts: list, completions: list, environments: list, rewards: list[dict[str, float]],
         total: list[float]) -> list[dict[str, Any]]:
    """The trace rows of one batch (index i: the i-th rollout of every list)."""
    out = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        env = environments[i] if environments and i < len(environments) else None
        trace: Trace | None = env_tool.trace_of(env)
        step_rewards = env_tool.step_rewards(env)  # generic envs keep the per-step rewards they were sent
        out.append(_jsonable({
            "step": step,
            "env": trace.env if trace else getattr(env, "env_name", "?"),
            "reset": trace.reset if trace else {},
            "prompt": prompt,
            "turns": completion if isinstance(completion, list) else [{"role": "assistant", "content": completion}],
            "tool_calls": trace.calls if trace else [],
            "step_rewards": step_rewards,
            "env_reward": trace.env_reward if trace else None,
            "reward": None if trace and (trace.infra_failure or _judge_failed(trace)) else total[i],
            "rewards": {k: (None if v != v else v) for k, v in rewards[i].items()},  # NaN (not scored): null
            "infra_failure": trace.infra_failure if trace else None,
            "judge": getattr(trace, "judge", None) if trace else None,
        }))
    return out


def _judge_failed(trace: Trace) -> bool:
    judged = getattr(trace, "judge", None)
    return isinstance(judged, dict) and bool(judged.get("failure"))


def append(run_dir: Path, new_rows: list[dict[str, Any]]) -> None:
    path = Path(run_dir) / ROLLOUTS_FILE
    with path.open("a") as f:
        for row in new_rows:
            f.write(json.dumps(row, allow_nan=False) + "\n")


def problems(row: dict[str, Any]) -> list[str]:
    """Why a row does not fit the schema above (empty: it fits)."""
    out = [f"{key}: missing" for key in REQUIRED if key not in row]
    out += [f"{key}: {type(row[key]).__name__}" for key, kind in REQUIRED.items()
            if key in row and not isinstance(row[key], kind)]
    for call in row.get("tool_calls") or []:
        if not {"tool", "arguments", "result", "failed"} <= set(call):
            out.append(f"tool_calls: {call}")
    return out


# --------------------------------------------------------------------------------------------- printing
def read(path: Path) -> list[dict[str, Any]]:
    return read_lines(path.read_text())


def read_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def seed_of(reset: Any) -> Any:
    """The seed an episode reset with (a built-in env's `seed`, a generic env's `reset_kwargs.seed`), else None."""
    if not isinstance(reset, dict):
        return None
    inner = reset.get("reset_kwargs")
    return reset.get("seed", inner.get("seed") if isinstance(inner, dict) else None)


def task_of(reset: Any) -> tuple[str, int] | None:
    """(split, index) of the task an episode played, for an env that serves its own tasks (envs.generic.tasks), else
    None."""
    inner = reset.get("reset_kwargs") if isinstance(reset, dict) else None
    if isinstance(inner, dict) and "split" in inner and "index" in inner:
        return inner["split"], inner["index"]
    return None


def episode_key(reset: Any) -> str:
    """What a GRPO group shares: `task test[3]` for an env's own task, else `seed 7`, else `no seed`."""
    task = task_of(reset)
    if task is not None:
        return f"task {task[0]}[{task[1]}]"
    seed = seed_of(reset)
    return f"seed {json.dumps(seed)}" if seed is not None else "no seed"


def seed_groups(rows: list[dict[str, Any]]) -> str:
    """"seed 7 ×4, seed 9 ×4" (or "task train[3] ×4"): the seed or task each traced group played, first seen first
    (a GRPO group shares its row's seed or task)."""
    counts: dict[str, int] = {}
    for row in rows:
        key = episode_key(row.get("reset"))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{key} ×{n}" for key, n in counts.items())


def render(row: dict[str, Any]) -> str:
    """One rollout as a terminal reader wants it: the prompt's last user turn, each turn, each call and result."""
    reward = f"{row['reward']:+.3f}" if row["reward"] is not None else "none"
    seed = seed_of(row["reset"])
    task = task_of(row["reset"])
    played = (f"split {task[0]} · index {task[1]}" if task is not None
              else f"seed {json.dumps(seed) if seed is not None else '-'}")
    lines = [f"── step {row['step']} · env {row['env']} · reward {reward} "
             f"(env {row['env_reward'] if row['env_reward'] is not None else '-'}) · "
             f"{played} · reset {json.dumps(row['reset'])}"]
    if row.get("infra_failure"):
        lines.append(f"  LEFT OUT (the env side ended it): {_one_line(row['infra_failure'])}")
    user = [m for m in row["prompt"] if isinstance(m, dict) and m.get("role") == "user"]
    if user:
        lines.append(f"  user: {_one_line(user[-1].get('content'))}")
    for turn in row["turns"]:
        role = turn.get("role", "?") if isinstance(turn, dict) else "assistant"
        content = turn.get("content") if isinstance(turn, dict) else turn
        if content:
            lines.append(f"  {role}: {_one_line(content)}")
        for call in (turn.get("tool_calls") or []) if isinstance(turn, dict) else []:
            fn = call.get("function", call)
            lines.append(f"  {role} calls {fn.get('name')}({json.dumps(fn.get('arguments'))})")
    for i, call in enumerate(row["tool_calls"], 1):
        mark = "FAILED " if call["failed"] else ""
        lines.append(f"  [{i}] {call['tool']}({json.dumps(call['arguments'])}) -> {mark}{_one_line(call['result'])}")
    if row.get("step_rewards"):
        lines.append(f"  step rewards: {row['step_rewards']}")
    judged = row.get("judge")
    if isinstance(judged, dict):
        lines.append(f"  judge: {_judge_line(judged)}")
    return "\n".join(lines)


def _judge_line(judged: dict[str, Any]) -> str:
    """The judge's record of a rollout: score, verdict, rationale; a failed call says why (the row was left out)."""
    if judged.get("failure"):
        text = f"FAILED, left out: {judged['failure']}"
    else:
        score = judged.get("score")
        text = f"score {score:.3f}" if isinstance(score, (int, float)) else "score -"
        text += f" · verdict {judged.get('verdict')}"
        if judged.get("rationale"):
            text += f" · {judged['rationale']}"
    marks = [m for m, on in (("cached", judged.get("cached")), ("FLAGGED: its text addresses the judge",
                                                                 judged.get("flagged"))) if on]
    return _one_line(text + (f" ({'; '.join(marks)})" if marks else ""), 400)


def _one_line(text: Any, limit: int = 300) -> str:
    """Env and model text for a terminal: one line, control characters escaped (an OSC 52 sequence in an observation
    would write the reader's clipboard; a carriage return would print over the reward)."""
    return one_line(text, limit)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make rollouts", description="Print a run's traced rollouts readably.")
    p.add_argument("--outputs", default="/outputs")
    p.add_argument("--run", help="run folder (default: the one written last)")
    p.add_argument("--step", type=int, help="only this step (default: the last traced one)")
    args = p.parse_args(argv)
    outputs = Path(args.outputs)
    runs = [d for d in outputs.iterdir() if (d / ROLLOUTS_FILE).exists()] if outputs.exists() else []
    if args.run:
        runs = [d for d in runs if d.name == args.run]
    if not runs:
        print(f"no {ROLLOUTS_FILE} under {outputs}{' for run ' + args.run if args.run else ''}: a run traces its first "
              "step and every TRACE_EVERY steps (.env); train first (`make train`)", file=sys.stderr)
        return 1
    run = max(runs, key=lambda d: (d / ROLLOUTS_FILE).stat().st_mtime)
    traced = read(run / ROLLOUTS_FILE)
    steps = sorted({r["step"] for r in traced})
    step = args.step if args.step is not None else steps[-1]
    chosen = [r for r in traced if r["step"] == step]
    if not chosen:
        print(f"run {run.name}: no rollouts traced at step {step}; traced steps: {', '.join(map(str, steps))}",
              file=sys.stderr)
        return 1
    print(f"run {run.name}, step {step}: {len(chosen)} rollout(s) (traced steps: {', '.join(map(str, steps))})")
    print(escape_controls(f"played: {seed_groups(chosen)}\n"))
    print(escape_controls("\n\n".join(render(r) for r in chosen)))  # whatever a hand-edited file carries
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
