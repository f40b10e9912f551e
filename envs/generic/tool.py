"""A TRL `environment_factory` class for any OpenEnv server, built from its `EnvInterface`.

Same contract as the hand-written tool classes (`__init__(base_url)`, `reset(**row)`, tools,
`get_reward()`), so `trainer.rollouts.envs_binding.bind` spreads it over replicas and counts its calls.
  * reset: starts an episode (the row's `reset_kwargs` go to the server) and returns the reset
    observation as text, which TRL appends to the prompt; over the `http-mcp` transport (a server with no /ws) an
    episode is a new MCP session, which takes no reset arguments and has no reset observation;
  * each tool: one step on the server; MCP tools return the tool's result, typed actions the new
    observation as readable text (trimmed to a budget); an error the env reports is raised, so TRL
    shows it to the model and the run goes on;
  * reward: the episode's step rewards, summed (or the last one); after `done` a call says so;
  * an env that publishes its tasks (envs.generic.tasks) and scores a final answer through a tool (its answer tool):
    a model that ends the episode in plain text has that text submitted through it (`_submit_final`), the episode's
    reward then being the one that call reports.
A reset observation is shown as the task's prompt where the env gives one (`metadata.prompt`, as `openenv import`'s
ORS wrapper does), and never with a `task_spec` (it may hold the answer: an ORS task spec carries its `solution`).
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any, Iterable, Iterator, Literal

from envs.core.client import SessionClient
from envs.core.http_mcp import TRANSPORT, McpHttpSession
from envs.core.tool import EnvTool
from envs.core.untrusted import safe_text
from envs.generic.interface import EnvInterface, ToolSpec

RewardMode = Literal["sum", "last"]
EPISODE_OVER = "The episode is over (done). Stop calling tools and give your final answer."


# ------------------------------------------------------------------------------------ observation -> text
# Values are rendered piece by piece and only up to the budget: a hostile env's 1 MiB board costs what the model
# sees, not the whole board formatted (16 MiB once cost 590 MiB and a second for 2,000 characters).
_JSON = json.JSONEncoder(default=str, ensure_ascii=False)


def _pieces(value: Any) -> Iterator[str]:
    if isinstance(value, list) and value and all(isinstance(row, list) for row in value):
        for row in value:  # a board / grid: one line per row
            yield "\n"
            for j, cell in enumerate(row):
                yield (" " if j else "") + str(cell)
    elif isinstance(value, str):
        yield value
    else:
        yield from _JSON.iterencode(value)  # lazy (the one-shot C encoder would build it all)


def _take(pieces: Iterable[str], budget: int) -> str:
    """The text of `pieces` up to one character past `budget` (enough for safe_text to know it was cut)."""
    out, size = [], 0
    for piece in pieces:
        out.append(piece[: budget + 1 - size])
        size += len(out[-1])
        if size > budget:
            break
    return "".join(out)


def trim(text: str, budget: int) -> str:
    """At most `budget` characters, control characters escaped (envs.core.untrusted.safe_text)."""
    return safe_text(text, budget)


# Fields the model needs to act and to see how it does: shown first, whatever the env's field order.
_FIRST_FIELDS = re.compile(r"(?i)legal|valid|available|allowed|possible|score|reward|points")
SUMMARY_MIN_NUMBERS = 16  # a shorter numeric list is shown as it is, cut if it must be
MAX_STAT_NUMBERS = 1_000_000  # statistics of a bigger array are of its first this many numbers


def _array_summary(value: Any) -> str | None:
    """A (nested) list of numbers as shape, type and statistics; None for anything else. Walks at most
    MAX_STAT_NUMBERS leaves with an explicit stack (no copy of the array)."""
    if not isinstance(value, list):
        return None
    shape, node = [], value
    while isinstance(node, list):
        shape.append(len(node))
        if not node:
            break
        node = node[0]
    count, low, high, total, kinds, ragged = 0, None, None, 0.0, set(), False
    stack = [(value, 0)]
    while stack and count < MAX_STAT_NUMBERS:
        node, depth = stack.pop()
        if isinstance(node, list):
            ragged |= depth >= len(shape) or len(node) != shape[depth]
            stack.extend((child, depth + 1) for child in reversed(node))
            continue
        if isinstance(node, bool) or not isinstance(node, (int, float)):
            return None
        ragged |= depth != len(shape)
        kinds.add(type(node).__name__)
        count += 1
        total += node
        low = node if low is None or node < low else low
        high = node if high is None or node > high else high
    if count < SUMMARY_MIN_NUMBERS:
        return None
    dims = f"{count:,}+ numbers" if stack else (f"{count:,} numbers, ragged" if ragged else
                                                "x".join(str(n) for n in shape))
    sampled = f" (of the first {count:,})" if stack else ""
    return (f"[array {dims}, {'float' if 'float' in kinds else 'int'}; min {low:g}, max {high:g}, "
            f"mean {total / count:.4g}{sampled}; too big to show in full]")


def _shares(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Split `total` characters among fields: a field that needs less than an equal share keeps what it needs,
    the rest is split equally among the bigger ones."""
    shares, left, remaining = {}, dict(sizes), max(0, total)
    while left:
        fair = remaining // len(left)
        small = {k: n for k, n in left.items() if n <= fair}
        if not small:
            shares.update({k: fair for k in left})
            break
        for k, n in small.items():
            shares[k], remaining = n, remaining - n
            del left[k]
    return shares


