"""envs.core.replicas: sessions spread over an env's replicas / fleet tasks, and follow them as they change.

The unit tests drive a ReplicaSet with a scripted resolver and clock. The client tests run real env
servers on loopback behind one service name whose "DNS" the test controls, the way Docker's DNS lists
healthy Compose replicas or Swarm tasks; the containers test (tests/tools/test_fleet_swarm.py) does
the same on a real swarm.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from envs.core.replicas import QUARANTINE_S, ReplicaSet, ResolveError, resolve

A, B, C = "http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"


class Dns:
    """What the service name resolves to, set by the test."""

    def __init__(self, *answer: str) -> None:
        self.answer = list(answer)
        self.queries = 0

    def __call__(self, url: str) -> list[str]:
        self.queries += 1
        if not self.answer:
            raise ResolveError("cannot resolve 'env-echo'")
        return list(self.answer)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replica_set(dns: Dns, clock: Clock, logs: list[str] | None = None) -> ReplicaSet:
    return ReplicaSet("http://env-echo:8000", resolver=dns, namer=lambda u: u.split("//")[1].split(":")[0],
                      refresh_s=5.0, clock=clock, log=(logs if logs is not None else []).append)


def test_least_loaded_spread_and_release():
    rs = replica_set(Dns(A, B, C), Clock())
    picks = [rs.acquire() for _ in range(7)]
    assert Counter(picks) == {A: 3, B: 2, C: 2}
    rs.release(A)
    rs.release(A)
    assert rs.acquire() == A  # now the least loaded
    assert rs.snapshot()["10.0.0.1 (10.0.0.1)"] == (2, 4)  # open now, opened since the start


def test_resolves_again_only_when_stale_or_after_a_failure():
    dns, clock = Dns(A, B), Clock()
    rs = replica_set(dns, clock)
    for _ in range(10):
        rs.acquire()
    assert dns.queries == 1
    clock.now = 5.0
    rs.acquire()
    assert dns.queries == 2
    rs.refused(A)
    rs.acquire()
    assert dns.queries == 3
    rs.lost()  # a session's connection dropped
    rs.acquire()
    assert dns.queries == 4


def test_a_refused_replica_is_skipped_for_a_while_unless_it_is_the_only_one():
    dns, clock = Dns(A, B), Clock()
    rs = replica_set(dns, clock)
    assert rs.acquire() == A
    rs.release(A)
    rs.refused(A)  # the connection to it failed
    assert [rs.acquire() for _ in range(3)] == [B, B, B]
    clock.now = QUARANTINE_S
    assert rs.acquire() == A  # back after the quarantine, and the least loaded
    dns.answer = [A]
    rs.refused(A)
    assert rs.acquire() == A  # the only one: tried anyway (the client waits with backoff)


def test_a_scaled_up_task_is_used_and_sessions_move_to_it_at_episode_boundaries():
    dns, clock, logs = Dns(A, B), Clock(), []
    rs = replica_set(dns, clock, logs)
    held = [rs.acquire() for _ in range(8)]  # 4 + 4
    dns.answer = [A, B, C]  # `docker service scale` added a task
    assert not rs.should_move(A)  # not yet resolved again: nothing moves
    clock.now = 5.0
    moved = 0
    for i, url in enumerate(held):  # each session's next reset asks whether to move
        if rs.should_move(url):
            rs.release(url)
            held[i] = rs.acquire()
            moved += 1
    assert Counter(held) == {A: 3, B: 3, C: 2} and moved == 2
    assert logs == ["http://env-echo:8000: 3 replica(s) now; added 10.0.0.3"]


def test_a_replaced_task_is_left_and_its_sessions_spread_over_the_live_ones():
    dns, clock, logs = Dns(A, B, C), Clock(), []
    rs = replica_set(dns, clock, logs)
    held = [rs.acquire() for _ in range(6)]
    dns.answer = [A, C, "http://10.0.0.9:8000"]  # B died; Swarm started a replacement with a new address
    rs.refused(B)  # what a session on B sees when it reconnects
    for i, url in enumerate(held):
        if rs.should_move(url):
            rs.release(url)
            held[i] = rs.acquire()
    assert B not in held and Counter(held) == {A: 2, C: 2, "http://10.0.0.9:8000": 2}
    assert logs[-1].endswith("added 10.0.0.9; gone 10.0.0.2")


def test_no_address_at_all_is_a_connection_error_the_client_waits_on():
    rs = replica_set(Dns(), Clock())
    with pytest.raises(ConnectionError, match="cannot resolve 'env-echo'"):
        rs.acquire()
    assert not rs.should_move(A)  # a failing lookup never tears down a working session


def test_tls_urls_keep_their_host_name_and_ip_literals_resolve_to_themselves():
    assert ReplicaSet.for_url("https://envs.example.com") is None
    assert ReplicaSet.for_url("http://127.0.0.1:9") is ReplicaSet.for_url("http://127.0.0.1:9")
    assert resolve("http://10.1.2.3:8000/") == ["http://10.1.2.3:8000"]


# ------------------------------------------------------------------------------------------ real servers
@pytest.fixture
def service(env_server_factory, monkeypatch):
    """Three real echo servers behind the name `env-echo.test`, whose answer the test sets."""
    servers = [env_server_factory("echo", capacity=8) for _ in range(3)]
    dns = Dns(*(s.url for s in servers[:2]))
    url = "http://env-echo.test:8000"
    rs = ReplicaSet(url, resolver=dns, refresh_s=0.0)  # resolve at every choice: no clock in the test
    monkeypatch.setitem(ReplicaSet._shared, url, rs)
    return url, servers, dns, rs


def play(client) -> None:
    client.reset()
    client.step({"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hi"}})


def until(check, what: str, guard_s: float = 120) -> None:
    """Wait for an event the system shows (`check()` true); the deadline only stops a hang."""
    deadline = time.monotonic() + guard_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not seen in {guard_s:.0f} s"
        time.sleep(0.05)


def active(servers) -> list[int]:
    return [s.health()["active_sessions"] for s in servers]


def until_active(servers, want: list[int]) -> None:
    """Until the servers report these open sessions: a session a client closed is freed when the server has
    processed the close, after close() returns."""
    seen = []
    until(lambda: seen.append(active(servers)) or seen[-1] == want, f"active sessions {want} (last seen {seen[-1:]})")


def test_sessions_spread_follow_a_dead_server_and_use_a_new_one(service):
    from envs.core.client import EnvServerError, SessionClient

    url, servers, dns, rs = service
    clients = [SessionClient(url, reconnect_wait_s=60) for _ in range(6)]
    for c in clients:
        play(c)
    assert active(servers) == [3, 3, 0]  # a session is open once its reset is answered
    on_dead = [c for c in clients if c._replica == servers[0].url]
    assert len(on_dead) == 3

    servers[0].stop()  # a task dies: Docker's DNS stops listing it, and lists the replacement Swarm started
    dns.answer = [servers[1].url, servers[2].url]
    # the clients learn it when their own connection's close is processed (on their background loop):
    # wait for that, not for the time it usually takes
    until(lambda: not any(c.connected for c in on_dead), "the dead server's sessions seen closed")
    lost = []
    for c in clients:
        try:
            c.step({"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "x"}})
        except EnvServerError as e:
            assert e.code == "SESSION_LOST"
            lost.append(c)
    assert lost == on_dead  # the dead server's episodes end; the others go on
    for c in clients:  # the next episode of every session runs on a live server
        play(c)
    # a session that moved at its episode boundary closed its old one: freed once that server processed it
    until_active(servers[1:], [3, 3])

    for c in clients:
        c.close()
    until_active(servers[1:], [0, 0])
    assert sum(now for now, _ in rs.snapshot().values()) == 0
