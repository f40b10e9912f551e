"""A small synchronous client for OpenEnv `/ws` sessions, shared by the TRL tool classes.

TRL builds one tool-class instance per rollout (hundreds per process) and calls them synchronously.
One thread-per-connection client would mean hundreds of threads; instead every connection lives on
ONE background asyncio loop per process, which also answers keepalive pings while the trainer is busy.
Speaks the same frames as openenv's `EnvClient`: {"type": "reset"|"step"|"close", "data": {...}}.
A session given a service name connects to one of its replicas (envs.core.replicas: least-loaded,
re-resolved when replicas die or are added), chosen again whenever it (re)connects.
The server may be an image nobody here wrote (envs.core.untrusted): redirects are refused, replies are capped at
MAX_REPLY_BYTES and MAX_REPLY_DEPTH, error texts are escaped and trimmed, and no message quotes a URL's credentials.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
from typing import Any, Optional

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.protocol import State

from envs.core.replicas import ReplicaSet
from envs.core.untrusted import MAX_REPLY_BYTES, UntrustedReply, loads_reply, one_line, safe_text, strip_credentials

ERROR_CHARS = 2000  # an env's error text kept (the tool binding trims it again to ENV_OBSERVATION_CHARS)
# A reply's bound when the caller names none (probes, tests). The trainer always names its own: TOOL_TIMEOUT_S for
# steps, RESET_TIMEOUT_S for resets (trainer.rollouts.envs_binding); read at construction, so a test can lower it.
DEFAULT_REPLY_TIMEOUT_S = 120.0
_DEFAULT: Any = object()

_loop: Optional[asyncio.AbstractEventLoop] = None
_loop_lock = threading.Lock()


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="envs-ws-loop", daemon=True).start()
            _loop = loop
        return _loop


class EnvServerError(RuntimeError):
    """An error frame from the env server (`code` is openenv's WSErrorCode or ours)."""

    def __init__(self, message: str, code: str = "UNKNOWN", data: Optional[dict] = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data or {}


class RedirectRefused(UntrustedReply):
    """An env server answered the WebSocket handshake with a redirect (a setup error: reset does not retry it)."""


class open_session(connect):
    """`websockets.asyncio.client.connect` for env servers: never through HTTP(S)_PROXY (they sit on the private
    network), replies up to MAX_REPLY_BYTES, and no redirects (websockets follows up to 10, across hosts: an env
    answering `302 Location: ws://vllm:8000/...` would bounce the trainer onto agentnet)."""

    def __init__(self, uri: str, **kwargs: Any) -> None:
        kwargs.setdefault("max_size", MAX_REPLY_BYTES)
        super().__init__(uri, proxy=None, **kwargs)

    def process_redirect(self, exc: Exception) -> Exception | str:
        if isinstance(exc, InvalidStatus) and 300 <= exc.response.status_code < 400:
            to = one_line(strip_credentials(exc.response.headers.get("Location", "nowhere")), 200)
            return RedirectRefused(f"answered {exc.response.status_code} redirecting to {to}; env connections "
                                   "never follow redirects: point ENV_URLS at the server itself")
        return exc


def _deadline(reply_s: Optional[float], connect_s: float, twice: bool = False) -> Optional[float]:
    """The whole call's bound past the reply's own (sending into a server that does not read is not bounded by it)."""
    if reply_s is None:
        return None
    return (2 if twice else 1) * (connect_s + reply_s) + 5


def ws_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if url.startswith(http):
            url = ws + url[len(http) :]
    if not url.startswith(("ws://", "wss://")):
        url = "ws://" + url
    return url if url.endswith("/ws") else url + "/ws"


class SessionClient:
    """One env-server session over `/ws`, driven synchronously from any thread."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 30.0,
        message_timeout_s: Optional[float] = _DEFAULT,
        reset_timeout_s: Optional[float] = _DEFAULT,
        ping_interval_s: Optional[float] = 20.0,
        ping_timeout_s: Optional[float] = 60.0,
        capacity_wait_s: float = 30.0,
        reconnect_wait_s: float = 90.0,
    ) -> None:
        self.base_url = base_url
        self.url = ws_url(base_url)
        self._replicas = ReplicaSet.for_url(base_url)  # None: connect to base_url itself (TLS)
        self._replica: Optional[str] = None  # the replica this session is counted on
        self.connect_timeout_s = connect_timeout_s
        # A step's reply bound (None: none; the pings still find a dead server) and a reset's (default: the same).
        self.message_timeout_s = DEFAULT_REPLY_TIMEOUT_S if message_timeout_s is _DEFAULT else message_timeout_s
        self.reset_timeout_s = self.message_timeout_s if reset_timeout_s is _DEFAULT else reset_timeout_s
        self.ping_interval_s = ping_interval_s
        self.ping_timeout_s = ping_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.reconnect_wait_s = reconnect_wait_s
        self._ws: Optional[ClientConnection] = None

    # -- sync API --------------------------------------------------------------------------------
    def reset(self, **data: Any) -> dict:
        """Start an episode, reconnecting first if the old session is gone (reaped, server restart).

        Waits, with backoff, up to capacity_wait_s for a free slot and up to reconnect_wait_s for a
        server that is down (crashed and being restarted by Compose or Swarm), then raises. A full or
        dead replica is left for another live one first. A reset with no reply within reset_timeout_s (a
        hung server, a half-open socket) is tried once more on a fresh session, elsewhere when another
        replica is live: no episode has started, so nothing is lost by it.
        """
        start = time.monotonic()
        delay = 0.25
        full: set[str] = set()
        timed_out = False
        while True:
            try:
                self._choose_replica(avoid=full)
                # a reset may reconnect once: two connects and two replies
                return self._run(self._reset(data), _deadline(self.reset_timeout_s, self.connect_timeout_s, twice=True))
            except TimeoutError:
                if timed_out:
                    raise
                timed_out = True  # the socket is closed already: the next try opens a fresh session
                if self._replicas is not None and self._replica is not None:
                    self._replicas.refused(self._replica)  # a hung replica is skipped for a while, unless alone
                continue
            except EnvServerError as e:
                # A slot may free soon (a dropped client, a reaped session): wait a little, then say so.
                if e.code != "CAPACITY_REACHED" or time.monotonic() + delay > start + self.capacity_wait_s:
                    raise
                if self._replica:
                    full.add(self._replica)
            except (ConnectionError, ConnectionClosed):
                if self._replicas is not None and self._replica is not None:
                    self._replicas.refused(self._replica)
                if time.monotonic() + delay > start + self.reconnect_wait_s:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 2.0)

    def _choose_replica(self, avoid: set[str]) -> None:
        """Before a reset: keep a live session unless a much less loaded replica is there; else pick one."""
        if self._replicas is None:
            return
        if self._replica is not None:
            if self.connected and not self._replicas.should_move(self._replica):
                return
            if not self.connected:
                self._replicas.lost()
        self.close()  # an episode boundary: nothing is lost by a fresh session elsewhere
        self._replica = self._replicas.acquire(avoid)
        self.url = ws_url(self._replica)

    def step(self, action: dict) -> dict:
        if not self.connected:
            raise EnvServerError(
                "The env-server session was lost mid-episode (server restart or idle timeout); "
                "this episode cannot continue. Stop calling tools.",
                code="SESSION_LOST",
            )
        return self._run(self._request({"type": "step", "data": action}, self.message_timeout_s),
                         _deadline(self.message_timeout_s, self.connect_timeout_s))

    def close(self) -> None:
        if self._ws is not None:
            try:
                self._run(self._close(), self.connect_timeout_s + 10)
            except Exception:
                pass
            self._ws = None
        if self._replicas is not None and self._replica is not None:
            self._replicas.release(self._replica)
            self._replica = None

    @property
    def shown_url(self) -> str:
        """The URL as messages, logs and the model may see it: without credentials."""
        return strip_credentials(self.url)

    @property
    def connected(self) -> bool:
        return self._ws is not None and self._ws.state is State.OPEN

    # -- async internals (run on the shared loop) --------------------------------------------------
    def _run(self, coro: Any, deadline_s: Optional[float]) -> Any:
        """Run `coro` on the shared loop and wait for it. Past the deadline it is cancelled and the session closed,
        so a reset that answers late cannot take a server slot nobody uses (the caller got a TimeoutError)."""
        loop = _background_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout=deadline_s)
        except concurrent.futures.TimeoutError:  # in 3.11 also the call's own (asyncio's) TimeoutError
            if future.done():
                raise  # the reply's bound: its message names it
            future.cancel()  # runs before the close below: the loop takes callbacks in order
            asyncio.run_coroutine_threadsafe(self._close(), loop)
            raise TimeoutError(f"{self.shown_url}: no answer within {deadline_s:g} s; the session was closed") from None

    async def _connect(self) -> None:
        if self._ws is not None:
            await self._close()
        try:
            self._ws = await open_session(
                self.url,
                open_timeout=self.connect_timeout_s,
                ping_interval=self.ping_interval_s,
                ping_timeout=self.ping_timeout_s,
            )
        except RedirectRefused as e:
            self._ws = None
            raise RedirectRefused(f"env server at {self.shown_url} {e}") from None
        except Exception as e:
            self._ws = None
            raise ConnectionError(f"Cannot reach env server at {self.shown_url}: "
                                  f"{one_line(strip_credentials(str(e)), 300)}") from e

    async def _close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            if ws.state is State.OPEN:
                await ws.send('{"type":"close"}')
            await asyncio.wait_for(ws.close(), 5)
        except Exception:
            pass

    async def _reset(self, data: dict) -> dict:
        for attempt in (0, 1):
            if not self.connected:
                await self._connect()
            try:
                return await self._request({"type": "reset", "data": data}, self.reset_timeout_s)
            except (ConnectionClosed, EnvServerError) as e:
                expired = isinstance(e, ConnectionClosed) or e.code in ("SESSION_EXPIRED", "SESSION_ERROR")
                if attempt == 0 and expired:
                    await self._close()  # reaped or restarted: one fresh session, then give up
                    continue
                if isinstance(e, EnvServerError) and e.code == "CAPACITY_REACHED":
                    await self._close()  # the server closes refused sockets
                raise
        raise AssertionError("unreachable")

    async def _request(self, message: dict, timeout_s: Optional[float]) -> dict:
        ws = self._ws
        assert ws is not None
        try:
            await ws.send(json.dumps(message))
        except ConnectionClosed:
            pass  # a refused/expired session sends an error frame then closes: read it below
        try:
            raw = await asyncio.wait_for(ws.recv(), timeout=timeout_s)
        except asyncio.TimeoutError:
            await self._close()  # a late reply would pair with the next request: drop the socket
            raise TimeoutError(f"No reply from {self.shown_url} within {timeout_s:g} s") from None
        except ConnectionClosed as e:
            if self._ws is ws:  # not a session opened since (a call abandoned on timeout fails late)
                self._ws = None
            if e.rcvd is None and e.sent is not None and e.sent.code == 1009:  # websockets refused a big frame
                raise UntrustedReply(f"{self.shown_url}: a reply over the {MAX_REPLY_BYTES:,}-byte limit; the "
                                     "session was closed") from None
            raise
        try:
            reply = loads_reply(raw)
            data = (reply.get("data") or {}) if isinstance(reply, dict) else None
            if not isinstance(data, dict):
                raise UntrustedReply("a reply that is not an OpenEnv frame (a JSON object with a `data` object)")
        except UntrustedReply as e:
            await self._close()  # whatever comes next on this socket cannot be trusted to pair with a request
            raise UntrustedReply(f"{self.shown_url}: {e}; the session was closed") from None
        if reply.get("type") == "error":
            raise EnvServerError(safe_text(data.get("message", "unknown error"), ERROR_CHARS),
                                 safe_text(data.get("code", "UNKNOWN"), 64), data)
        return data
