"""An env image is code nobody here wrote (#20): a server that misbehaves in one way per variant
(tests/fixtures/envs/hostile) meets the real preflight, discovery and session client. Each variant ends with at most
one line naming the env and what went wrong, nothing crashes, and no session is left open on the server.

"Bounded" is checked against the probes' own deadlines (envs.core.probe) with a wide margin: before these bounds a
trickling /schema held preflight for hours and a server ignoring close frames cost 10 s per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from envs.core import probe
from envs.core.client import SessionClient
from envs.core.replicas import ReplicaSet
from envs.generic import GenericSpec, interface
from tests.helpers import FIXTURE_ENVS, free_port
from trainer.rollouts import envs_binding
from trainer.run import preflight
from trainer.rollouts import traces
from contract.config import RunConfig
from trainer.core.metrics import RolloutStats
from trainer.run.preflight import PreflightReport

GUARD_S = 120  # failure guard for "ends in bounded time": the slowest deadline below is 15 s


@contextlib.contextmanager
def hostile(variant: str, **env: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FIXTURE_ENVS / "hostile" / "server.py"), str(port)],
                            env=dict(os.environ, HOSTILE=variant, **env), stderr=subprocess.PIPE)
    try:
        while True:  # until it listens (or died)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, proc.stderr.read().decode()
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


def open_sessions(url: str) -> int:
    return requests.get(f"{url}/fixture/stats", timeout=10).json()["open_ws"]


def wait_all_closed(url: str) -> None:
    """The server saw every session's TCP connection end (an event it reports, polled)."""
    deadline = time.monotonic() + GUARD_S
    while open_sessions(url):
        assert time.monotonic() < deadline, f"{open_sessions(url)} session(s) still open on the server"
        time.sleep(0.1)


def preflight_of(url: str, batch: int = 8) -> tuple[list[str], PreflightReport, float]:
    cfg = RunConfig.load([], env_name="hostile", env_urls=f"hostile={url}", per_device_train_batch_size=batch,
                         num_generations=4)
    report = PreflightReport()
    t0 = time.monotonic()
    errors = preflight.check_env_servers(cfg, report, wait_s=0)
    return errors, report, time.monotonic() - t0


FAILS_WITH = {
    "cyclic_ref": "$ref cycle Node -> Node",
    "slow_schema": f"/schema: no complete answer within {probe.SCHEMA_DEADLINE_S:g} s",
    "slow_health": f"not healthy: http://127.0.0.1:PORT (no complete answer within {probe.HEALTH_DEADLINE_S:g} s)",
    "huge_schema": "/schema: answer of 67,108,864 bytes, more than the 4,194,304 read",
    "silent_ws": "counting sessions stopped after 3 s at 0 accepted",
    "reserved_names": "action Reset field 'from': not usable as a Python name",
    "bad_tool_names": r"tool 'look\n\x1b[31mred': not usable as a Python name",
    "many_fields": "action WideAction: 10,000 fields, more than the 64 a tool can take",
    "nested_reply": "/schema answered 200 without an action schema",  # was a RecursionError traceback
    "nested_tools": "listing its MCP tools failed: ws://127.0.0.1:PORT/ws: a reply nested deeper than 64 levels",
    "homoglyph_tools": r"tool 'r\u0435set': not usable as a Python name (an ASCII identifier",  # passed before #44
}


@pytest.mark.parametrize("variant", sorted(FAILS_WITH))
def test_a_hostile_server_fails_preflight_in_bounded_time_with_one_line(variant, monkeypatch):
    monkeypatch.setattr(probe, "CAPACITY_DEADLINE_S", 3.0)  # silent_ws: a short count, the same code path
    monkeypatch.setattr(probe, "CAPACITY_DEADLINE_PER_SESSION_S", 0.0)
    with hostile(variant) as url:
        errors, _, took = preflight_of(url)
        assert len(errors) == 1, errors
        line = errors[0]
        assert line.startswith("env hostile"), line
        assert FAILS_WITH[variant].replace("PORT", url.rsplit(":", 1)[1]) in line, line
        assert "\n" not in line and "\x1b" not in line  # a name with a newline or an escape code is shown escaped
        assert took < GUARD_S
        wait_all_closed(url)


def test_sessions_that_ignore_close_frames_are_counted_and_all_dropped_in_about_a_second():
    with hostile("ignore_close") as url:
        errors, report, took = preflight_of(url, batch=32)
        assert errors == [] and report.capacity["hostile"] == report.sessions["hostile"] == 32, (errors, report)
        assert "probed: the server does not report it" in report.ok[0]
        assert took < GUARD_S  # was 10 s per session, one after another: 320 s
        wait_all_closed(url)  # the client dropped the TCP connections itself: no slot held on the server


