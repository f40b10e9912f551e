"""Any OpenEnv environment, with no code: its interface is learned from the running server.

    spec = GenericSpec.discover("connect4", "http://env-connect4:8000")
    spec.tool_class           # TRL environment_factory class: one tool per MCP tool, or one for the action
    spec.make_dataset(64, 0)  # instruction rows (or ENV_PROMPTS_FILE's rows)

`GenericSpec` has the same surface as `envs.registry.EnvSpec`, so the trainer, the tiny model's
warm-start and `make baseline` treat built-in and discovered envs alike.
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass

from envs.generic.interface import EnvInterface, InterfaceError, UnsupportedSchema, discover
from envs.generic.task import DEFAULT_INSTRUCTION, demo_calls, make_dataset
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

    @classmethod
    def discover(cls, name: str, url: str, **options) -> "GenericSpec":
        """Raises InterfaceError / UnsupportedSchema with one line naming the problem."""
        return cls(name, discover(url), **options)

    @functools.cached_property
    def tool_class(self) -> type:
        return make_tool_class(self.name, self.interface, self.reward, self.observation_chars)

    def make_dataset(self, n: int, seed: int) -> list[dict]:
        return make_dataset(n, seed, self.name, self.instruction, self.prompts_file)

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
