"""Env-server entrypoint: `python -m envs.serve`; settings from the environment (envs.core.settings:
ENV_NAME, PORT, MAX_CONCURRENT_ENVS, SESSION_TIMEOUT_S, WS_*, MAX_MESSAGE_BYTES, HOST, LOG_LEVEL).
One uvicorn worker on purpose: workers would split the session table (scale with replicas instead).
"""

from __future__ import annotations

import logging
import sys


def main() -> None:
    import uvicorn

    # Upstream's openenv.core.env_server imports Gradio (its web UI) whenever it is installed: two thirds of this
    # server's start-up (~6 CPU-s to /health with it, ~2 without), for a UI that is off unless ENABLE_WEB_INTERFACE.
    # Left out, the import fails as upstream's own `try` allows; turned on, the UI's import loads it
    # (server.with_web_interface).
    blocked = sys.modules.setdefault("gradio", None) is None
    from envs.core.server import build_app
    from envs.core.settings import ServerSettings

    settings = ServerSettings.load()
    if settings.enable_web_interface and blocked:
        del sys.modules["gradio"]
    level = settings.log_level.lower()
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, server = build_app(settings)
    logging.getLogger("envs.server").info(
        "serving %s on :%d (max %d sessions, idle timeout %s s)",
        settings.env_name,
        settings.port,
        settings.max_concurrent_envs,
        settings.session_timeout_s,
    )
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        workers=1,
        log_level=level,
        access_log=False,  # one line per /ws frame would cost more CPU than an echo step
        ws_ping_interval=settings.ws_ping_interval_s,
        ws_ping_timeout=settings.ws_ping_timeout_s,
        ws_max_size=settings.ws_hard_max_bytes,
        ws_per_message_deflate=settings.ws_per_message_deflate,
        timeout_graceful_shutdown=5,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
