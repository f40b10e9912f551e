"""Helpers shared by the reliability tests (one module instance: conftest and tests import it)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Optional

import requests


ENV_NAMES = ("echo", "wordle", "catch")
# Small on purpose: the soak fills every slot; the fuzz needs only a few.
CAPACITY = int(os.environ.get("RELIABILITY_CAPACITY", "32"))
SESSION_TIMEOUT_S = 30

# One well-formed action per env, in upstream's wire schema (see envs/<name>/models.py).
VALID_ACTIONS: dict[str, dict] = {
    "echo": {"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hello"}},
    "wordle": {"message": "[crane]"},
    "catch": {"action_id": 1},
}

# Figures the tests report; printed at the end of the pytest run (see pytest_terminal_summary).
FIGURES: list[str] = []


def report(line: str) -> None:
    FIGURES.append(line)
    print(line, flush=True)


@dataclass
class EnvStack:
    urls: dict[str, str]
    project: Optional[str] = None
    containers: dict[str, str] = field(default_factory=dict)

    @property
    def in_containers(self) -> bool:
        return self.project is not None

    def ws(self, name: str) -> str:
        return self.urls[name].replace("http://", "ws://", 1) + "/ws"

    def health(self, name: str, timeout: float = 5.0) -> dict:
        r = requests.get(self.urls[name] + "/health", timeout=timeout)
        r.raise_for_status()
        body = r.json()
        assert body.get("status") == "healthy", body
        return body

    def inspect(self, name: str) -> dict:
        out = subprocess.run(["docker", "inspect", self.containers[name]], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)[0]

    def exec(self, name: str, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["docker", "exec", self.containers[name], *cmd], capture_output=True, text=True,
                              check=check)


def container_id(project: str, service: str) -> str:
    out = subprocess.run(
        ["docker", "ps", "-q", "--filter", f"label=com.docker.compose.project={project}",
         "--filter", f"label=com.docker.compose.service={service}"],
        capture_output=True, text=True, check=True,
    ).stdout.split()
    assert len(out) == 1, f"expected one {service} container in {project}, got {out}"
    return out[0]


def wait_healthy(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if requests.get(url + "/health", timeout=3).json().get("status") == "healthy":
                return
        except (requests.RequestException, ValueError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not healthy after {timeout_s} s")
        time.sleep(0.5)


def recv_json(ws, timeout: float = 30.0) -> dict:
    raw = ws.recv(timeout=timeout)
    msg = json.loads(raw)
    assert isinstance(msg, dict), raw[:200]
    return msg


def assert_structured(msg: dict, frame_desc: str = "") -> str:
    """Every reply is an observation/state/mcp frame, or an error with a code and a message."""
    kind = msg.get("type")
    assert kind in ("observation", "state", "error", "mcp"), f"unstructured reply {msg!r:.300} to {frame_desc:.200}"
    assert isinstance(msg.get("data"), dict), f"reply without data: {msg!r:.300}"
    if kind == "error":
        data = msg["data"]
        assert isinstance(data.get("code"), str) and data["code"], f"error without code: {msg!r:.300}"
        assert isinstance(data.get("message"), str), f"error without message: {msg!r:.300}"
        return data["code"]
    return kind