def test_huge_descriptions_are_learned_cut_to_size():
    with hostile("huge_descriptions") as url:
        errors, report, _ = preflight_of(url)
        assert errors == []
        tool = report.specs["hostile"].interface.tools[0]
        assert len(tool.description) <= interface.MAX_DESCRIPTION_CHARS + 100
        assert all(len(p.description) <= interface.MAX_DESCRIPTION_CHARS for p in tool.params)


def test_the_control_variant_passes():
    with hostile("none") as url:
        errors, report, _ = preflight_of(url)
        assert errors == [] and report.specs["hostile"].interface.tools[0].name == "move_action"


# ---------------------------------------------------------------------------------------- session client
def test_a_reset_past_its_deadline_is_cancelled_and_its_late_session_closed(monkeypatch):
    """The reset's coroutine is still going when the caller's deadline passes (here: connected, then stuck); it is
    cancelled and its session closed, instead of answering later and holding a server slot nobody uses."""
    with hostile("silent_ws") as url:
        client = SessionClient(url, connect_timeout_s=0.5, message_timeout_s=0.5, ping_interval_s=None)
        connected = threading.Event()

        async def connects_then_sticks(data: dict) -> dict:
            await client._connect()
            connected.set()
            await asyncio.sleep(3600)
            return {}

        monkeypatch.setattr(client, "_reset", connects_then_sticks)
        with pytest.raises(TimeoutError, match="the session was closed"):
            client.reset()
        assert connected.is_set()
        wait_all_closed(url)
        assert not client.connected


def test_probes_never_go_through_a_proxy_like_the_session_client(monkeypatch):
    for var in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")  # nothing listens there: a proxied probe fails
    for var in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)
    with hostile("none") as url:
        assert preflight.probe_server(url)[:2] == (True, "healthy")
        assert interface.get_schema(url)["action"]["title"] == "MoveAction"


def test_a_slow_resolver_does_not_queue_the_other_rollouts():
    """One thread re-resolves the env's name (slow DNS); another choosing a replica meanwhile uses the last answer."""
    resolving, release = threading.Event(), threading.Event()
    calls = []

    def slow_dns(url: str) -> list[str]:
        calls.append(url)
        if len(calls) > 1:
            resolving.set()
            assert release.wait(GUARD_S)
        return ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]

    replicas = ReplicaSet("http://env-x:8000", resolver=slow_dns, namer=lambda u: u, refresh_s=3600)
    replicas.acquire()  # the first answer
    replicas.lost()  # a session dropped: the next choice resolves again
    slow = threading.Thread(target=replicas.acquire)
    slow.start()
    assert resolving.wait(GUARD_S)
    other: list[str] = []
    quick = threading.Thread(target=lambda: other.append(replicas.acquire()))
    quick.start()
    quick.join(GUARD_S)
    done_while_resolving = not quick.is_alive() and not release.is_set()
    release.set()
    slow.join(GUARD_S)
    assert done_while_resolving, "a replica choice waited for another thread's DNS lookup"
    assert other and other[0] in ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert len(calls) == 2  # one lookup, not one per waiting thread


# ---------------------------------------------------------------------------------------- what a session returns (#30)
TERMINAL_CONTROLS = ("\x1b", "\x07", "\r", "\x9b")


def bound_env(url: str, text_chars: int = 2000):
    """The real path of a training rollout: the tool class learned from the server, bound as TRL's factory."""
    spec = GenericSpec.discover("hostile", url)
    return envs_binding.bind("hostile", spec.tool_class, url, RolloutStats(), text_chars)()


def trace_rows(env) -> list[dict]:
    return traces.rows(1, [[{"role": "user", "content": "play"}]], [[{"role": "assistant", "content": "done"}]],
                         [env], [{"env": env.get_reward()}], [env.get_reward()])


def test_a_redirect_is_refused_and_its_target_never_contacted():
    """Before: the client and the session count followed `302 Location:` to any host (an env could bounce the trainer
    onto vLLM's network)."""
    with hostile("none") as target, \
            hostile("redirect", HOSTILE_REDIRECT_TO=target.replace("http://", "ws://") + "/ws") as url:
        client = SessionClient(url, ping_interval_s=None)  # a refused redirect is not retried like a server down
        with pytest.raises(ValueError, match="redirecting to ws://127.0.0.1:.*never follow redirects") as caught:
            client.reset()
        assert "\n" not in str(caught.value)
        accepted, problem = probe.count_sessions(url, 2)
        assert accepted == 0 and "never follow redirects" in problem, problem
        assert requests.get(f"{target}/fixture/stats", timeout=10).json()["opened_ws"] == 0


