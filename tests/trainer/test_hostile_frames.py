"""Bytes that are no reply, against the rest of the trainer process (#63): a reply that is costly to check, control
frames that flood a session, a server that stops reading, a body trickled a byte at a time. A benign env's steps stay
under BENIGN_STEP_BOUND_S, memory grows at most MEMORY_PER_SESSION per hostile session, no connection is left open.
Servers: the hostile fixture (tests/fixtures/envs/hostile) on 127.0.0.1, a hostile and a benign one at once."""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import pytest

from envs.core import ws_bounds
from envs.core.client import SessionClient
from envs.core.http_mcp import McpHttpSession
from envs.core.untrusted import UntrustedReply, check_shape, strip_credentials
from tests.trainer.test_hostile_env import GUARD_S, hostile, open_sessions, wait_all_closed
from tests.trainer.test_hostile_sessions import BENIGN_STEP_BOUND_S, HOSTILE_SESSIONS, benign_steps_beside, rss_bytes

MEMORY_PER_SESSION = 2 << 20
# A check of 4 MiB takes ~0.05 s here. Generous for a busy 2-core machine; the backtracking scan took 12 s for 64 KB.
CHECK_BOUND_S = 3.0


def escaped_quotes(size: int) -> bytes:
    """The reply that froze the trainer: 65 `[`, a `"`, then escaped quotes (`\\"`) to `size` bytes."""
    return b"[" * 65 + b'"' + b'\\"' * ((size - 66) // 2)


def timed(check, text) -> float:
    t0 = time.perf_counter()
    with contextlib.suppress(UntrustedReply):
        check(text)
    return time.perf_counter() - t0


def test_checking_a_reply_full_of_escaped_quotes_takes_linear_time():
    """The 64 KB reply (12 s before), 1 MiB and 4 MiB: each checked within CHECK_BOUND_S, and 4 MiB within 16 times
    1 MiB's time (4 when linear, 16 when quadratic; the best of three, a busy machine's noise at 1 MiB floored)."""
    for size in (64 << 10, 1 << 20, 4 << 20):
        took = timed(check_shape, escaped_quotes(size))
        assert took < CHECK_BOUND_S, f"{size:,} bytes took {took:.2f} s to check"
    small, big = (min(timed(check_shape, escaped_quotes(size)) for _ in range(3)) for size in (1 << 20, 4 << 20))
    assert big < 16 * max(small, 0.005), f"1 MiB: {small:.4f} s, 4 MiB: {big:.4f} s"
    with pytest.raises(UntrustedReply, match="nested deeper than 64"):
        check_shape(escaped_quotes(1 << 20))  # the quotes are text: the 65 brackets are structure


@pytest.mark.parametrize("text", [
    pytest.param(lambda n: "a://" * (n // 4), id="schemes"),
    pytest.param(lambda n: "a." * (n // 2), id="scheme-chars"),
    pytest.param(lambda n: "?" + "token" * (n // 5), id="secret-keys"),
    pytest.param(lambda n: "<|" * (n // 2), id="template-tokens"),
])
def test_masking_credentials_in_env_text_takes_linear_time(text):
    """Every regex applied to an env's text (strip_credentials: URLs, keys; the template tokens): 64 KiB within
    CHECK_BOUND_S (before: 32 KB of `a://` took 4 s, quadratic) and 256 KiB within 16 times 64 KiB's time."""
    small, big = (min(timed(strip_credentials, text(size)) for _ in range(3)) for size in (64 << 10, 256 << 10))
    assert small < CHECK_BOUND_S and big < 16 * max(small, 0.005), f"64 KiB: {small:.4f} s, 256 KiB: {big:.4f} s"


@contextlib.contextmanager
def heartbeat():
    """A thread ticking every 10 ms; yields the list its longest gap is left in (what any other session would wait)."""
    longest, stop = [0.0], threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not stop.wait(0.01):
            now = time.monotonic()
            longest[0] = max(longest[0], now - last)
            last = now

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield longest
    finally:
        stop.set()
        thread.join(GUARD_S)


def test_a_reply_full_of_escaped_quotes_stalls_no_other_thread():
    """Through the real session client, the 1 MiB reply is refused with one line and a heartbeat thread never waits
    over BENIGN_STEP_BOUND_S (before: the process froze 12.5 s at 64 KB, 30.8 s at 100 KB, ~an hour at 1 MiB)."""
    with hostile("escaped_quotes") as url:
        client = SessionClient(url, ping_interval_s=None, message_timeout_s=GUARD_S)
        client.reset()
        with heartbeat() as longest, pytest.raises(UntrustedReply, match="nested deeper than 64 levels"):
            client.step({"column": 1})
        client.close()
    assert longest[0] < BENIGN_STEP_BOUND_S, f"a thread waited {longest[0]:.2f} s while the reply was checked"


def ws_session(url: str) -> SessionClient:
    return SessionClient(url, ping_interval_s=None, message_timeout_s=10, reconnect_wait_s=0, capacity_wait_s=0)


@pytest.mark.parametrize("variant", ["pong_stream", "ping_flood", "trickled_body"])
def test_a_hostile_envs_frames_do_not_hold_a_benign_envs_steps(variant):
    """16 sessions of an env streaming empty pongs, flooding pings while reading nothing, or trickling a 300 KB body
    one byte a write: a benign env's steps stay under BENIGN_STEP_BOUND_S and the process's RSS grows less than
    MEMORY_PER_SESSION per hostile session. Before: a pong stream held a benign step 35 s (16 sessions), a ping flood
    grew the trainer 1,672 MiB in 100 s, a trickled body took 3.9 s of loop time per reply."""
    make = (lambda url: McpHttpSession(url, message_timeout_s=10, reconnect_wait_s=0, capacity_wait_s=0)) \
        if variant == "trickled_body" else ws_session
    with hostile(variant) as url:
        took, grown = benign_steps_beside(url, make)
        if variant != "trickled_body":
            wait_all_closed(url)
    assert max(took) <= BENIGN_STEP_BOUND_S, f"benign steps took {[round(t, 3) for t in took]} s beside {variant}"
    assert grown <= HOSTILE_SESSIONS * MEMORY_PER_SESSION, f"RSS grew {grown / 2**20:.1f} MiB beside {variant}"


@pytest.mark.parametrize("variant,line", [
    ("pong_stream", "control, empty or small frames in a second"),
    ("ping_flood", "bytes of pongs unsent"),
])
def test_a_flooding_session_is_aborted_with_one_line(variant, line, monkeypatch, caplog):
    """The flood aborts the connection, and one `stalled:` line says which bound it broke. The ping flood's pongs are
    bounded by their own cap too, with the rate limit lifted: this proves the cap, not the rate (RSS within
    MEMORY_PER_SESSION, a margin for the allocator's noise)."""
    if variant == "ping_flood":
        monkeypatch.setattr(ws_bounds, "MAX_SMALL_FRAMES_PER_S", 10 ** 9)
    with hostile(variant) as url, caplog.at_level(logging.WARNING, logger="envs.client"):
        client = ws_session(url)
        rss_before = rss_bytes()
        with contextlib.suppress(UntrustedReply):  # the pong stream: aborted before the reset's reply, or after
            client.reset()
        deadline = time.monotonic() + GUARD_S
        while not [r for r in caplog.records if line in r.getMessage()]:  # the connection was aborted (polled)
            assert time.monotonic() < deadline, f"no line saying {line!r}"
            time.sleep(0.01)
        said = [r.getMessage() for r in caplog.records if line in r.getMessage()]
        grown = rss_bytes() - rss_before
        assert not client.connected
        client.close()
        wait_all_closed(url)
    assert len(said) == 1 and "\n" not in said[0] and said[0].startswith("stalled: ws://127.0.0.1:"), said
    assert grown < 2 * MEMORY_PER_SESSION, f"RSS grew {grown / 2**20:.1f} MiB for one flooding session"


def test_closing_a_session_whose_server_stopped_reading_is_bounded_and_aborts_it():
    """The rollout loop gives up on a step (TOOL_TIMEOUT_S) whose request cannot be sent (the server stopped reading,
    and pings now and then): close() returns within seconds and the server sees the connection end. Before: the close
    frame's send blocked with no timeout, close() took its 40 s deadline, and the socket was never aborted."""
    with hostile("ping_flood", HOSTILE_PING_EVERY_S="0.05") as url:
        client = SessionClient(url, ping_interval_s=None, message_timeout_s=GUARD_S, connect_timeout_s=30)
        client.reset()
        failed: list[BaseException] = []

        def step() -> None:
            try:
                client.step({"text": "x" * (32 << 20)})  # more than the kernel's buffers take: the send waits
            except BaseException as exc:  # noqa: BLE001 - whatever it ends with, the test reads
                failed.append(exc)

        stepping = threading.Thread(target=step, daemon=True)
        stepping.start()
        deadline = time.monotonic() + GUARD_S
        while not (client._ws and client._ws.transport.get_write_buffer_size()):  # the step's send waits (polled)
            assert time.monotonic() < deadline, "the step's request never filled the send buffer"
            time.sleep(0.01)
        t0 = time.monotonic()
        client.close()
        took = time.monotonic() - t0
        stepping.join(GUARD_S)
        deadline = time.monotonic() + 10
        while open_sessions(url):  # the server sees the connection end (polled; before: never)
            assert time.monotonic() < deadline, "the connection is still open after close()"
            time.sleep(0.05)
    assert took < 10, f"close() took {took:.1f} s"
    assert failed and not stepping.is_alive()
