"""Our OpenEnv HTTP/WebSocket server: stock `HTTPEnvServer` routes, plus the fixes training needs.

What stock openenv 0.10.0 does and what we add (see envs/README.md for the operator's view):

- Capacity: stock refuses the (N+1)-th `/ws` session with a CAPACITY_REACHED error frame. We keep the
  frame and code, make the message name the fix, and publish the live numbers at `GET /health` and
  `GET /capacity` so a trainer can compare them with the sessions it will open.
- Idle reaping: stock's reaper (only when `session_timeout` is set) destroys idle sessions but leaves a
  `/ws` socket open on a closed env and a freed slot (so capacity over-commits). We answer the next
  frame on that socket with a SESSION_EXPIRED error, then close it (4408). Not closing it at once is
  on purpose: upstream's client silently reconnects a socket it finds closed and would go on in a new,
  un-reset session; this way its call raises, naming the expiry. At most MAX_CONCURRENT_ENVS such
  sockets stay open; past that the oldest gets the error frame and the close at once.
- Bad frames: stock closes the whole session on a JSON value that is not an object (`[]`, `1`) or on a
  binary frame; uvicorn closes the socket (1009) on big frames. A small
  ASGI layer in front of `/ws` answers those with a structured error frame and keeps the session.
- Dropped clients: stock already frees the slot when the socket drops; uvicorn's keepalive pings
  (interval/timeout from the environment) find half-open connections.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI
from openenv.core.env_server.exceptions import SessionCapacityError
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import ConcurrencyConfig

from envs.core.settings import ServerSettings
from envs.core.untrusted import nested_deeper_than as _nested_deeper_than

log = logging.getLogger("envs.server")

# Set by the ASGI layer for each /ws connection; read when the session is created, so the reaper can
# mark (or close) the socket of a session it destroys.
Closer = Callable[..., Awaitable[bool]]  # (code, reason, error, now=False) -> whether it acted
_WS_CLOSER: contextvars.ContextVar[Optional[Closer]] = contextvars.ContextVar("ws_closer", default=None)

SESSION_EXPIRED = "SESSION_EXPIRED"
MESSAGE_TOO_LARGE = "MESSAGE_TOO_LARGE"


class TrainingEnvServer(HTTPEnvServer):
    """`HTTPEnvServer` with clearer capacity errors and reaping that also closes the socket."""

    def __init__(self, *args: Any, public_name: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.public_name = public_name
        self._ws_closers: dict[str, Closer] = {}
        # Sockets of reaped sessions, kept open until their next frame (oldest first); past max_concurrent_envs the
        # oldest is closed at once, so a client cannot pile up sockets by letting sessions expire.
        self._expired_sockets: dict[Closer, None] = {}
        self.reaped_sessions = 0
        self.episodes_started = 0  # reset frames received: a rising count means rollouts are starting
        # sessions whose last frame was a reset: rollouts the policy is generating a first turn for
        self.episodes_awaiting_step = 0

    def capacity(self) -> dict:
        active = len(self._sessions)
        return {
            "env": self.public_name,
            "active_sessions": active,
            "max_sessions": self._max_concurrent_envs,
            "available_slots": max(0, self._max_concurrent_envs - active),
            "session_timeout_s": self._session_idle_timeout_s,
            "reaped_sessions": self.reaped_sessions,
            "episodes_started": self.episodes_started,
            "episodes_awaiting_step": self.episodes_awaiting_step,
        }

    async def _create_session(self):  # type: ignore[override]
        try:
            session_id, env = await super()._create_session()
        except SessionCapacityError as e:
            raise SessionCapacityError(
                e.active_sessions,
                e.max_sessions,
                message=(
                    f"{self.public_name} env server at capacity: {e.active_sessions}/{e.max_sessions} "
                    "sessions in use. Open fewer sessions (per_device_train_batch_size x "
                    "steps_per_generation per process), raise MAX_CONCURRENT_ENVS, or add replicas; "
                    "close sessions you no longer need. GET /capacity shows free slots."
                ),
            ) from None
        closer = _WS_CLOSER.get()
        if closer is not None:
            self._ws_closers[session_id] = closer
        return session_id, env

    async def _destroy_session(self, session_id: str) -> None:  # type: ignore[override]
        closer = self._ws_closers.pop(session_id, None)
        await super()._destroy_session(session_id)
        if closer is not None:
            # No-op when the socket already closed (normal end); otherwise this is the reaper.
            if await closer(*self._expiry()):
                self.reaped_sessions += 1
                self._expired_sockets[closer] = None
                log.info("expired idle session %s (SESSION_TIMEOUT_S): its next frame gets SESSION_EXPIRED", session_id)
                while len(self._expired_sockets) > self._max_concurrent_envs:
                    oldest = next(iter(self._expired_sockets))
                    del self._expired_sockets[oldest]
                    await oldest(*self._expiry(), now=True)

    def _expiry(self) -> tuple[int, str, dict]:
        return 4408, "session expired", {
            "message": (f"Session closed after {self._session_idle_timeout_s or 0:g} s without a reset or step "
                        "(SESSION_TIMEOUT_S). Reconnect to start a new session."),
            "code": SESSION_EXPIRED,
        }


MAX_JSON_DEPTH = 64  # actions and reset kwargs are a few levels deep; far below any parser limit


def _error_frame(code: str, message: str, **extra: Any) -> str:
    return json.dumps({"type": "error", "data": {"message": message, "code": code, **extra}})


class WSGuard:
    """ASGI layer in front of `/ws`: answers frames the stock handler would die on, tracks the socket.

    Only frames that are not a JSON object (or are too big / binary non-UTF-8)
    are answered here; everything else goes to the stock handler unchanged.
    """

    def __init__(self, app: Any, max_message_bytes: int, server: "TrainingEnvServer | None" = None) -> None:
        self.app = app
        self.max_message_bytes = max_message_bytes
        self.server = server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "websocket" or scope.get("path") != "/ws":
            return await self.app(scope, receive, send)

        closed = False  # close sent by either side
        awaiting_step = False  # this session reset and has not stepped since

        async def guarded_send(message: dict) -> None:
            nonlocal closed
            if message["type"] == "websocket.close":
                if closed:
                    return  # the reaper closed it already; the handler's own close is moot
                closed = True
            try:
                await send(message)
            except Exception:
                closed = True
                raise

        owner = asyncio.current_task()
        expired: Optional[tuple[int, str, dict]] = None  # set by the reaper: the next frame gets this error

        async def closer(code: int, reason: str, error: dict, now: bool = False) -> bool:
            # The handler's own teardown (client close, disconnect, error) runs in `owner`; only
            # another task (the idle reaper) marks the socket expired, or closes it (`now`), from here.
            nonlocal expired
            if closed or (asyncio.current_task() is owner and not now):
                return False
            expired = (code, reason, error)
            if now:
                await say_expired()
            return True

        async def say_expired() -> None:
            code, reason, error = expired  # type: ignore[misc]
            try:
                await guarded_send({"type": "websocket.send", "text": _error_frame(**error)})
                await guarded_send({"type": "websocket.close", "code": code, "reason": reason})
            except Exception:  # client already gone
                pass

        async def expire() -> dict:
            await say_expired()
            # the stock handler sees a disconnect and ends (its env is gone already)
            return {"type": "websocket.disconnect", "code": expired[0]}  # type: ignore[index]

        async def guarded_receive() -> dict:
            nonlocal closed, awaiting_step
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    closed = True
                    return message
                if message["type"] != "websocket.receive":
                    return message
                if expired is not None:
                    return await expire()
                text = message.get("text")
                if text is None:
                    raw = message.get("bytes") or b""
                    if len(raw) > self.max_message_bytes:
                        await guarded_send(self._too_large(len(raw)))
                        continue
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        await guarded_send(
                            {
                                "type": "websocket.send",
                                "text": _error_frame(
                                    "INVALID_JSON", "Binary frame is not UTF-8 JSON; send JSON text frames."
                                ),
                            }
                        )
                        continue
                    message = {"type": "websocket.receive", "text": text}
                if len(text) > self.max_message_bytes:
                    await guarded_send(self._too_large(len(text)))
                    continue
                try:
                    parsed = json.loads(text)
                except json.JSONDecodeError:
                    return message  # stock handler answers INVALID_JSON
                except (ValueError, RecursionError) as e:
                    # Nesting deeper than the recursion limit, or an int over Python's 4300-digit
                    # limit: stock catches only JSONDecodeError and would end the session.
                    await guarded_send(
                        {"type": "websocket.send", "text": _error_frame("INVALID_JSON", f"Invalid JSON: {str(e)[:200]}")}
                    )
                    continue
                # nesting depth <= number of opening brackets: most frames skip the walk
                if (text.count("{") + text.count("[") > MAX_JSON_DEPTH) and _nested_deeper_than(parsed, MAX_JSON_DEPTH):
                    # pydantic cannot serialize a validation error about a value this deep (its limit
                    # is ~255 levels); stock would then end the session with SESSION_ERROR.
                    await guarded_send(
                        {
                            "type": "websocket.send",
                            "text": _error_frame(
                                "VALIDATION_ERROR", f"Message is nested deeper than {MAX_JSON_DEPTH} levels."
                            ),
                        }
                    )
                    continue
                # Any object goes to the stock handler: a non-string "type" gets its UNKNOWN_TYPE, as upstream.
                if not isinstance(parsed, dict):
                    await guarded_send(
                        {
                            "type": "websocket.send",
                            "text": _error_frame(
                                "VALIDATION_ERROR",
                                'A message must be a JSON object with a string "type": '
                                '{"type": "reset"|"step"|"state"|"close"|"mcp", "data": {...}}.',
                            ),
                        }
                    )
                    continue
                if self.server is not None:
                    kind = parsed.get("type")
                    if kind == "reset":
                        self.server.episodes_started += 1
                        self.server.episodes_awaiting_step += not awaiting_step
                        awaiting_step = True
                    elif kind == "step" and awaiting_step:
                        self.server.episodes_awaiting_step -= 1
                        awaiting_step = False
                return message

        token = _WS_CLOSER.set(closer)
        try:
            await self.app(scope, guarded_receive, guarded_send)
        finally:
            _WS_CLOSER.reset(token)
            if self.server is not None:
                self.server._expired_sockets.pop(closer, None)
            if awaiting_step and self.server is not None:
                self.server.episodes_awaiting_step -= 1

    def _too_large(self, size: int) -> dict:
        return {
            "type": "websocket.send",
            "text": _error_frame(
                MESSAGE_TOO_LARGE,
                f"Message of {size} bytes exceeds MAX_MESSAGE_BYTES={self.max_message_bytes}; "
                "send smaller actions.",
                max_bytes=self.max_message_bytes,
            ),
        }


def slowed(env_cls: type, delay_s: float) -> type:
    """`env_cls` with every step answered `delay_s` later (STEP_DELAY_S: a slow env for benchmarks). The wait is on
    the event loop (asyncio.sleep), so other sessions' steps go on meanwhile, as with an env that waits on I/O."""
    if not delay_s:
        return env_cls
    own_async = env_cls.step_async is not Environment.step_async  # as openenv tells whether to await it

    class Slowed(env_cls):  # type: ignore[valid-type, misc]
        async def step_async(self, action: Any, *args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(delay_s)
            if own_async:
                return await super().step_async(action, *args, **kwargs)
            return await asyncio.get_running_loop().run_in_executor(None, functools.partial(
                super().step, action, *args, **kwargs))

    Slowed.__name__ = Slowed.__qualname__ = f"Slowed{env_cls.__name__}"
    return Slowed


def build_app(settings: ServerSettings) -> tuple[Any, TrainingEnvServer]:
    """The ASGI app for `settings.env_name` and the server object behind it."""
    from envs.registry import get

    spec = get(settings.env_name)
    factory, action_cls, observation_cls, state_cls = spec.server_parts()
    factory = slowed(factory, settings.step_delay_s)

    # Same as openenv's create_fastapi_app (FastAPI + HTTPEnvServer.register_routes), but we keep the
    # server object: /health and /capacity read its session table.
    app = FastAPI(title=f"OpenEnv {spec.name} environment (grpo-stack)", version="1.0.0")
    server = TrainingEnvServer(
        factory,
        action_cls,
        observation_cls,
        concurrency_config=ConcurrencyConfig(
            max_concurrent_envs=settings.max_concurrent_envs,
            session_timeout=settings.session_timeout_s,
        ),
        env_name=spec.upstream_env_name,
        state_cls=state_cls,
        public_name=spec.name,
    )

    # Registered before the stock routes, so ours answer /health (a superset of stock's body).
    @app.get("/health", tags=["Health"])
    async def health() -> dict:
        return {"status": "healthy", **server.capacity()}

    @app.get("/capacity", tags=["Health"])
    async def capacity() -> dict:
        return server.capacity()

    server.register_routes(app, mode=settings.openenv_mode)
    if settings.enable_web_interface:
        app = with_web_interface(app, spec.upstream_env_name, factory, action_cls, observation_cls, state_cls,
                                 settings.openenv_mode)
    return WSGuard(app, settings.max_message_bytes, server), server


def with_web_interface(app: FastAPI, env_name: str, factory: Any, action_cls: type, observation_cls: type,
                       state_cls: type, mode: str) -> FastAPI:
    """ENABLE_WEB_INTERFACE, as upstream's create_app: its Gradio app (`/`, `/web`, `/web/*`, `/ws/ui`, one shared
    env) around ours. Our routes go first, so every path we serve answers as without the UI (first match wins)."""
    from openenv.core.env_server.web_interface import create_web_interface_app

    web = create_web_interface_app(factory, action_cls, observation_cls, env_name=env_name, max_concurrent_envs=1,
                                   state_cls=state_cls, mode=mode)
    web.router.routes[0:0] = app.router.routes
    web.router.on_startup.extend(app.router.on_startup)  # our idle reaper and executor shutdown
    web.router.on_shutdown.extend(app.router.on_shutdown)
    return web
