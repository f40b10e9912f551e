"""#43 item 4: env slots on an upstream server (openenv 0.10's own `create_app`, `max_concurrent_envs` set as the stack
sets it) cannot leak.

openenv 0.10 reaps no idle session when `max_concurrent_envs` is given (ENV_SESSION_TIMEOUT_S reaches only this
project's servers), so a slot comes back only when its socket closes. These show both ways it closes: the trainer
closes every session it opened on any way out (envs_binding.sessions_closed: an error here), and a trainer-side process
killed mid-episode (SIGKILL: no Python cleanup runs) has its sockets closed by the kernel, which upstream's handler
takes as a disconnect and frees the slots (measured: well under a second here; the bound asserted is SLOT_BOUND_S).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from envs.core.client import EnvServerError, SessionClient
from envs.echo.tool import EchoTool
from tests.helpers import ROOT, free_port
from trainer.rollouts import envs_binding

CAP = 2  # MAX_CONCURRENT_ENVS of the stock server
SLOT_BOUND_S = 15.0  # a freed slot must be usable within this (a busy CI machine; it takes well under 1 s)

CHILD = """
import sys
from envs.echo.tool import EchoTool  # the trainer's tool class and session client, without the trainer's imports
tools = [EchoTool(sys.argv[1]) for _ in range({cap})]
for tool in tools:
    tool.reset()
    tool.echo_message("mid-episode")  # an episode under way on every slot
print("ready", flush=True)
sys.stdin.read()  # holds its sessions until killed
"""


@pytest.fixture(scope="module")
def stock_server():
    """bench/stock_echo_server.py: upstream's echo env on stock create_app and uvicorn settings, CAP sessions."""
    import requests

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "stock_echo_server.py"), "--port", str(port)],
                            cwd=ROOT, env=dict(os.environ, MAX_CONCURRENT_ENVS=str(CAP)),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900  # a hang guard only: a server that exits fails at once
    try:
        while True:
            try:
                requests.get(f"{url}/health", timeout=2)
                break
            except requests.RequestException:
                assert time.monotonic() < deadline and proc.poll() is None, "stock echo server did not start"
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()


def assert_full(url: str) -> None:
    probe = SessionClient(url, capacity_wait_s=0, reconnect_wait_s=0)
    with pytest.raises(EnvServerError) as caught:
        probe.reset()
    assert caught.value.code == "CAPACITY_REACHED"
    probe.close()


def take_every_slot(url: str) -> float:
    """Open CAP sessions, each waiting up to SLOT_BOUND_S for a slot (the client's own capacity wait); seconds taken."""
    start = time.monotonic()
    clients = [SessionClient(url, capacity_wait_s=SLOT_BOUND_S) for _ in range(CAP)]
    try:
        for client in clients:
            client.reset()
        return time.monotonic() - start
    finally:
        for client in clients:
            client.close()


def test_the_trainer_closes_its_sessions_on_an_error(stock_server):
    Bound = envs_binding.bind("echo", EchoTool, stock_server)
    envs_binding.close_all_sessions()  # earlier tests' instances: not this run's
    with pytest.raises(RuntimeError, match="a step failed"):
        with envs_binding.sessions_closed("test"):
            tools = [Bound() for _ in range(CAP)]
            for tool in tools:
                tool.reset()
            assert_full(stock_server)  # the cap holds: a third session is refused
            raise RuntimeError("a step failed")
    assert take_every_slot(stock_server) < SLOT_BOUND_S
    assert envs_binding.close_all_sessions() == 0  # nothing left to close


def test_a_killed_trainer_process_frees_its_slots_within_a_bound(stock_server):
    child = subprocess.Popen([sys.executable, "-c", CHILD.format(cap=CAP), stock_server], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = threading.Event()
        threading.Thread(target=lambda: child.stdout.readline() == "ready\n" and ready.set(), daemon=True).start()
        assert ready.wait(120), "the child did not open its sessions"
        assert_full(stock_server)
        child.kill()  # SIGKILL mid-episode: no close frame, no Python cleanup
        child.wait(30)
        took = take_every_slot(stock_server)
        print(f"slots back {took:.2f} s after the kill")
        assert took < SLOT_BOUND_S
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_sessions_are_closed_at_once_not_one_after_the_other(monkeypatch):
    """Each close may wait out its bound on a slow link: closed one after the other, 32 sessions behind a slow link
    took longer than TRL gives its rollout worker to exit. Every close here waits for all the others to have
    started (a barrier): one after the other, the first would wait for ever (the barrier's deadline fails it)."""
    n = 8
    barrier = threading.Barrier(n, timeout=60)  # a hang guard: closes that run at once meet at once
    closed = []

    def close_session(instance):
        barrier.wait()
        closed.append(instance)

    envs_binding.close_all_sessions()  # earlier tests' instances: not this run's
    monkeypatch.setattr(envs_binding, "close_session", close_session)
    with envs_binding._live_lock:
        envs_binding._live.extend(range(n))
    assert envs_binding.close_all_sessions() == n
    assert sorted(closed) == list(range(n))
