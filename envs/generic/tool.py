"""A TRL `environment_factory` class for any OpenEnv server, built from its `EnvInterface`.

Same contract as the hand-written tool classes (`__init__(base_url)`, `reset(**row)`, tools,
`get_reward()`), so `trainer.rollouts.envs_binding.bind` spreads it over replicas and counts its calls.
  * reset: starts an episode (the row's `reset_kwargs` go to the server) and returns the reset
    observation as text, which TRL appends to the prompt;
  * each tool: one step on the server; MCP tools return the tool's result, typed actions the new
    observation as readable text (trimmed to a budget); an error the env reports is raised, so TRL
    shows it to the model and the run goes on;
  * reward: the episode's step rewards, summed (or the last one); after `done` a call says so.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Iterable, Iterator, Literal

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


def render_observation(observation: dict, budget: int) -> str:
    """An observation as `field: value` lines (grids as rows); `metadata` only when nothing else is there."""
    fields = {k: v for k, v in (observation or {}).items() if v not in (None, "", [], {}) and k != "metadata"}
    if not fields and isinstance((observation or {}).get("metadata"), dict):
        fields = {k: v for k, v in observation["metadata"].items() if v not in (None, "", [], {})}

    def lines() -> Iterator[str]:
        for i, (k, v) in enumerate(fields.items()):
            yield f"{chr(10) if i else ''}{k}: "
            yield from _pieces(v)

    return trim(_take(lines(), budget), budget)


def mcp_result_text(result: Any, budget: int) -> str:
    """A FastMCP CallToolResult (as JSON) -> its value (`data`, else structured content, else text blocks), trimmed."""
    if isinstance(result, dict):
        if result.get("data") is not None:
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

    def __init__(self, base_url: str) -> None:
        super().__init__(base_url)
        self._rewards: list[float] = []
        self._done = False

    def reset(self, reset_kwargs: dict | None = None, **row: Any) -> str | None:
        self._rewards, self._done = [], False
        data = self._client.reset(**(reset_kwargs or {}))
        text = render_observation(data.get("observation") or {}, self._budget)
        return f"\n\n{text}" if text else None

    def _step(self, spec: ToolSpec, arguments: dict) -> str:
        if self._done:
            raise RuntimeError(EPISODE_OVER)
        args = {k: v for k, v in arguments.items() if v is not None or spec_param(spec, k).required}
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
                    budget: int = 2000) -> type:
    """The tool class for one env: GenericTool plus one method per tool the server declares."""
    namespace: dict[str, Any] = {"_interface": interface, "_reward_mode": reward_mode, "_budget": budget,
                                 "__doc__": f"One {env_name} session per rollout; tools learned from the server.",
                                 "__module__": __name__}
    for spec in interface.tools:
        namespace[spec.name] = tool_function(spec)
    class_name = "".join(part.capitalize() for part in env_name.split("_")) + "Tool"
    return type(class_name, (GenericTool,), namespace)
