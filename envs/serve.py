"""Env-server entrypoint: `python -m envs.serve` (ENV_NAME, PORT, MAX_CONCURRENT_ENVS, SESSION_TIMEOUT_S).

Optional: WS_PING_INTERVAL_S (20), WS_PING_TIMEOUT_S (60), MAX_MESSAGE_BYTES (1 MiB),
WS_PER_MESSAGE_DEFLATE (false), LOG_LEVEL (info).
One uvicorn worker on purpose: workers would split the session table (scale with replicas instead).
"""

from __future__ import annotations

import logging
import os


def main() -> None:
    import uvicorn

    from envs._server import ServerSettings, build_app

    settings = ServerSettings.from_env()
    level = os.environ.get("LOG_LEVEL", "info").lower()
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
        host=os.environ.get("HOST", "0.0.0.0"),
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
