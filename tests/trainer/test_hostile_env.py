"""An env image is code nobody here wrote (#20): a server that misbehaves in one way per variant
(tests/fixtures/envs/hostile) meets the real preflight, discovery and session client. Each variant ends with at most
one line naming the env and what went wrong, nothing crashes, and no session is left open on the server.

"Bounded" is checked against the probes' own deadlines (envs.core.probe) with a wide margin: before these bounds a
trickling /schema held preflight for hours and a server ignoring close frames cost 10 s per session.
"""

from __future__ import annotations

import asyncio
import contextlib
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
from envs.generic import interface
from tests.helpers import FIXTURE_ENVS, free_port
from trainer import preflight
from trainer.config import RunConfig
from trainer.preflight import PreflightReport

GUARD_S = 120  # failure guard for "ends in bounded time": the slowest deadline below is 15 s


@contextlib.contextmanager
def hostile(variant: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FIXTURE_ENVS / "hostile" / "server.py"), str(port)],
                            env=dict(os.environ, HOSTILE=variant), stderr=subprocess.PIPE)
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
