"""One timeout per call (#33 item 4): the env session's bound on a reply is TOOL_TIMEOUT_S for a step and
RESET_TIMEOUT_S for a reset, from RunConfig through the binding to the client, with no cap of the client's own.

The slow env is the hostile fixture's `slow_reply` variant (a real WebSocket server that answers late); the tool class
is the real EchoTool bound by trainer.rollouts.envs_binding. The client's old hidden cap was 120 s: here its default is lowered
to 0.5 s, so a call that outlives it without failing proves the configured bound is the only one.
"""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from envs.core import client as client_module
from envs.echo.tool import EchoTool
from tests.trainer.test_hostile_env import hostile, wait_all_closed
from contract.config import RunConfig
from trainer.rollouts.envs_binding import REPLY_GRACE_S, build_factories
from trainer.core.metrics import RolloutStats

GUARD_S = 60  # failure guard only: every bound below is at most 10 s


def bound_echo(url: str, **settings) -> object:
    cfg = RunConfig.load([], env_name="echo", env_urls=f"echo={url}", **settings)
    factory = build_factories(cfg, {"echo": SimpleNamespace(tool_class=EchoTool)}, RolloutStats())
    return factory()


def test_tool_and_reset_timeouts_reach_the_session_client():
    # a step's reply: TOOL_TIMEOUT_S plus the grace that leaves the rollout loop's bound the one that acts
    env = bound_echo("http://127.0.0.1:9", tool_timeout_s=300, reset_timeout_s=200)
    assert (env._client.message_timeout_s, env._client.reset_timeout_s) == (300 + REPLY_GRACE_S, 200)
    env = bound_echo("http://127.0.0.1:9")  # both empty: the defaults, bounded (no step waits for ever)
    assert (env._client.message_timeout_s, env._client.reset_timeout_s) == (120 + REPLY_GRACE_S, 120)


def test_a_call_longer_than_the_client_default_runs_to_its_configured_bound(monkeypatch):
    monkeypatch.setattr(client_module, "DEFAULT_REPLY_TIMEOUT_S", 0.5)  # stands in for the old hidden 120 s cap
    with hostile("slow_reply", HOSTILE_RESET_DELAY_S="1.5", HOSTILE_STEP_DELAY_S="1.5") as url:
        env = bound_echo(url, tool_timeout_s=10, reset_timeout_s=10)
        t0 = time.monotonic()
        env.reset(env_row='{"target": "hi"}')
        assert env.echo_message("hi") == "None"  # the fixture's step observation has no result: echo shows None
        assert time.monotonic() - t0 >= 3.0  # both replies came after the 0.5 s default and were waited for
        env._client.close()


@pytest.mark.parametrize("kind", ["step", "reset"])
def test_a_call_past_its_configured_bound_fails_and_its_session_closes(kind):
    delays = {"HOSTILE_RESET_DELAY_S": "30" if kind == "reset" else "0", "HOSTILE_STEP_DELAY_S": "30"}
    with hostile("slow_reply", **delays) as url:
        env = bound_echo(url, tool_timeout_s=0.5 if kind == "step" else 10,
                         reset_timeout_s=0.5 if kind == "reset" else 10)
        bound = 0.5 + REPLY_GRACE_S if kind == "step" else 0.5
        message = rf"No reply from ws://127\.0\.0\.1:\d+/ws within {bound:g} s"
        t0 = time.monotonic()
        if kind == "reset":  # a failed reset ends its episode, not the run (#33 item 5): the episode says why
            assert env.reset() is None
            assert re.search(rf"^reset failed: no reply: {message}", env._infra_failure), env._infra_failure
        else:
            env.reset()
            with pytest.raises(TimeoutError, match=message):
                env.echo_message("hi")
        assert time.monotonic() - t0 < GUARD_S
        assert not env._client.connected
        wait_all_closed(url)
