"""An env that publishes its own tasks: OpenEnv 0.10's Task API, learned from the running server.

OpenEnv 0.10's `HTTPEnvServer` serves, for an env class that defines `list_splits` / `num_tasks` / `get_task`
(`openenv.core.env_server.interfaces.TaskProvider`, structural), `GET /list_environments` (the one name the task
routes answer under: create_app's `env_name`, else the env class's name), `GET /{env}/splits` (each split as
`{"name", "type"}`, type train / validation / test), `POST /{env}/num_tasks` `{"split"}` -> `{"num_tasks"}` and
`POST /{env}/task` `{"split", "index"}` -> `{"task"}`; without those methods the task routes answer 501. A task is
played with `reset(split=..., index=...)` (tests/envs/test_task_api.py records these facts against the installed
openenv).

Such an env trains on its tasks rather than on generated instructions: one dataset row per task of its train split
(or ENV_<NAME>_SPLIT), each resetting with the task's split and index, so every member of a GRPO group plays the same
task. Held-out evaluation takes its test split (else validation). The task spec itself (`/task`) is never shown to the
model: it may hold the answer (an ORS task spec carries its `solution`); the prompt is what the env's reset gives.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from envs.core import probe
from envs.core.untrusted import one_line, strip_credentials

TRAIN_TYPES = ("train",)
EVAL_TYPES = ("test", "validation")  # held-out evaluation: the first split of the first of these types
MAX_SPLITS = 32
MAX_TASKS = 10_000_000  # a count above this is not believed (a row per task is built)
MAX_ROWS = 100_000  # dataset rows made of one split: a bigger split trains on its first this many tasks
DEADLINE_S = 10.0
MAX_BYTES = 256 << 10
# A tool that takes the episode's final answer and scores it (ORS's `answer`, `openenv import` verifiers' `submit`):
# one required string argument and one of these names. Its call ends the episode; a model that answers in plain text
# instead has that text submitted through it at episode end.
ANSWER_TOOL_NAMES = re.compile(r"(?i)^(submit|answer|final_answer|submit_answer)$")


class TaskApiError(RuntimeError):
    """The server announces the Task API but answers it wrongly: one line naming the route."""


@dataclass(frozen=True)
class Split:
    name: str
    type: str  # train, validation or test (OpenEnv normalises any other name to validation)
    size: int


@dataclass(frozen=True)
class TaskSet:
    env: str  # the name the server's task routes answer under
    splits: tuple[Split, ...]

    def split(self, name: str) -> Split | None:
        return next((s for s in self.splits if s.name == name), None)

    def train_split(self, chosen: str | None = None) -> Split:
        """`chosen` (ENV_<NAME>_SPLIT), else the first split of type train, else the first split."""
        if chosen:
            found = self.split(chosen)
            if found is None:
                raise TaskApiError(f"split {chosen!r} is not one the env serves ({self.line()})")
            return found
        return next((s for s in self.splits if s.type in TRAIN_TYPES), self.splits[0])

    def eval_split(self, train: str | None = None) -> Split | None:
        """The split held-out evaluation plays: the first test split, else validation, never the train one."""
        for kind in EVAL_TYPES:
            found = next((s for s in self.splits if s.type == kind and s.name != train and s.size), None)
            if found is not None:
                return found
        return None

    def line(self) -> str:
        return ", ".join(f"{s.name} ({s.type}) {s.size} tasks" for s in self.splits)


def task_row(split: str, index: int, instruction: str = "") -> dict:
    """One dataset row: the task's split and index go to the env's reset; the user message is the instruction (empty
    unless ENV_INSTRUCTION is set) to which the task's prompt, as the env's reset gives it, is appended."""
    return {"prompt": [{"role": "user", "content": instruction}], "reset_kwargs": {"split": split, "index": index}}


def task_rows(split: Split, instruction: str = "", first: int = 0, count: int | None = None) -> list[dict]:
    stop = min(split.size, MAX_ROWS) if count is None else min(split.size, first + count)
    return [task_row(split.name, i, instruction) for i in range(first, stop)]


def discover_tasks(base_url: str) -> TaskSet | None:
    """The env's splits and their sizes, or None when the server does not serve the Task API (no
    /list_environments, or task routes answering 501: an env class without list_splits). TaskApiError: it announces
    splits and then answers them wrongly. Bounded like every probe of an env server (envs.core.probe)."""
    base = base_url.rstrip("/")
    try:
        status, names = probe.get_json(f"{base}/list_environments", DEADLINE_S, MAX_BYTES)
        if status != 200 or not isinstance(names, list) or not names or not isinstance(names[0], str):
            return None
        env = names[0]
        status, splits = probe.get_json(f"{base}/{env}/splits", DEADLINE_S, MAX_BYTES)
        if status != 200 or not isinstance(splits, list) or not splits:
            return None  # 501: the env class has no list_splits
        found = []
        for item in splits[:MAX_SPLITS]:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
                raise TaskApiError(f"{strip_credentials(base)}/{env}/splits: an entry {one_line(item, 80)} has no name")
            name = one_line(item["name"], 100)
            kind = item.get("type") if item.get("type") in ("train", "validation", "test") else "validation"
            status, body = probe.get_json(f"{base}/{env}/num_tasks", DEADLINE_S, MAX_BYTES, payload={"split": name})
            size = body.get("num_tasks") if isinstance(body, dict) else None
            if status != 200 or type(size) is not int or not 0 <= size <= MAX_TASKS:
                raise TaskApiError(f"{strip_credentials(base)}/{env}/num_tasks for split {name!r} answered {status} "
                                   f"{one_line(body, 120)}: not a task count")
            found.append(Split(name, kind, size))
    except probe.ProbeError as exc:
        raise TaskApiError(f"Task API: {exc}") from None
    return TaskSet(env, tuple(found))


def answer_tool(tools) -> tuple[str, str] | None:
    """(tool, argument) of the env's answer tool among `tools` (interface.ToolSpec), or None: ANSWER_TOOL_NAMES, one
    required string argument."""
    for tool in tools:
        if ANSWER_TOOL_NAMES.match(tool.name) and len(tool.params) == 1 and tool.params[0].required \
                and tool.params[0].hint is str:
            return tool.name, tool.params[0].name
    return None
