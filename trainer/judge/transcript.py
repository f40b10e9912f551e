"""An episode as the judge reads it: the task and the transcript (turns, tool calls and results, final answer) as
text, every piece of it data, not instructions.

The env's text (observations, tool results, a reset's text appended to the task) may come from an image nobody here
wrote, and the policy's own turns may echo it. It reaches the judge as it reaches the policy (envs.core.untrusted:
control and format characters escaped, chat-template tokens neutralised, each piece capped), and the block markers
the rubric uses (`<transcript>`, `<episode ...>`, `<task>`) are made unmatchable inside it (their `<` becomes `‹`), so
no text can close the data block and speak as the rubric. Text that tries (a marker, "ignore the rubric") is flagged
in the episode's trace (`judge.flagged`); its score still comes from the constrained reply alone."""

from __future__ import annotations

import json
import re
from typing import Any

from envs.core.untrusted import safe_text

TASK_CHARS = 4000
TURN_CHARS = 4000  # one assistant turn
RESULT_CHARS = 2000  # one tool result (the policy saw it whole; the judge needs its gist)
TRANSCRIPT_CHARS = 24_000  # the whole transcript; beyond it the middle is left out (start and end say most)
_MARKERS = re.compile(r"<(\s*/?\s*(?:transcript|episode|task|rubric)\b)", re.IGNORECASE)
_INJECTION = re.compile(r"ignore\b.{0,40}\b(?:rubric|instruction|prompt|above|previous)|\bsystem prompt\b"
                        r"|[‹<]\s*/?\s*(?:transcript|episode|task|rubric)\b", re.IGNORECASE | re.DOTALL)


def data(text: Any, limit: int) -> str:
    """Untrusted text bounded and neutralised, its block markers made unmatchable."""
    return _MARKERS.sub(lambda m: "\u2039" + m.group(1), safe_text("" if text is None else text, limit))


def flagged(text: str) -> bool:
    """Whether rendered text tries to speak to the judge (a block marker, "ignore the rubric ...")."""
    return bool(_INJECTION.search(text))


def task_of(prompt: Any) -> str:
    """The task: the prompt's last user message (a reset's text appended to it included)."""
    if isinstance(prompt, str):
        return data(prompt, TASK_CHARS)
    users = [m for m in prompt or [] if isinstance(m, dict) and m.get("role") == "user"]
    return data(_content(users[-1].get("content")) if users else "", TASK_CHARS)


def render(completion: Any) -> str:
    """The episode's completion messages (TRL's: assistant turns with tool_calls, tool results) as labelled lines."""
    if not isinstance(completion, list):
        return _bounded(f"[assistant]\n{data(completion, TURN_CHARS)}")
    parts = []
    for message in completion:
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        content = _content(message.get("content"))
        if role == "tool":
            name = data(message.get("name") or "", 64)
            parts.append(f"[tool result{': ' + name if name else ''}]\n{data(content, RESULT_CHARS)}")
            continue
        if content.strip():
            parts.append(f"[{'assistant' if role == 'assistant' else data(role, 32)}]\n{data(content, TURN_CHARS)}")
        for call in message.get("tool_calls") or []:
            fn = call.get("function", call) if isinstance(call, dict) else {}
            arguments = fn.get("arguments")
            arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, default=str)
            parts.append(f"[assistant calls] {data(fn.get('name'), 64)}({data(arguments, RESULT_CHARS)})")
    return _bounded("\n".join(parts) if parts else "[no turns]")


def _content(content: Any) -> str:
    if isinstance(content, list):  # multimodal parts: their text
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _bounded(text: str) -> str:
    if len(text) <= TRANSCRIPT_CHARS:
        return text
    half = TRANSCRIPT_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"
