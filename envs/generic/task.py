"""Prompts for an env known only by its server, and synthetic tool calls built from its schemas.

Prompts, two ways (docs/environments.md "Bring your own environment"):
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
import math
import random
import re
from collections import Counter
from pathlib import Path
from typing import Any

from envs.generic.interface import EnvInterface, Param, ToolSpec, shown_value

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
                               "(docs/environments.md \"Bring your own environment\") or leave ENV_PROMPTS_FILE empty")
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
# Demo (warm-start) and baseline calls should be calls the env accepts: what the schema publishes (enum, examples,
# default, minimum/maximum, lengths) and, where the observation lists them, the legal actions.
LEGAL_FIELD = re.compile(r"(?i)legal|valid|available|allowed|possible")
# A 0/1 list over the action ids, 1 where the action is legal (PettingZoo's and upstream sumo_rl_env's action_mask)
MASK_FIELD = re.compile(r"(?i)(?:action|legal|valid)_?mask")
# Argument names that choose the action, for matching an observation's legal actions to a parameter.
CHOICE_PARAM = re.compile(r"(?i)action|move|choice|column|col$|row$|index|cell|position|option|id$")
MAX_DEMO_ITEMS = 3  # items drawn beyond an array's minItems
MAX_DEMO_ARRAY = 32  # items of one array in a demo call, whatever its minItems
MAX_DEMO_CHARS = 256  # characters of a made-up string, whatever its minLength
MAX_DEMO_VALUES = 256  # values in one argument, nested ones included (arrays of arrays of arrays...)
# Values an action's docstring lists for a field when its schema publishes none (upstream snake_env: "action: int in
# [0, 1, 2]"; the server raises on 3-9). Only a listed set counts, never a guessed range.
DOC_VALUES = r"(?:\bin|\bone of)\s*\[([^\[\]]{1,200})\]"


def _scalar_ok(value: Any, kind: Any) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "string":
        return isinstance(value, str)
    return value is not None


def _plain(schema: dict) -> dict:
    """The non-null branch of an Optional[...] (anyOf/oneOf), else the schema."""
    for key in ("anyOf", "oneOf"):
        options = [o for o in schema.get(key, []) if isinstance(o, dict) and o.get("type") != "null"]
        if options:
            return {**options[0], **{k: v for k, v in schema.items() if k in ("default", "examples", "example")}}
    return schema


def _kind(schema: dict) -> Any:
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind


def _bound(schema: dict, key: str) -> float | None:
    """A numeric bound of `schema` when it is a finite number, else None (#63: a NaN or Infinity minimum raised)."""
    value = schema.get(key)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok else None


def _size(schema: dict, key: str, default: int, cap: int) -> int:
    """A length bound (minItems, maxLength...) as an int within 0..cap, whatever the schema says (#63: minItems 3e6
    took 16 s, minLength 3e8 made a 600 MB string)."""
    value = _bound(schema, key)
    return default if value is None else max(0, min(cap, int(value)))


def _number(schema: dict, rng: random.Random, integer: bool) -> Any:
    step = 1 if integer else 1e-6
    low, high = _bound(schema, "minimum"), _bound(schema, "maximum")
    if _bound(schema, "exclusiveMinimum") is not None:
        low = _bound(schema, "exclusiveMinimum") + step
    elif schema.get("exclusiveMinimum") is True and low is not None:  # JSON Schema draft 4
        low += step
    if _bound(schema, "exclusiveMaximum") is not None:
        high = _bound(schema, "exclusiveMaximum") - step
    elif schema.get("exclusiveMaximum") is True and high is not None:
        high -= step
    if low is None and high is None:
        low, high = 0, 9
    elif low is None:
        low = high - 9
    elif high is None:
        high = low + 9
    if integer:
        return rng.randint(int(math.ceil(low)), max(int(math.ceil(low)), int(math.floor(high))))
    value = rng.uniform(float(low), max(float(low), float(high)))
    return round(value, 2) if math.isfinite(value) else float(low)  # ±1e308 bounds: their span overflows


def synthetic_value(param: Param, rng: random.Random, legal: list | None = None, minimal: bool = False) -> Any:
    """A value for `param` its schema allows: one of `legal` (the observation's legal actions) when given, else the
    schema's enum, examples or default, else a value in its range / of its length (`minimal`: an array of its
    fewest items). Small whatever the schema asks: arrays of at most MAX_DEMO_ARRAY items, strings of at most
    MAX_DEMO_CHARS generated characters, at most MAX_DEMO_VALUES values in all (an env refuses a call cut short of its
    bounds, and the warm-start draws another)."""
    if legal:
        return rng.choice(legal)
    return _synthetic(param.schema if isinstance(param.schema, dict) else {}, rng, minimal, [MAX_DEMO_VALUES])


def _synthetic(schema: dict, rng: random.Random, minimal: bool, budget: list[int]) -> Any:
    budget[0] -= 1
    schema = _plain(schema)
    kind = _kind(schema)
    if "enum" in schema and isinstance(schema["enum"], list) and schema["enum"]:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    examples = schema.get("examples")
    examples = examples if isinstance(examples, list) else [schema["example"]] if "example" in schema else []
    examples = [e for e in examples if _scalar_ok(e, kind)] if kind in ("integer", "number", "boolean", "string") \
        else [e for e in examples if e is not None]
    if examples:
        return rng.choice(examples)
    if schema.get("default") is not None:
        return schema["default"]
    if kind == "integer":
        return _number(schema, rng, integer=True)
    if kind == "number":
        return _number(schema, rng, integer=False)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        item = schema.get("items") if isinstance(schema.get("items"), dict) else {}
        low = _size(schema, "minItems", 1, MAX_DEMO_ARRAY)
        high = low if minimal else max(low, min(_size(schema, "maxItems", 2, MAX_DEMO_ARRAY), low + MAX_DEMO_ITEMS))
        return [_synthetic(item, rng, minimal, budget) for _ in range(min(rng.randint(low, high), max(0, budget[0])))]
    if kind == "object":
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = set(r for r in (schema.get("required") or ()) if isinstance(r, str))
        return {k: _synthetic(v if isinstance(v, dict) else {}, rng, minimal, budget)
                for k, v in props.items() if k in required and budget[0] > 0}
    word = rng.choice(WORDS)
    low, high = _size(schema, "minLength", 0, MAX_DEMO_CHARS), _bound(schema, "maxLength")
    word = word + "x" * max(0, low - len(word))
    return word[: max(0, int(high))] if high is not None else word


def shown_call(value: Any) -> Any:
    """A demo call's arguments as the model is shown them (#63: an env's enum, example or default went in raw):
    strings and keys neutralised as in the tool schema (interface.shown_value); the tool class gives the env its own
    enum values back (Param.env_value)."""
    if isinstance(value, dict):
        return {shown_value(k): shown_call(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shown_call(v) for v in value]
    return shown_value(value)


def legal_choices(observation: dict | str | None) -> dict[str, list]:
    """The observation's lists of legal actions, {field: values} (scalars only). A rendered observation (the text
    `render_observation` wrote: `field: value` lines) works too."""
    if isinstance(observation, str):
        parsed = {}
        for line in observation.splitlines():
            name, sep, value = line.partition(": ")
            if sep and (LEGAL_FIELD.search(name) or MASK_FIELD.search(name)) and value.startswith("["):
                try:
                    parsed[name] = json.loads(value)
                except ValueError:
                    continue
        observation = parsed
    out = {}
    for name, value in (observation or {}).items():
        if MASK_FIELD.search(str(name)) and isinstance(value, list) and value and \
                all(v in (0, 1) for v in value) and any(value):
            out[str(name)] = [i for i, v in enumerate(value) if v]  # the ids it marks legal
        elif LEGAL_FIELD.search(str(name)) and isinstance(value, list) and value and \
                all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            out[str(name)] = value
    return out


def documented_values(tool: ToolSpec, param: Param) -> list | None:
    """The values `param`'s description, or a `<name>: <type> in [a, b, c]` line of the tool's description, lists; None
    when the schema already bounds it (enum, range, examples, default) or no such list parses as its type."""
    schema = _plain(param.schema if isinstance(param.schema, dict) else {})
    kind = _kind(schema)
    published = ("enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "examples", "example")
    if kind not in ("integer", "string") or any(k in schema for k in published) or schema.get("default") is not None:
        return None
    found = re.search(DOC_VALUES, param.description or "") or re.search(
        rf"\b{re.escape(param.name)}\s*(?:\([^)]{{0,40}}\))?\s*:\s*\w{{0,10}}\s*{DOC_VALUES}", tool.description or "")
    if not found:
        return None
    items = [i.strip().strip("'\"") for i in found.group(1).split(",")]
    try:
        values = [int(i) for i in items] if kind == "integer" else items
    except ValueError:
        return None
    return values if values and all(v != "" for v in values) else None


def _legal_for(tool: ToolSpec, legal: dict[str, list]) -> dict[str, list]:
    """Which parameter of `tool` the observation's legal actions are for: one whose type matches, preferring a name
    that chooses an action (action_id, move, column...), else the tool's only required parameter of that type."""
    out: dict[str, list] = {}
    for values in legal.values():
        kind = "integer" if isinstance(values[0], int) else "string"
        fits = [p for p in tool.params if _kind(_plain(p.schema if isinstance(p.schema, dict) else {})) == kind
                and p.name not in out]
        named = [p for p in fits if CHOICE_PARAM.search(p.name)]
        required = [p for p in fits if p.required]
        choice = named[0] if named else required[0] if len(required) == 1 else None
        if choice is not None:
            out[choice.name] = values
    return out


def demo_calls(interface: EnvInterface, rng: random.Random, observation: dict | str | None = None,
               minimal: str | None = None) -> list[tuple[str, dict]]:
    """One or two calls of the env's tools that the schema (and the observation's legal actions) allow: required
    arguments always, optional ones that publish a default or examples too, others sometimes. `minimal` (the shapes
    tried first after the env refused a call, where the schema leaves them open): arrays of their fewest items, with
    every optional argument ("all") or with none that publishes no value ("required")."""
    legal = legal_choices(observation)
    calls = []
    for _ in range(rng.randint(1, 2)):
        tool = rng.choice(interface.tools)
        choices = _legal_for(tool, legal) if legal else {}
        for p in tool.params:
            if p.name not in choices and (listed := documented_values(tool, p)):
                choices[p.name] = listed
        args = {}
        for p in tool.params:
            schema = _plain(p.schema if isinstance(p.schema, dict) else {})
            published = schema.get("default") is not None or "examples" in schema or "example" in schema
            sometimes = minimal == "all" or (minimal is None and rng.random() < 0.5)
            if p.required or p.name in choices or published or sometimes:
                args[p.name] = synthetic_value(p, rng, choices.get(p.name), minimal=minimal is not None)
        calls.append((tool.name, shown_call(args)))
    return calls
