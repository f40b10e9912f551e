"""Registry, task and tool-schema checks: no server, no Docker."""

from __future__ import annotations

import inspect
import random
import subprocess
import sys

import pytest
from transformers.utils import get_json_schema

from envs import registry
from trainer.rollouts.envs_binding import tool_method_names

TOOLS = {"echo": {"echo_message", "echo_with_length"}, "wordle": {"guess"}, "catch": {"move"}}


def test_registry_imports_no_heavy_dependency():
    code = (
        "import sys, envs.registry as r; r.get('wordle').make_dataset(2, 0); "
        "bad = [m for m in ('openenv', 'textarena', 'pyspiel', 'torch', 'transformers', 'nltk') if m in sys.modules]; "
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_unknown_name_names_the_choices():
    with pytest.raises(ValueError, match="catch, echo, wordle"):
        registry.get("chess")


@pytest.mark.parametrize("name", registry.NAMES)
def test_tool_class_schemas(name):
    cls = registry.get(name).tool_class
    tools = set(tool_method_names(cls))
    assert tools == TOOLS.get(name, tools) and tools  # a new env's folder needs no line here
    assert list(inspect.signature(cls.__init__).parameters) == ["self", "base_url"]
    for tool in tools:
        schema = get_json_schema(getattr(cls, tool))["function"]
        assert schema["name"] == tool
        assert schema["description"]
        for arg, spec in schema["parameters"]["properties"].items():
            assert spec.get("type") and spec["description"], (tool, arg, spec)


@pytest.mark.parametrize("name", registry.NAMES)
def test_dataset_rows(name):
    spec = registry.get(name)
    rows = spec.make_dataset(16, seed=3)
    assert len(rows) == 16 and rows == spec.make_dataset(16, seed=3)  # deterministic
    for row in rows:
        assert row["prompt"][-1]["role"] == "user" and row["prompt"][-1]["content"]
        tools = set(tool_method_names(spec.tool_class))
        calls = spec.demo_calls(row)
        assert calls and all(fn in tools and isinstance(kw, dict) for fn, kw in calls)
        fn, kw = spec.baseline_action(random.Random(0), "")
        assert fn in tools
    assert spec.episode_budget_tokens > 0


def test_echo_task_reward():
    from envs.echo import task

    assert task.reward("apple", []) == 0.0
    assert task.reward("apple", ["apple"]) == 1.0
    assert task.reward("apple", ["Apple."]) == 1.0
    assert task.reward("apple", ["river"]) == task.PARTIAL
    assert task.reward("apple", ["river", "apple"]) == task.PARTIAL  # only the first call counts
    words = {r["target"] for r in registry.get("echo").make_dataset(200, 0)}
    assert words == set(task.WORDS) and 4 <= len(words) <= 8


def test_catch_demo_reaches_ball_column():
    from envs.catch import task

    for seed in range(20):
        calls = task.demo_calls({"seed": seed})
        assert len(calls) == task.ROWS - 1
        dx = sum({"left": -1, "stay": 0, "right": 1}[kw["direction"]] for _, kw in calls)
        assert task.COLS // 2 + dx == task.ball_column(seed)


def test_catch_render():
    from envs.catch.task import render

    state = [0.0] * 50
    state[3] = 1.0  # ball row 0, col 3
    state[47] = 1.0  # paddle bottom row, col 2
    assert render(state).splitlines()[0] == "...o." and render(state).splitlines()[-1] == "..=.."


def test_wordle_secret_words_are_distinct_five_letter_words():
    from envs.wordle.words import SECRET_WORDS

    assert len(set(SECRET_WORDS)) == len(SECRET_WORDS) >= 50
    assert all(len(w) == 5 and w.isalpha() and w.islower() for w in SECRET_WORDS)


def _upstream_catch_observation(time_step) -> dict:
    """Upstream OpenEnv's OpenSpielEnvironment._make_observation for player 0, from an rl_environment TimeStep."""
    return {
        "info_state": list(time_step.observations["info_state"][0]),
        "legal_actions": list(time_step.observations["legal_actions"][0]),
        "game_phase": "terminal" if time_step.last() else "initial" if time_step.first() else "playing",
        "current_player_id": time_step.observations["current_player"],
        "done": time_step.last(),
        "reward": None if time_step.rewards is None else float(time_step.rewards[0]),
    }


def test_catch_matches_upstream_rl_environment_step_for_step():
    """Our Catch calls pyspiel directly; upstream goes through rl_environment. Same seeds, same actions:
    every observation must be identical (ball column, board, legal actions, rewards, phases)."""
    import random

    from open_spiel.python import rl_environment

    from envs.catch.models import OpenSpielAction
    from envs.catch.server import CatchEnvironment, _game

    ours = CatchEnvironment()
    upstream = rl_environment.Environment(_game())  # its own sampler: a new RandomState per seed
    rng = random.Random(0)
    fields = ["info_state", "legal_actions", "game_phase", "current_player_id", "done", "reward"]
    columns, rewards = set(), set()
    for episode in range(300):
        seed = rng.randrange(2**31)
        obs = ours.reset(seed=seed)
        upstream.seed(seed)
        ts = upstream.reset()
        assert obs.model_dump(include=set(fields)) == _upstream_catch_observation(ts), (episode, seed)
        columns.add(obs.info_state[:5].index(1.0))
        while not obs.done:
            action = rng.choice(obs.legal_actions)
            obs = ours.step(OpenSpielAction(action_id=action))
            ts = upstream.step([action])
            assert obs.model_dump(include=set(fields)) == _upstream_catch_observation(ts), (episode, seed, action)
        rewards.add(obs.reward)
    assert columns == set(range(5)) and rewards == {-1.0, 1.0}  # every start column; wins and losses
    assert ours.state.step_count == 9


def test_server_settings_are_typed_with_one_line_errors():
    from envs.core.settings import DEFAULT_MAX_CONCURRENT_ENVS, ServerSettings

    s = ServerSettings.load({"ENV_NAME": "Catch"})
    assert (s.env_name, s.ws_per_message_deflate, s.max_concurrent_envs) == ("catch", False, 256)
    assert DEFAULT_MAX_CONCURRENT_ENVS == 256  # what compose and the trainer's config default to as well
    assert ServerSettings.load({"ENV_NAME": "catch", "WS_PER_MESSAGE_DEFLATE": "true"}).ws_per_message_deflate
    assert ServerSettings.load({"ENV_NAME": "catch", "SESSION_TIMEOUT_S": "0"}).session_timeout_s is None
    with pytest.raises(SystemExit, match="WS_PER_MESSAGE_DEFLATE: Input should be a valid boolean.*got 'maybe'"):
        ServerSettings.load({"ENV_NAME": "catch", "WS_PER_MESSAGE_DEFLATE": "maybe"})
    with pytest.raises(SystemExit, match="MAX_CONCURRENT_ENVS: Input should be a valid integer.*got 'many'"):
        ServerSettings.load({"ENV_NAME": "catch", "MAX_CONCURRENT_ENVS": "many"})
    with pytest.raises(SystemExit, match="ENV_NAME: Field required; set it"):
        ServerSettings.load({})
    with pytest.raises(SystemExit, match="ENV_NAME: unknown environment 'chess'; choose one of catch, echo, wordle"):
        ServerSettings.load({"ENV_NAME": "chess"})


def test_step_delay_answers_each_step_later_on_the_event_loop_and_unchanged():
    """STEP_DELAY_S (`ENV_STEP_DELAY_S`, make bench-async's slow env): each step waits, the reply is the same, and the
    wait is an asyncio sleep (other sessions' steps are not held behind it: both ran inside one delay's span)."""
    import asyncio
    import time

    from envs.core.server import slowed
    from envs.core.settings import ServerSettings
    from envs.echo.models import CallToolAction
    from envs.echo.server import EchoEnvironment

    assert ServerSettings.load({"ENV_NAME": "echo"}).step_delay_s == 0
    assert slowed(EchoEnvironment, 0) is EchoEnvironment
    with pytest.raises(SystemExit, match="STEP_DELAY_S: Input should be greater than or equal to 0"):
        ServerSettings.load({"ENV_NAME": "echo", "STEP_DELAY_S": "-1"})
    delay = ServerSettings.load({"ENV_NAME": "echo", "STEP_DELAY_S": "0.3"}).step_delay_s
    action = CallToolAction(tool_name="echo_message", arguments={"message": "hello"})

    async def two_steps(env_cls) -> tuple[list, list[float]]:
        envs = [env_cls() for _ in range(2)]
        for env in envs:
            env.reset(target="hello")
        spans = []

        async def timed(env):
            t0 = time.monotonic()
            out = await env.step_async(action)
            spans.append((t0, time.monotonic()))
            return out

        return await asyncio.gather(*(timed(e) for e in envs)), spans

    plain, _ = asyncio.run(two_steps(EchoEnvironment))
    slow, spans = asyncio.run(two_steps(slowed(EchoEnvironment, delay)))
    assert [o.reward for o in slow] == [o.reward for o in plain] == [1.0, 1.0]
    assert all(end - start >= delay for start, end in spans)
    assert max(start for start, _ in spans) < min(end for _, end in spans)  # both waited at the same time
