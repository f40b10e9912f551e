"""trainer.rollouts.envs_binding: replicas, round-robin, TRL-identical tool schemas, episode accounting."""

from __future__ import annotations

import inspect
import json

import pytest
from transformers.utils import get_json_schema

from envs.core.replicas import ReplicaSet
from trainer.rollouts.envs_binding import (
    ENV_ROW_COLUMN,
    BindingError,
    bind,
    encode_row,
    resolve_replicas,
    tool_method_names,
)
from trainer.core.metrics import RolloutStats


class FakeTool:
    """A tool class with the contract's shape; records what it was given."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.reset_kwargs = None
        self.said = []

    def reset(self, **row):
        self.reset_kwargs = row
        self.said = []
        return None

    def say(self, word: str, times: int = 1) -> str:
        """
        Say a word.

        Args:
            word: The word to say.
            times: How many times.
        """
        if word == "boom":
            raise RuntimeError("episode is over")
        self.said.append(word)
        return word * times

    def get_reward(self) -> float:
        return float(len(self.said))

    def _private(self) -> None:
        pass


def test_resolve_replicas_ip_literal_and_localhost():
    assert resolve_replicas("http://10.1.2.3:8000/") == ["http://10.1.2.3:8000"]
    assert resolve_replicas("http://localhost:8123") == ["http://127.0.0.1:8123"]


def test_resolve_replicas_unknown_host():
    with pytest.raises(BindingError, match="cannot resolve 'env-nope.invalid'"):
        resolve_replicas("http://env-nope.invalid:8000")


def test_instances_get_the_service_url_and_share_its_replica_set():
    cls = bind("fake", FakeTool, "http://env-fake:8000", RolloutStats())
    assert [cls().base_url for _ in range(3)] == ["http://env-fake:8000"] * 3  # the session client picks replicas
    assert cls.replica_set is ReplicaSet.for_url("http://env-fake:8000")  # the one its session clients use


def test_tools_and_schemas_are_what_trl_would_see_unbound():
    cls = bind("fake", FakeTool, "http://x:1", RolloutStats())
    assert cls.__name__ == "FakeTool"  # TRL names the reward column after it
    # TRL's discovery: public functions of the class minus reset/get_reward
    trl_names = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                 if not n.startswith("_") and n not in ("reset", "get_reward")]
    assert trl_names == tool_method_names(FakeTool) == ["say"]
    inst = cls()
    assert get_json_schema(inst.say) == get_json_schema(FakeTool("u").say)


def test_episode_accounting_and_env_row_decoding():
    stats = RolloutStats()
    cls = bind("fake", FakeTool, "http://x:1", stats)
    inst = cls()
    row = encode_row({"prompt": [{"role": "user", "content": "hi"}], "target": "a", "level": 3})
    assert set(row) == {"prompt", ENV_ROW_COLUMN} and json.loads(row[ENV_ROW_COLUMN]) == {"target": "a", "level": 3}
    inst.reset(**row)
    assert inst.reset_kwargs == {"prompt": [{"role": "user", "content": "hi"}], "target": "a", "level": 3}
    assert inst.say("x", times=2) == "xx"
    with pytest.raises(RuntimeError, match="episode is over"):
        inst.say("boom")
    assert inst.get_reward() == 1.0
    timers, episodes = stats.drain()
    assert episodes == {"fake": [{"reward": 1.0, "tool_calls": 2, "tool_failures": 1}]}
    assert timers["env"] > 0
    # the next episode starts from zero
    inst.reset(**row)
    inst.get_reward()
    assert stats.drain()[1]["fake"][0]["tool_calls"] == 0


def test_bound_echo_tool_plays_a_real_episode(echo_server):
    from envs import registry

    spec = registry.get("echo")
    stats = RolloutStats()
    cls = bind("echo", spec.tool_class, echo_server.url, stats)
    a, b = cls(), cls()
    row = encode_row(spec.make_dataset(1, 0)[0])
    target = json.loads(row[ENV_ROW_COLUMN])["target"]
    a.reset(**row)
    assert a.echo_message(message=target) == target
    assert a.get_reward() == 1.0
    b.reset(**row)
    b.echo_message(message="wrong")
    with pytest.raises(RuntimeError):
        b.echo_message(message=target)  # one call per task: the env refuses the second
    assert b.get_reward() < 1.0
    episodes = stats.drain()[1]["echo"]
    assert [e["tool_calls"] for e in episodes] == [1, 2]
    assert [e["tool_failures"] for e in episodes] == [0, 1]
