"""Our env server in this process: the app (for Starlette's TestClient), or served by uvicorn in a thread on
127.0.0.1 for clients that need a URL (upstream's clients, the generic tool). Fast and no Docker."""

from __future__ import annotations

import asyncio
import threading
import time

from envs.core.server import build_app
from envs.core.settings import ServerSettings
from tests.helpers import free_port

STARTUP_S = 60  # only stops a hang: the server reports when it listens


def ours(env_name: str, **env: str):
    """(ASGI app, TrainingEnvServer) for `env_name`, settings from `env` (as the server's environment)."""
    return build_app(ServerSettings.load({"ENV_NAME": env_name, **env}))


class ThreadServer:
    """Our server for `env_name` under uvicorn in a thread, for clients that need a URL."""

    server = None  # our TrainingEnvServer (None for another app)

    def __init__(self, env_name: str, app=None, **env: str) -> None:
        """`env`: server settings (as its environment); `app`: serve that ASGI app instead (e.g. stock create_app on
        upstream's env, for comparison)."""
        import uvicorn

        if app is None:
            app, self.server = ours(env_name, **{"SESSION_TIMEOUT_S": "600", **env})
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.uvicorn.serve(),), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + STARTUP_S
        while not self.uvicorn.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def reap(self) -> None:
        """What the idle reaper does to sessions past SESSION_TIMEOUT_S (its loop checks every >= 5 s): all of them."""
        for session_id in list(self.server._sessions):
            asyncio.run_coroutine_threadsafe(self.server._destroy_session(session_id), self.loop).result(STARTUP_S)

    def wait_for_no_connections(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while self.uvicorn.server_state.connections:
            assert time.monotonic() < deadline, "the server kept a socket open"
            time.sleep(0.01)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(STARTUP_S)
        if not self.thread.is_alive():
            self.loop.close()

    def __enter__(self) -> "ThreadServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
