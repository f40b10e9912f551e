"""One hostile env's sessions against the rest of the trainer process (#44): its replies must not hold another env's
sessions on the shared client loop, and what a session buffers is bounded. Servers: the hostile fixture
(tests/fixtures/envs/hostile) on 127.0.0.1."""

from __future__ import annotations

import threading
import time

import pytest

from envs.core.client import MAX_QUEUED_FRAMES, EnvServerError, SessionClient, _queued_frames
from envs.core.http_mcp import McpHttpSession
from envs.core.untrusted import UntrustedReply
from tests.trainer.test_hostile_env import GUARD_S, hostile, wait_all_closed

HOSTILE_SESSIONS = 16
# A benign step takes ~6 ms alone. Bound generous for a busy 2-core machine; before #44 it took 15.6 s (many_lists).
BENIGN_STEP_BOUND_S = 0.5


def hammer(make, stop: threading.Event, rounds: list[int], lock: threading.Lock) -> None:
    """One hostile session after another (reset, step), until `stop`; whatever each fails with is what it must."""
    client = make()
    while not stop.is_set():
        try:
            client.reset()
            client.step({"type": "call_tool", "tool_name": "look", "arguments": {}} if isinstance(
                client, McpHttpSession) else {"column": 1})
        except (UntrustedReply, ConnectionError, TimeoutError, OSError) as exc:
            assert "\n" not in str(exc)
        with lock:
            rounds[0] += 1
    client.close()


def benign_steps_beside(hostile_url: str, make) -> tuple[list[float], int]:
    """HOSTILE_SESSIONS sessions of `make(hostile_url)` hammering while a benign env's session steps 5 times: the
    benign steps' times and the RSS grown meanwhile (what the hostile sessions hold; tracemalloc would slow the loop)."""
    with hostile("none") as benign_url:
        benign = SessionClient(benign_url, ping_interval_s=None, message_timeout_s=GUARD_S)
        benign.reset()
        benign.step({"column": 1})  # connected and warm: what follows measures waiting, not connecting
        stop, lock, rounds = threading.Event(), threading.Lock(), [0]
        threads = [threading.Thread(target=hammer, args=(lambda: make(hostile_url), stop, rounds, lock), daemon=True)
                   for _ in range(HOSTILE_SESSIONS)]
        rss_before = rss_bytes()
        try:
            for thread in threads:
                thread.start()
            deadline = time.monotonic() + GUARD_S
            while rounds[0] < HOSTILE_SESSIONS:  # every hostile session has been through a round (counted, polled)
                assert time.monotonic() < deadline, f"only {rounds[0]} hostile rounds in {GUARD_S} s"
                time.sleep(0.01)
            took = []
            for _ in range(5):
                t0 = time.monotonic()
                assert benign.step({"column": 1})["observation"] == {"text": "moved"}
                took.append(time.monotonic() - t0)
            grown = rss_bytes() - rss_before
        finally:
            stop.set()
            for thread in threads:
                thread.join(GUARD_S)
        benign.close()
    return took, grown


def test_a_hostile_envs_big_replies_do_not_hold_a_benign_envs_steps():
    """16 sessions of a hostile env send 1 MiB replies (349,000 empty lists) while a benign env's session steps: each
    benign step stays within BENIGN_STEP_BOUND_S. Before: ~0.8 s per hostile reply was parsed and walked on the loop
    every session shares, and the benign step waited behind all of them (8.5-25.7 s measured here; now ~0.05 s)."""
    with hostile("many_lists") as hostile_url:
        took, _ = benign_steps_beside(hostile_url, lambda url: SessionClient(
            url, ping_interval_s=None, message_timeout_s=GUARD_S, reconnect_wait_s=0))
    assert max(took) <= BENIGN_STEP_BOUND_S, f"benign steps took {[round(t, 3) for t in took]} s " \
                                             f"with {HOSTILE_SESSIONS} hostile sessions sending 1 MiB replies"


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_unsolicited_frames_are_buffered_boundedly_and_end_the_session():
    """A server pushing 1 MiB frames nobody asked for: each session stops reading its socket once one frame waits
    (before: 17, ~20 MiB per session; RSS grows ~1.2 MiB per session now), and its next call ends the session with
    one line (before: the queued frames paired with later requests as their replies)."""
    with hostile("unsolicited") as url:
        clients = [SessionClient(url, ping_interval_s=None, message_timeout_s=GUARD_S) for _ in range(HOSTILE_SESSIONS)]
        rss_before = rss_bytes()
        for client in clients:
            client.reset()
        deadline = time.monotonic() + GUARD_S
        while not all(client._ws.recv_messages.paused for client in clients):  # reading stopped: the queue is full
            assert time.monotonic() < deadline, "sessions still reading unsolicited frames"
            time.sleep(0.01)
        queued = [_queued_frames(client._ws) for client in clients]
        grown = rss_bytes() - rss_before
        assert max(queued) <= MAX_QUEUED_FRAMES + 1, queued  # websockets pauses once the queue is over its mark
        assert grown <= HOSTILE_SESSIONS * (2 << 20), f"RSS grew {grown / 2**20:.0f} MiB for {HOSTILE_SESSIONS} sessions"
        with pytest.raises(UntrustedReply) as caught:
            clients[0].step({"column": 1})
        assert "sent a frame nobody asked for" in str(caught.value) and "\n" not in str(caught.value)
        assert not clients[0].connected
        t0 = time.monotonic()
        for client in clients:
            client.close()
        # waiting out each close handshake (5-10 s each) would take 80 s or more; at once takes ms, and
        # the bound leaves a host part starved for a while beside the containers (make test) room to pass
        assert time.monotonic() - t0 < 60, "closing sessions that stopped reading waited for close handshakes"
        wait_all_closed(url)


def test_a_reapers_expiry_frame_still_reads_as_the_session_expired():
    """An idle session's SESSION_EXPIRED frame arrives unasked too, and with one frame buffered its close frame stays
    unread: the next reset still opens a fresh session and a step still gets SESSION_EXPIRED, as before."""
    with hostile("reaped") as url:
        client = SessionClient(url, ping_interval_s=None, message_timeout_s=GUARD_S, reconnect_wait_s=0)

        def reaped() -> None:
            deadline = time.monotonic() + GUARD_S
            while client.connected and not _queued_frames(client._ws):  # the expiry frame has arrived (polled)
                assert time.monotonic() < deadline, "no expiry frame"
                time.sleep(0.01)

        client.reset()
        reaped()
        assert client.reset()["observation"] == {"text": "ready"}
        reaped()
        with pytest.raises(EnvServerError) as caught:
            client.step({"column": 1})
        assert caught.value.code == "SESSION_EXPIRED" and not client.connected
        wait_all_closed(url)
