"""What the trainer accepts from an env image (#30): the helpers of envs.core.untrusted and the places that use them
with no server needed (credentials in messages and tracker configs, strict traces, the bad-reward log's rate limit,
bounded rendering). The cases that need a misbehaving server are in test_hostile_env.py."""

from __future__ import annotations

import json
import logging
import time
import tracemalloc

import pytest

from envs.core import probe
from envs.core.client import SessionClient
from envs.core.untrusted import (MAX_REPLY_CONTAINERS, MAX_REPLY_DEPTH, BadReward, UntrustedReply, check_reward, loads_reply, safe_text,
                                 strip_credentials)
from envs.generic.tool import render_observation
from tests.helpers import free_port
from trainer.rollouts import envs_binding
from trainer.rollouts import traces
from trainer.core.metrics import RolloutStats
from trainer.core.trackers import RunInfo


# ---------------------------------------------------------------------------------------------- text
def test_plain_text_is_unchanged_and_long_text_is_cut_as_before():
    assert safe_text("G Y X\nX G Y\ttab", 2000) == "G Y X\nX G Y\ttab"
    long = "a" * 5000
    assert safe_text(long, 2000) == long[:1987] + " …[trimmed]"  # the generic tool's old trim, to the character


def test_control_characters_are_escaped_and_bidi_overrides_shown():
    text = safe_text("ok\x1b]52;c;cm0=\x07\r\x1b[2Kreward +1\x9b31m\u202eevil\x7f")
    assert text == "ok\\x1b]52;c;cm0=\\x07\\x0d\\x1b[2Kreward +1\\x9b31m\\u202eevil\\x7f"


