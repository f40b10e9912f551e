"""Any OpenEnv environment, with no code: its interface is learned from the running server.

    spec = GenericSpec.discover("connect4", "http://env-connect4:8000")
    spec.tool_class           # TRL environment_factory class: one tool per MCP tool, or one for the action
    spec.make_dataset(64, 0)  # instruction rows (or ENV_PROMPTS_FILE's rows; an env serving the Task API: its tasks)
    spec.tasks                # the env's splits (envs.generic.tasks.TaskSet), None without the Task API

`GenericSpec` has the same surface as `envs.registry.EnvSpec`, so the trainer, the tiny model's
warm-start and `make baseline` treat built-in and discovered envs alike.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from envs.core.http_mcp import TRANSPORT
from envs.generic.interface import EnvInterface, InterfaceError, UnsupportedSchema, discover
from envs.generic.task import DEFAULT_INSTRUCTION, demo_calls, make_dataset
from envs.generic.tasks import TaskSet, answer_tool, discover_tasks, task_rows
from envs.generic.tool import RewardMode, make_tool_class

__all__ = ["GenericSpec", "InterfaceError", "UnsupportedSchema", "DEFAULT_INSTRUCTION"]


@dataclass(frozen=True)
class GenericSpec:
    name: str
    interface: EnvInterface
    instruction: str = DEFAULT_INSTRUCTION
    prompts_file: str | None = None
    reward: RewardMode = "sum"
    observation_chars: int = 2000
    episode_budget_tokens: int = 256  # unknown env: a few short turns
    tasks: TaskSet | None = None  # the env's own tasks (OpenEnv's Task API), None without it
    split: str | None = None  # ENV_<NAME>_SPLIT: the split to train on (default: its train split)

    @classmethod
    def discover(cls, name: str, url: str, **options) -> "GenericSpec":
        """Raises InterfaceError / UnsupportedSchema / TaskApiError with one line naming the problem. The Task API is
        asked over /ws servers only (an MCP session over HTTP takes no reset arguments, so no split and index)."""
        interface = discover(url)
        tasks = discover_tasks(url) if interface.transport != TRANSPORT and not options.get("prompts_file") else None
        spec = cls(name, interface, **options, tasks=tasks)
        if tasks is not None:
            tasks.train_split(spec.split)  # an ENV_<NAME>_SPLIT the env does not serve: TaskApiError now
        return spec

    @property
    def answer(self) -> tuple[str, str] | None:
        """The (tool, argument) a plain-text final answer is submitted through: task envs with an answer tool."""
        return answer_tool(self.interface.tools) if self.tasks is not None else None

    @functools.cached_property
    def tool_class(self) -> type:
        return make_tool_class(self.name, self.interface, self.reward, self.observation_chars, self.answer)

    def _task_instruction(self) -> str:
        return "" if self.instruction == DEFAULT_INSTRUCTION else self.instruction  # ENV_INSTRUCTION, when set

    def make_dataset(self, n: int, seed: int) -> list[dict]:
        """Task API envs: one row per task of the train split (DATASET_SIZE does not apply), else instruction rows (or
        ENV_PROMPTS_FILE's)."""
        if self.tasks is not None:
            return task_rows(self.tasks.train_split(self.split), self._task_instruction())
        return make_dataset(n, seed, self.name, self.instruction, self.prompts_file)

    def held_out_rows(self, count: int) -> tuple[str, list[dict]] | None:
        """(split, its first `count` tasks as rows) of the split held-out evaluation plays (test, else validation),
        or None: no Task API, or no split beside the trained one."""
        if self.tasks is None:
            return None
        split = self.tasks.eval_split(self.tasks.train_split(self.split).name)
        return None if split is None else (split.name, task_rows(split, self._task_instruction(), count=count))

    def demo_calls(self, row: dict, observation: str | None = None) -> list[tuple[str, dict]]:
        """Synthetic, well-formed calls of the declared tools (for the tiny model's warm-start); with the reset's
        `observation` text, among the legal actions it lists."""
        rng = random.Random(repr(sorted(row.get("reset_kwargs", {}).items())))
        return demo_calls(self.interface, rng, observation)

    def another_call(self, row: dict, attempt: int, observation: str | None = None) -> tuple[str, dict]:
        """One more draw of a demo call, for one the env refused (the warm-start keeps only calls the env accepts:
        a schema that leaves a shape open, e.g. an array's length, is learned from the env's replies). The first two
        are minimal (arrays of their fewest items, with every optional argument, then with only those the schema
        gives a value), later ones random again."""
        rng = random.Random(repr((sorted(row.get("reset_kwargs", {}).items()), attempt)))
        return demo_calls(self.interface, rng, observation, minimal={1: "all", 2: "required"}.get(attempt))[0]

    def baseline_action(self, rng: random.Random, observation_text: str) -> tuple[str, dict]:
        """A call the schema allows, choosing among the observation's legal actions where it lists them."""
        return demo_calls(self.interface, rng, observation_text)[0]