@pytest.mark.parametrize("variant, says", [("huge_frame", "a reply over the 1,048,576-byte limit"),
                                           ("nested_reply", "a reply nested deeper than 64 levels")])
def test_an_oversized_or_deeply_nested_reply_is_one_line_and_ends_the_session(variant, says):
    """Before: a 2 MiB frame was taken (frames up to 16 MiB were), and a deep one raised RecursionError."""
    with hostile(variant) as url:
        client = SessionClient(url.replace("http://", "http://trainer:s3cret@"), reconnect_wait_s=0,
                               ping_interval_s=None)
        with pytest.raises(ValueError) as caught:
            client.reset()
        message = str(caught.value)
        assert says in message and "\n" not in message and "s3cret" not in message, message
        assert not client.connected
        wait_all_closed(url)


def test_terminal_escapes_from_an_env_reach_neither_the_model_nor_a_terminal(tmp_path, capsys):
    """Observations, an error frame and the `make rollouts` printer: OSC 52, CSI, BEL and CR arrive escaped."""
    with hostile("escapes") as url:
        env = bound_env(url)
        seen = [env.reset()]
        with pytest.raises(Exception) as caught:
            env.move_action(column=0)  # the fixture answers an error frame with escapes
        seen += [str(caught.value), env.move_action(column=1)]
        rows = trace_rows(env)
    seen.append(traces.render(rows[0]))
    for text in seen:
        assert not any(c in text for c in TERMINAL_CONTROLS), repr(text)
    assert "\\x1b]52;c;" in seen[0] and "moved" in seen[0]  # shown, as text
    # The printer also escapes a trace it did not write (a file from elsewhere, or edited).
    run = tmp_path / "run-1"
    run.mkdir()
    rows[0]["tool_calls"][0]["result"] = "\x1b]52;c;cm0gLXJmIH4K\x07\rreward +1.000"
    traces.append(run, rows)
    assert traces.main(["--outputs", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "reward +1.000" in printed and not any(c in printed for c in TERMINAL_CONTROLS)


@pytest.mark.parametrize("variant", ["nan_reward", "huge_reward"])
def test_a_non_finite_or_huge_reward_fails_the_episode_with_one_log_line(variant, tmp_path, caplog):
    """Before: JSON NaN went into GRPO as a reward (and 1e19 zeroed its group's advantages)."""
    with hostile(variant) as url:
        env = bound_env(url)
        env.reset()
        env.move_action(column=1)
        with caplog.at_level("WARNING", logger="trainer.envs"):
            assert env.get_reward() == envs_binding.FAILED_EPISODE_REWARD
        lines = [r.getMessage() for r in caplog.records if r.name == "trainer.envs"]
        assert len(lines) == 1 and lines[0].startswith("env hostile: reward") and "failed" in lines[0], lines
        traces.append(tmp_path, trace_rows(env))
    for line in (tmp_path / traces.ROLLOUTS_FILE).read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the trace: not strict JSON"))


def test_errors_and_big_observations_reach_the_model_trimmed():
    """Before: an env's error text reached the model whole (900,000 characters here)."""
    with hostile("long_error") as url:
        env = bound_env(url, text_chars=500)
        env.reset()
        with pytest.raises(Exception) as caught:
            env.move_action(column=1)
        assert len(str(caught.value)) <= 500 + envs_binding.TEXT_ALLOWANCE
        assert str(caught.value).endswith(" …[trimmed]")
    with hostile("big_board") as url:
        env = bound_env(url, text_chars=500)
        env.reset()
        shown = env.move_action(column=1)  # a 900 KB board, under the frame cap
        assert len(shown) <= 500 + envs_binding.TEXT_ALLOWANCE and "…[trimmed]" in shown


def test_the_built_in_tool_classes_return_an_images_text_trimmed():
    """`.env.example` invites other images for echo and Wordle (ENV_<NAME>_IMAGE): their text was returned whole."""
    from envs.echo.tool import EchoTool
    from envs.wordle.tool import WordleTool

    with hostile("long_text") as url:
        echo = envs_binding.bind("echo", EchoTool, url, RolloutStats(), 500)()
        echo.reset(target="hi")
        wordle = envs_binding.bind("wordle", WordleTool, url, RolloutStats(), 500)()
        wordle.reset(seed=1)
        for shown in (echo.echo_message(message="hi"), wordle.guess(word="crane")):
            assert len(shown) <= 500 + envs_binding.TEXT_ALLOWANCE and shown.endswith("…[trimmed]"), len(shown)