def test_a_huge_text_costs_what_is_shown():
    huge = "\x1b" * (16 << 20)
    tracemalloc.start()
    try:
        shown = safe_text(huge, 2000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(shown) <= 2000 and shown.endswith(" …[trimmed]")
    assert peak < 256 << 10, f"{peak:,} bytes to show 2,000 characters"  # escaping it whole: ~100 MiB


def test_rendering_a_huge_board_allocates_about_what_is_shown():
    """Before: the whole board was formatted, then trimmed (16 MiB cost ~590 MiB for 2,000 characters)."""
    board = [["."] * 1000 for _ in range(1000)]
    obs = {"board": board, "info": {"cells": list(range(100_000))}}
    tracemalloc.start()
    try:
        shown = render_observation(obs, 2000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(shown) <= 2000 and shown.startswith("board: \n. . .")
    assert peak < 256 << 10, f"{peak:,} bytes to render 2,000 characters"


def test_honest_observations_render_as_before():
    obs = {"board": [[0, 1], [1, 0]], "legal": [1, 2], "note": "your move", "empty": "", "metadata": {"x": 1}}
    # as before, but legal actions first (#45)
    assert render_observation(obs, 2000) == "legal: [1, 2]\nboard: \n0 1\n1 0\nnote: your move"


# ---------------------------------------------------------------------------------------------- URLs
@pytest.mark.parametrize("raw, shown", [
    ("http://trainer:s3cret@env-x:8000", "http://***@env-x:8000"),
    ("echo=wss://tok@envs.example/a,wordle=http://h:9000", "echo=wss://***@envs.example/a,wordle=http://h:9000"),
    ("Cannot reach ws://h:8000/ws?token=s3cret&x=1: refused", "Cannot reach ws://h:8000/ws?token=***&x=*** refused"),
    ("http://h:8000/?api_key=s3cret#f", "http://h:8000/?api_key=***#***"),
    ("http://vllm:8000", "http://vllm:8000"),
    # #44: every query and fragment value, and userinfo to its last `@` (before: these leaked)
    ("http://h/cb#access_token=s3cret&state=x", "http://h/cb#access_token=***&state=***"),
    ("ws://h/ws?sid=s3cret;jwt=s3cret&code=s3cret", "ws://h/ws?sid=***;jwt=***&code=***"),
    ("wss://user:p@ss@host/ws", "wss://***@host/ws"),
    ("ws://h/ws?s3cret", "ws://h/ws?***"),
    ("env-x:8000/ws?token=s3cret", "env-x:8000/ws?token=***"),  # no scheme: token-like keys still masked
    # #63: a password with an unencoded `/`, `#` or `?` (before: unchanged), two URLs in one word
    ("wss://u:s3cret/ss@h/ws", "wss://***@h/ws"), ("wss://u:s3cret#ss@h", "wss://***@h"),
    ("wss://u:s3cret?ss@h?token=s3cret", "wss://***@h?token=***"),
    ("a=wss://u:s3cret@h,b=http://v:s3cret/r@h2/x", "a=wss://***@h,b=http://***@h2/x"),
    ("see https://medium.com/@user", "see https://medium.com/@user"),  # no `user:`: an `@` in a path is no userinfo
])
def test_credentials_are_stripped_from_every_url(raw, shown):
    assert strip_credentials(raw) == shown
    assert "s3cret" not in shown and "ss@" not in shown


def test_a_long_password_is_masked_in_time_linear_in_it():
    """The userinfo now runs to the last `@` of a word: one pass over it, not one per `@`."""
    start = time.perf_counter()
    assert strip_credentials("wss://u:" + "p@" * 50_000 + "h/ws") == "wss://***@h/ws"
    assert time.perf_counter() - start < 1.0  # ~0.01 s


def test_client_and_probe_errors_never_quote_credentials():
    url = f"http://trainer:s3cret@127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ConnectionError) as caught:
        SessionClient(url, reconnect_wait_s=0, connect_timeout_s=5).reset()
    assert "s3cret" not in str(caught.value) and "***@127.0.0.1" in str(caught.value)
    with pytest.raises(probe.ProbeError) as caught:
        probe.get_json(f"{url}/health?token=s3cret", 5, 1024)
    assert "s3cret" not in str(caught.value)


def test_trackers_get_the_config_without_credentials(tmp_path):
    """W&B uploads its config and MLflow stores it as parameters: before, ENV_URLS went there whole."""
    run = RunInfo(str(tmp_path), "r", str(tmp_path), config={
        "env_urls": "echo=http://u:s3cret@env-echo:8000", "vllm_server_url": "http://vllm:8000/?token=s3cret",
        "learning_rate": 1e-5, "trackers": ["wandb"]})
    assert "s3cret" not in json.dumps(run.config)
    assert run.config["env_urls"] == "echo=http://***@env-echo:8000" and run.config["learning_rate"] == 1e-5


# ---------------------------------------------------------------------------------------------- JSON
def test_a_deep_reply_is_one_line_not_a_recursion_error():
    with pytest.raises(UntrustedReply, match=f"nested deeper than {MAX_REPLY_DEPTH} levels"):
        loads_reply("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UntrustedReply, match=f"nested deeper than {MAX_REPLY_DEPTH} levels"):
        loads_reply(b"[" * 65 + b"]" * 65)  # parses, but deeper than any observation
    assert loads_reply("[" * 64 + "]" * 64) is not None
    with pytest.raises(UntrustedReply, match="not JSON"):
        loads_reply("{nope")


def test_a_container_bomb_is_refused_before_parsing_and_brackets_in_strings_are_text():
    """#44: 1 MiB of `[]` (349,000 lists) was parsed, then walked in Python (~0.8 s on the loop every session shares)."""
    bomb = '{"type": "observation", "data": {"observation": {"x": [' + ",".join(["[]"] * 349_000) + "]}}}"
    with pytest.raises(UntrustedReply, match=f"349,004 lists and objects, more than the {MAX_REPLY_CONTAINERS:,}"):
        loads_reply(bomb)
    assert loads_reply('{"t": "' + "[" * 100_000 + '\\"[{"}') == {"t": "[" * 100_000 + '"[{'}
    at_cap = "[" + ",".join(["[]"] * (MAX_REPLY_CONTAINERS - 1)) + "]"
    assert len(loads_reply(at_cap)) == MAX_REPLY_CONTAINERS - 1
    with pytest.raises(UntrustedReply, match="nested deeper than 64"):
        loads_reply('[{"a": "]]]]", "b": ' + "[" * 64 + "]" * 64 + "}]")  # brackets in a string do not close


# ---------------------------------------------------------------------------------------------- rewards
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e19, -2e6, 10**400, True, "1", None])
def test_bad_rewards_are_refused(bad):
    with pytest.raises(BadReward):
        check_reward(bad)


@pytest.mark.parametrize("good", [0, 1, -1.5, 0.25, 1e6])
def test_rewards_in_range_pass(good):
    assert check_reward(good) == float(good)


class NanRewardToolDouble:
    """Test double: a tool class whose env scored every episode NaN (no server needed for the log's rate limit)."""

    def __init__(self, base_url: str) -> None:
        pass

    def reset(self, **row):
        return None

    def get_reward(self) -> float:
        return float("nan")


def test_bad_rewards_are_logged_one_line_each_then_rate_limited(caplog):
    env = envs_binding.bind("nan_rate_limit", NanRewardToolDouble, "http://127.0.0.1:9", RolloutStats())()
    env.reset()
    with caplog.at_level(logging.WARNING, logger="trainer.envs"):
        rewards = [env.get_reward() for _ in range(250)]
    assert set(rewards) == {envs_binding.FAILED_EPISODE_REWARD}
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.envs"]
    assert len(lines) == envs_binding.LOGGED_BAD_REWARDS + 2  # the first ones, then the 100th and the 200th
    assert all("\n" not in line and "reward nan is not finite" in line for line in lines)


def test_traces_are_strict_json(tmp_path):
    row = {"step": 1, "env": "x", "reset": {}, "prompt": [], "turns": [], "tool_calls": [], "env_reward": 0.0,
           "reward": 0.0, "rewards": {}, "step_rewards": [float("nan"), float("inf"), 1.0]}
    traces.append(tmp_path, [traces._jsonable(row)])
    line = (tmp_path / traces.ROLLOUTS_FILE).read_text()
    assert json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} written"))["step_rewards"] == [None, None, 1.0]
