"""Fixtures for trainer tests: a real env server process on loopback (the tiny model: tests/conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from contract.config import ENV_VARS

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EnvServer:
    def __init__(self, env_name: str = "echo", capacity: int = 64) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, ENV_NAME=env_name, PORT=str(self.port), HOST="127.0.0.1",
                   MAX_CONCURRENT_ENVS=str(capacity), SESSION_TIMEOUT_S="600", LOG_LEVEL="warning")
        self.proc = subprocess.Popen([sys.executable, "-m", "envs.serve"], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 300  # only stops a hang: a loaded 2-core machine took over 60 s
        while True:
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()  # before reading: a live server's stderr pipe never ends
                raise RuntimeError(f"env server did not start: {self.proc.communicate()[1].decode()[-2000:]}")
            time.sleep(0.2)

    def health(self) -> dict:
        return requests.get(self.url + "/health", timeout=5).json()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def env_server_factory():
    servers = []

    def start(env_name: str = "echo", capacity: int = 64) -> EnvServer:
        servers.append(EnvServer(env_name, capacity))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def echo_server():
    server = EnvServer("echo", 64)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def clean_run_env(monkeypatch):
    """Tests build configs from explicit values, never from the caller's shell."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
