"""Prompts for an env known only by its server, and synthetic tool calls built from its schemas.

Prompts, two ways (README "Bring your own environment"):
  * default: one instruction (ENV_INSTRUCTION) per row, each row resetting with its own seed; the
    reset observation is appended to the prompt by TRL;
  * ENV_PROMPTS_FILE: a JSONL file, one row per line: {"prompt": "text" or [chat messages],
    "reset": {kwargs for the env's reset}, "environment": "<name>" (multi-env runs, optional)}.
    A row whose "reset" has no "seed" gets one derived from the row itself (`line_seed`): every member of a GRPO
    group then plays the same episode of a stochastic env (else the group baseline compares different tasks), and
    the seed stays the same across resumes and edits elsewhere in the file. `"seed": null` sends none.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from pathlib import Path
from typing import Any

from envs.generic.interface import EnvInterface, Param

DEFAULT_INSTRUCTION = (
    "You are acting in an environment through its tools. Call a tool to act; each tool result shows what "
    "happened. Keep acting until the task is done or the episode is over, then answer briefly."
)
WORDS = ("apple", "river", "green", "music", "cloud", "stone")


class PromptsFileError(ValueError):
    pass


def instruction_rows(n: int, seed: int, instruction: str) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": instruction}], "reset_kwargs": {"seed": seed + i}}
            for i in range(n)]


def canonical(item: dict) -> str:
    """A row's content, key order and spacing aside."""
    return json.dumps(item, sort_keys=True, separators=(",", ":"))


def line_seed(row: str, occurrence: int) -> int:
    """A reset seed for a prompts-file row that names none: from the row's content (`canonical`) and how many
    identical rows came before it, so duplicated rows still play different episodes."""
    return int.from_bytes(hashlib.sha256(f"{occurrence}:{row}".encode()).digest()[:4], "big") % 2**31


def prompts_file_rows(path: str, env_name: str) -> list[dict]:
    """Rows of a JSONL prompts file meant for `env_name` (rows naming another env are skipped)."""
    file = Path(path)
    if not file.is_file():
        raise PromptsFileError(f"ENV_PROMPTS_FILE={path}: no such file in the trainer container; mount it "
                               "(README \"Bring your own environment\") or leave ENV_PROMPTS_FILE empty")
    rows = []
    seen: Counter[str] = Counter()
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise PromptsFileError(f"ENV_PROMPTS_FILE line {n}: not JSON ({exc}); one JSON object per line") from None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m for m in prompt)):
            raise PromptsFileError(f"ENV_PROMPTS_FILE line {n}: needs \"prompt\": a string or a list of "
                                   "{\"role\", \"content\"} messages")
        reset = item.get("reset") or {}
        if not isinstance(reset, dict):
            raise PromptsFileError(f"ENV_PROMPTS_FILE line {n}: \"reset\" must be an object of reset kwargs")
        target = item.get("environment")
        if target is not None and target != env_name:
            continue  # a row without "environment" serves every env of the run
        if "seed" not in reset:
            key = canonical(item)
            reset = {**reset, "seed": line_seed(key, seen[key])}
            seen[key] += 1
        rows.append({"prompt": prompt, "reset_kwargs": reset})
    if not rows:
        raise PromptsFileError(f"ENV_PROMPTS_FILE={path}: no row for env {env_name!r}")
    return rows


def make_dataset(n: int, seed: int, env_name: str, instruction: str | None = None,
                 prompts_file: str | None = None) -> list[dict]:
    """The file's rows as they are (DATASET_SIZE does not apply), else `n` instruction rows."""
    if prompts_file:
        return prompts_file_rows(prompts_file, env_name)
    return instruction_rows(n, seed, instruction or DEFAULT_INSTRUCTION)


# ------------------------------------------------------------------------------------ synthetic calls
def synthetic_value(param: Param, rng: random.Random) -> Any:
    schema = param.schema
    for key in ("anyOf", "oneOf"):
        options = [o for o in schema.get(key, []) if o.get("type") != "null"]
        if options:
            schema = options[0]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next(k for k in kind if k != "null")
    if kind == "integer":
        low = int(schema.get("minimum", 0))
        high = int(schema.get("maximum", low + 9))
        return rng.randint(low, max(low, high))
    if kind == "number":
        low = float(schema.get("minimum", 0.0))
        return round(rng.uniform(low, float(schema.get("maximum", low + 10.0))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        item = Param("item", None, "", True, schema.get("items") or {"type": "string"})
        return [synthetic_value(item, rng) for _ in range(rng.randint(1, 2))]
    if kind == "object":
        return {}
    return rng.choice(WORDS)


def demo_calls(interface: EnvInterface, rng: random.Random) -> list[tuple[str, dict]]:
    """One or two well-formed calls of the env's tools (required arguments always, optional ones sometimes)."""
    calls = []
    for _ in range(rng.randint(1, 2)):
        tool = rng.choice(interface.tools)
        args = {p.name: synthetic_value(p, rng) for p in tool.params if p.required or rng.random() < 0.5}
        calls.append((tool.name, args))
    return calls
