"""The chaos proxy's control port and container (#44 item 5), host-level: in a container the control port listens on
the env network too (Docker publishes it to 127.0.0.1 from there), so it takes commands only after the injector's
token; the container mounts only the proxy's file (not the checkout with .env) and has limits."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from bench import chaos_proxy, chaos_stack
from tests.helpers import ROOT, free_port


class ProxyDouble:
    """Test double: records the commands the control port hands over."""

    def __init__(self) -> None:
        self.delays: list[tuple[float, float]] = []
        self.floods: list[str] = []

    def delay(self, seconds: float, for_s: float) -> None:
        self.delays.append((seconds, for_s))

    def hostile_frames(self, kind: str) -> dict:
        self.floods.append(kind)
        return {"link": 1, "frames": kind}


def control(port: int, *lines: str) -> list:
    deadline = time.monotonic() + 30
    while True:  # until the control server listens (it starts in a thread)
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=30)
            break
        except OSError:
            assert time.monotonic() < deadline, "the control port never listened"
            time.sleep(0.05)
    with sock, sock.makefile("rw") as f:
        answers = []
        for line in lines:
            f.write(line + "\n")
            f.flush()
            answers.append(json.loads(f.readline()))
        if answers and "error" in answers[-1]:
            assert f.readline() == "", "the control port went on after refusing"  # closed by the server
        return answers


def test_the_control_port_takes_commands_only_after_the_token():
    """Before: anyone on the env network could send `delay 1e9 1e9` and stall every reply."""
    proxy, port = ProxyDouble(), free_port()
    threading.Thread(target=chaos_proxy.serve_control, args=(proxy, port, "s3cret-token", "127.0.0.1"),
                     daemon=True).start()
    assert control(port, "delay 1e9 1e9") == [{"error": "the first line must be: token TOKEN"}]
    assert control(port, "token wrong") == [{"error": "the first line must be: token TOKEN"}]
    assert proxy.delays == []
    assert control(port, "token s3cret-token", "delay 1 2") == [{}, {}]
    assert proxy.delays == [(1.0, 2.0)]
    assert control(port, "token s3cret-token", "hostile rst", "hostile ping") == [
        {}, {"error": "unknown command hostile"}, {"link": 1, "frames": "ping"}]
    assert proxy.floods == ["ping"]  # only the frame kinds the proxy knows
    with pytest.raises(SystemExit, match="CHAOS_CONTROL_TOKEN is empty"):
        chaos_proxy.serve_control(proxy, free_port(), "")


def test_the_proxy_container_mounts_only_its_file_and_has_limits(monkeypatch):
    """Before: the checkout (.env with ENV_URLS credentials included) was mounted, with no limits."""
    runs: list[tuple[tuple[str, ...], dict | None]] = []

    def sh(*args: str, check: bool = True, timeout: float = 600, env: dict | None = None) -> str:
        runs.append((args, env))
        return "127.0.0.1:5555" if args[:2] == ("docker", "port") else ""

    tokens = []
    monkeypatch.setattr(chaos_stack, "sh", sh)
    monkeypatch.setattr(chaos_stack, "RemoteProxy", lambda address, token, **_: tokens.append(token) or address)
    remote, url = chaos_stack.proxy_container("p", "net", "tasks.env-echo:8000", 7, image="img")
    assert remote == "127.0.0.1:5555" and url == "http://127.0.0.1:5555"
    argv, env = next((a, e) for a, e in runs if a[:2] == ("docker", "run"))
    mounts = [argv[i + 1] for i, a in enumerate(argv) if a in ("-v", "--volume", "--mount")]
    assert mounts == [f"{ROOT / 'bench' / 'chaos_proxy.py'}:/proxy/chaos_proxy.py:ro"], mounts
    for flag, value in (("--memory", "256m"), ("--pids-limit", "64"), ("--security-opt", "no-new-privileges:true"),
                        ("--cap-drop", "ALL")):
        assert argv[argv.index(flag) + 1] == value, flag
    assert "--read-only" in argv
    assert argv[argv.index("-e", argv.index("PYTHONDONTWRITEBYTECODE=1")) + 1] == chaos_proxy.CONTROL_TOKEN_ENV
    assert not any(tokens[0] in a for a in argv), "the token is in the argv (ps shows it)"
    assert env[chaos_proxy.CONTROL_TOKEN_ENV] == tokens[0] and len(tokens[0]) >= 32