def render_observation(observation: dict, budget: int) -> str:
    """An observation as `field: value` lines (grids as rows); `metadata` only when nothing else is there.

    Within `budget`, every field gets its share (ENV_OBSERVATION_CHARS): one huge field cannot push the others
    out. A numeric array too big for its share is summarised (shape, min, max, mean); legal actions and scores
    come first."""
    fields = {k: v for k, v in (observation or {}).items() if v not in (None, "", [], {}) and k != "metadata"}
    if not fields and isinstance((observation or {}).get("metadata"), dict):
        fields = {k: v for k, v in observation["metadata"].items() if v not in (None, "", [], {})}
    names = sorted(fields, key=lambda k: not _FIRST_FIELDS.search(str(k)))[: max(1, budget // 8)]
    # each value rendered only up to the budget: a hostile env's 16 MiB board costs what the model sees
    texts = {k: _take(_pieces(fields[k]), budget) for k in names}
    room = budget - sum(len(f"{k}: ") for k in names) - (len(names) - 1)  # headers and newlines
    shares = _shares({k: len(t) for k, t in texts.items()}, room)
    summarised = False
    for k in names:
        if len(texts[k]) > shares[k] and (summary := _array_summary(fields[k])) is not None:
            texts[k], summarised = summary, True
    if summarised:
        shares = _shares({k: len(t) for k, t in texts.items()}, room)
    lines = []
    for k in names:
        text = texts[k]
        if len(text) > shares[k]:
            text = text[: max(0, shares[k] - 1)] + "…"
        lines.append(f"{k}: {text}")
    hidden = len(fields) - len(names)
    if hidden:
        lines.append(f"… {hidden:,} more fields")
    return trim("\n".join(lines), budget)


# Keys of a reset observation never shown to the model: a task's spec may hold its answer (ORS: `solution`).
HIDDEN_KEYS = ("task_spec",)


def blocks_text(value: Any) -> str | None:
    """The text of a prompt given as a string, content blocks ([{"type": "text", "text": ...}], ORS's and MCP's) or
    chat messages ([{"role", "content"}]); None for anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        parts = [v.get("text") if isinstance(v.get("text"), str) else blocks_text(v.get("content")) for v in value]
        parts = [p for p in parts if p]
        return "\n".join(parts) if parts else None
    return None


def reset_text(data: dict, budget: int) -> str:
    """What the model is shown of a reset: the observation's fields (task_spec left out), or, where it has none but
    metadata (OpenEnv's bare `Observation`, `openenv import`'s wrappers), the prompt the metadata gives, else that
    metadata without its task_spec."""
    observation = {k: v for k, v in (data.get("observation") or {}).items() if k not in HIDDEN_KEYS}
    metadata = observation.get("metadata") if isinstance(observation.get("metadata"), dict) else data.get("metadata")
    if not any(v not in (None, "", [], {}) for k, v in observation.items() if k != "metadata") \
            and isinstance(metadata, dict):
        prompt = blocks_text(metadata.get("prompt"))
        if prompt:
            return trim(_take([prompt], budget), budget)
        observation = {"metadata": {k: v for k, v in metadata.items() if k not in HIDDEN_KEYS}}
    return render_observation(observation, budget)


def mcp_result_text(result: Any, budget: int) -> str:
    """A FastMCP CallToolResult (as JSON) -> its value (`data`, else structured content, else text blocks; an ORS
    tool's `blocks`), trimmed."""
    if isinstance(result, dict):
        if isinstance(result.get("blocks"), list) and blocks_text(result["blocks"]) is not None:
            result = blocks_text(result["blocks"])
        elif result.get("data") is not None:
            result = result["data"]
        elif result.get("structured_content") is not None:
            result = result["structured_content"]
        elif isinstance(result.get("content"), list):
            texts = [c.get("text", "") for c in result["content"] if isinstance(c, dict)]
            result = "\n".join(t for t in texts if isinstance(t, str) and t)
    return trim(_take([result] if isinstance(result, str) else _JSON.iterencode(result), budget), budget)


# ------------------------------------------------------------------------------------ the class
class GenericTool(EnvTool):
    """Base of the generated classes (private class attributes: a tool name never starts with `_`)."""

    _interface: EnvInterface
    _reward_mode: RewardMode = "sum"
    _budget: int = 2000
    _answer: tuple[str, str] | None = None  # (tool, argument) a plain-text final answer is submitted through

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._rewards: list[float] = []
        self._done = False

    def reset(self, reset_kwargs: dict | None = None, **row: Any) -> str | None:
        self._rewards, self._done = [], False
        data = self._client.reset(**(reset_kwargs or {}))
        text = reset_text(data, self._budget)
        prompt = row.get("prompt")
        empty = isinstance(prompt, list) and prompt and not (prompt[-1] or {}).get("content")
        return (text if empty else f"\n\n{text}") if text else None  # a task row's user message is the task's prompt

    def _submit_final(self, text: str) -> tuple[str, dict, str, bool] | None:
        """The episode ended in plain text and the env scores answers through a tool: submit `text` through it.
        (tool, arguments, result, failed), or None when there is nothing to submit (no answer tool, episode over)."""
        if self._answer is None or self._done:
            return None
        name, argument = self._answer
        spec = self._interface.tool(name)
        arguments = {argument: text}
        try:
            return name, arguments, self._step(spec, arguments), False
        except RuntimeError as exc:  # the env refused it: the model sees nothing more, the reward stays the episode's
            return name, arguments, str(exc), True

    def _step(self, spec: ToolSpec, arguments: dict) -> str:
        if self._done:
            raise RuntimeError(EPISODE_OVER)
        args = {k: spec_param(spec, k).env_value(v) for k, v in arguments.items()  # an enum value shown neutralised
                if v is not None or spec_param(spec, k).required}                      # goes back as the env's own
        if self._interface.kind == "mcp":
            data = self._client.step({"type": "call_tool", "tool_name": spec.name, "arguments": args})
        else:
            data = self._client.step(args)
        self._record(data)
        observation = data.get("observation") or {}
        if self._interface.kind == "mcp":
            error = observation.get("error")
            if error:
                message = (error.get("message") if isinstance(error, dict) else error) or "tool failed"
                raise RuntimeError(trim(_take(_pieces(message), self._budget), self._budget) or "tool failed")
            result = observation.get("result")
            if isinstance(result, dict) and result.get("is_error"):
                raise RuntimeError(mcp_result_text({"content": result.get("content")}, self._budget) or "tool failed")
            text = mcp_result_text(result, self._budget)
        else:
            text = render_observation(observation, self._budget)
        return text + (f"\n{EPISODE_OVER}" if self._done else "")

    def _record(self, data: dict) -> None:
        if isinstance(data.get("reward"), (int, float)):
            self._rewards.append(float(data["reward"]))
        self._done = bool(data.get("done"))

    def get_reward(self) -> float:
        if not self._rewards:
            return 0.0
        return self._rewards[-1] if self._reward_mode == "last" else sum(self._rewards)


def spec_param(spec: ToolSpec, name: str):
    return next(p for p in spec.params if p.name == name)


def docstring(spec: ToolSpec) -> str:
    """Google style, as transformers' get_json_schema parses it (TRL renders tools with that)."""
    lines = [spec.description]
    if spec.params:
        lines += ["", "Args:"] + [f"    {p.name}: {p.description}" for p in spec.params]
    return "\n".join(lines)


def tool_function(spec: ToolSpec):
    """A method named `spec.name` with a real signature, annotations and docstring."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)] + [
        inspect.Parameter(p.name, inspect.Parameter.KEYWORD_ONLY, annotation=p.hint,
                          default=inspect.Parameter.empty if p.required else None)
        for p in spec.params
    ]
    signature = inspect.Signature(params)

    def tool(self, *args: Any, **kwargs: Any) -> str:
        bound = signature.bind(self, *args, **kwargs)  # TypeError for a missing/unknown argument: TRL shows it
        bound.apply_defaults()
        return self._step(spec, {k: v for k, v in bound.arguments.items() if k != "self"})

    tool.__name__ = tool.__qualname__ = spec.name
    tool.__doc__ = docstring(spec)
    tool.__signature__ = signature  # type: ignore[attr-defined]
    tool.__annotations__ = {p.name: p.hint for p in spec.params}  # no return type: the server declares none
    return tool


def make_tool_class(env_name: str, interface: EnvInterface, reward_mode: RewardMode = "sum",
                    budget: int = 2000, answer: tuple[str, str] | None = None) -> type:
    """The tool class for one env: GenericTool plus one method per tool the server declares. `answer`: the (tool,
    argument) a plain-text final answer is submitted through (envs.generic.tasks.answer_tool)."""
    session_class = McpHttpSession if interface.transport == TRANSPORT else SessionClient  # the env's transport
    namespace: dict[str, Any] = {"_interface": interface, "_reward_mode": reward_mode, "_budget": budget,
                                 "_answer": answer,
                                 "_session_class": session_class,
                                 "__doc__": f"One {env_name} session per rollout; tools learned from the server.",
                                 "__module__": __name__}
    for spec in interface.tools:
        namespace[spec.name] = tool_function(spec)
    class_name = "".join(part.capitalize() for part in env_name.split("_")) + "Tool"
    return type(class_name, (GenericTool,), namespace)
