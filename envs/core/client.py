"""A small synchronous client for OpenEnv `/ws` sessions, shared by the TRL tool classes.

TRL builds one tool-class instance per rollout (hundreds per process) and calls them synchronously.
One thread-per-connection client would mean hundreds of threads; instead every connection lives on
ONE background asyncio loop per process, which also answers keepalive pings while the trainer is busy.
Speaks the same frames as openenv's `EnvClient`: {"type": "reset"|"step"|"close", "data": {...}}.
A session given a service name connects to one of its replicas (envs.core.replicas: least-loaded,
re-resolved when replicas die or are added), chosen again whenever it (re)connects.
The server may be an image nobody here wrote (envs.core.untrusted): redirects are refused, replies are capped at
MAX_REPLY_BYTES and MAX_REPLY_DEPTH, error texts are escaped and trimmed, and no message quotes a URL's credentials.

Faults in flight (#33): a reset rides out a restarting server, a full one and one reply that never came (retries);
an episode whose connection is lost before its first step was answered is replayed on a fresh session (its reset
again, checked to answer the same, then the step), since an OpenEnv session lives and dies with its socket and no
step of it has been seen yet; so is one whose first step is SLOW_REPLY_S late on a server that answers no ping
(stopped, or a half-open link), while a slow tool on a live server is waited for; every stall the client rides
out or gives up on says so in one `stalled:` log line (what, where, which bound, what happens next), at most one
per replica and kind every STALL_LOG_EVERY_S (a replay's line: every time, one episode's fate). The line names the
connection by its local address, `(from HOST:PORT)`, as the env server's own log names its peer: which of a replica's
sessions stalled (bench/chaos.py credits each fault only with the lines of its own links).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from typing import Any, Optional

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.protocol import State

from envs.core.replicas import ReplicaSet
from envs.core.untrusted import MAX_REPLY_BYTES, UntrustedReply, loads_reply, one_line, safe_text, strip_credentials
from envs.core.ws_bounds import BoundedConnection

ERROR_CHARS = 2000  # an env's error text kept (the tool binding trims it again to ENV_OBSERVATION_CHARS)
# A reply's bound when the caller names none (probes, tests). The trainer always names its own: TOOL_TIMEOUT_S for
# steps, RESET_TIMEOUT_S for resets (trainer.rollouts.envs_binding); read at construction, so a test can lower it.
DEFAULT_REPLY_TIMEOUT_S = 120.0
_DEFAULT: Any = object()

_loop: Optional[asyncio.AbstractEventLoop] = None
_loop_lock = threading.Lock()
_parse_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
# websockets stops reading a session's socket once more frames than this wait unread: one frame at most here, ~1.2 MiB
# per session (its default, 16, made the 1 MiB reply cap ~18 MiB per session: 256 hostile sessions ~4.6 GiB). One
# request is answered by one frame; a frame waiting when a request is sent was not asked for: it ends the session.
MAX_QUEUED_FRAMES = 0
PARSE_INLINE_CHARS = 64 << 10  # a reply this small parses in well under a millisecond: on the loop

log = logging.getLogger("envs.client")
STALL_LOG_EVERY_S = 5.0  # per replica and kind: a server's crash closes all its sessions at once
SLOW_REPLY_S = 1.5  # a reply that took longer is a stall the client rode out: said (normal replies take ms)
PONG_WAIT_S = 1.5  # a live server's protocol layer answers a ping in ms, even while its env works on a step
# Error frames a server sends before closing a socket, asked or not: read as the error a request would have got
UNASKED_ERROR_CODES = ("SESSION_EXPIRED", "SESSION_ERROR", "CAPACITY_REACHED")
CLOSE_HANDSHAKE_S = 5.0  # a session's close frame sent and answered; then (and on every other path) the socket is aborted
REPLAY_REPLY_S = 1.5  # a replay's connect and reset reply each (two tries): it must fit in the step's bound
ABNORMAL_CLOSE = frozenset({1006, 1011})  # no close frame (a crash, a dropped link) / keepalive ping timeout
_stall_logged: dict[tuple[str, str], float] = {}
_stall_lock = threading.Lock()


def stalled(where: str, kind: str, text: str, every: bool = False, conn: Optional[str] = None) -> None:
    """The one-line diagnosis of a stall (bench/chaos.py counts them): `where` a replica's URL, `kind` what stalled,
    `conn` the connection's local HOST:PORT (None: none was open). `every`: said each time (one episode's fate), not
    once per burst (the burst is the replica's: `conn` is not part of it)."""
    now = time.monotonic()
    with _stall_lock:
        if not every and now - _stall_logged.get((where, kind), -STALL_LOG_EVERY_S) < STALL_LOG_EVERY_S:
            return
        _stall_logged[(where, kind)] = now
    log.warning("stalled: %s%s: %s", where, f" (from {conn})" if conn else "", text)


def _local(ws: ClientConnection) -> Optional[str]:
    """A connection's local HOST:PORT (what the server, or a proxy, sees as its peer), None when not known."""
    try:
        host, port = ws.local_address[:2]
    except (TypeError, ValueError, AttributeError):
        return None
    return f"{host}:{port}"


def _background_loop() -> asyncio.AbstractEventLoop:
    global _loop
    with _loop_lock:
        if _loop is None or _loop.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="envs-ws-loop", daemon=True).start()
            _loop = loop
        return _loop


def _parser() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread that parses big replies: json.loads of 1 MiB takes up to ~0.1 s (floats, keys) and on the shared
    loop each one would hold every other env's sessions (#44); in a thread the loop gets the GIL back between them."""
    global _parse_pool
    with _loop_lock:
        if _parse_pool is None:
            _parse_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="envs-reply-parse")
        return _parse_pool


class EnvServerError(RuntimeError):
    """An error frame from the env server (`code` is openenv's WSErrorCode or ours)."""

    def __init__(self, message: str, code: str = "UNKNOWN", data: Optional[dict] = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data or {}


class Unresponsive(ConnectionError):
    """A step's reply is late and the server does not answer a ping either (stopped, or the link is half-open)."""


class RedirectRefused(UntrustedReply):
    """An env server answered the WebSocket handshake with a redirect (a setup error: reset does not retry it)."""


class open_session(connect):
    """`websockets.asyncio.client.connect` for env servers: never through HTTP(S)_PROXY (they sit on the private
    network), replies up to MAX_REPLY_BYTES, at most MAX_QUEUED_FRAMES of them buffered, small frames and unsent bytes
    bounded (envs.core.ws_bounds), and no redirects (websockets follows up to 10, across hosts: an env answering
    `302 Location: ws://vllm:8000/...` would bounce the trainer onto agentnet)."""

    def __init__(self, uri: str, **kwargs: Any) -> None:
        kwargs.setdefault("max_size", MAX_REPLY_BYTES)
        kwargs.setdefault("max_queue", MAX_QUEUED_FRAMES)
        kwargs.setdefault("create_connection", BoundedConnection)
        super().__init__(uri, proxy=None, **kwargs)

    def process_redirect(self, exc: Exception) -> Exception | str:
        if isinstance(exc, InvalidStatus) and 300 <= exc.response.status_code < 400:
            to = one_line(strip_credentials(exc.response.headers.get("Location", "nowhere")), 200)
            return RedirectRefused(f"answered {exc.response.status_code} redirecting to {to}; env connections "
                                   "never follow redirects: point ENV_URLS at the server itself")
        return exc


def _queued_frames(ws: ClientConnection) -> int:
    """Frames received and not yet read (websockets' Assembler queue; 0 where a version lacks it)."""
    return len(getattr(getattr(ws, "recv_messages", None), "frames", ()))


def _deadline(reply_s: Optional[float], connect_s: float, twice: bool = False) -> Optional[float]:
    """The whole call's bound past the reply's own (sending into a server that does not read is not bounded by it)."""
    if reply_s is None:
        return None
    return (2 if twice else 1) * (connect_s + reply_s) + 5


def _bound(seconds: Optional[float]) -> str:
    return "none" if seconds is None else f"{seconds:g} s"


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
        self._conn: Optional[str] = None  # the last connection's local HOST:PORT, kept after it closed (stall lines)
        self._closing: set[int] = set()  # ids of sockets this client closes itself (the idle-close watch skips them)
        # The current episode's reset (its data and reply) while none of its steps has been answered: what a lost
        # connection replays on a fresh session (module docstring). None once a step was answered or tried in vain.
        self._replayable: Optional[tuple[dict, dict]] = None
        self._closes = 0  # close() calls: a step whose socket the caller closed (TOOL_TIMEOUT_S gave up) is not replayed

    # -- sync API --------------------------------------------------------------------------------
    def reset(self, **data: Any) -> dict:
        """Start an episode, reconnecting first if the old session is gone (reaped, server restart).

        Waits, with backoff, up to capacity_wait_s for a free slot and up to reconnect_wait_s for a
        server that is down (crashed and being restarted by Compose or Swarm), then raises. A full or
        dead replica is left for another live one first. A reset with no reply within reset_timeout_s (a
        hung server, a half-open socket) is tried once more on a fresh session, elsewhere when another
        replica is live: no episode has started, so nothing is lost by it.
        """
        return self._reset_within(data, self.capacity_wait_s, self.reconnect_wait_s)

    def _reset_within(self, data: dict, capacity_wait_s: float, reconnect_wait_s: float) -> dict:
        start = time.monotonic()
        delay = 0.25
        full: set[str] = set()
        timed_out = False
        self._replayable = None
        while True:
            try:
                self._choose_replica(avoid=full)
                # a reset may reconnect once: two connects and two replies
                reply = self._run(self._reset(data),
                                  _deadline(self.reset_timeout_s, self.connect_timeout_s, twice=True))
                self._replayable = (dict(data), reply)
                return reply
            except TimeoutError:
                if timed_out:
                    stalled(self.shown_url, "reset", f"no reply to a reset twice (RESET_TIMEOUT_S "
                            f"{_bound(self.reset_timeout_s)}); this episode goes on without its env, left out",
                            conn=self._conn)
                    raise
                timed_out = True  # the socket is closed already: the next try opens a fresh session
                stalled(self.shown_url, "reset", f"no reply to a reset within RESET_TIMEOUT_S "
                        f"({_bound(self.reset_timeout_s)}); the session was closed; trying once more on a fresh one"
                        + (" on another replica" if self._replicas is not None else ""), conn=self._conn)
                if self._replicas is not None and self._replica is not None:
                    self._replicas.refused(self._replica)  # a hung replica is skipped for a while, unless alone
                continue
            except EnvServerError as e:
                # A slot may free soon (a dropped client, a reaped session): wait a little, then say so.
                if e.code != "CAPACITY_REACHED" or time.monotonic() + delay > start + capacity_wait_s:
                    raise
                stalled(self.shown_url, "capacity", f"no free session slot (CAPACITY_REACHED); waiting up to "
                        f"{capacity_wait_s:g} s for one, on another replica first", conn=self._conn)
                if self._replica:
                    full.add(self._replica)
            except (ConnectionError, ConnectionClosed) as e:
                if self._replicas is not None and self._replica is not None:
                    self._replicas.refused(self._replica)
                if time.monotonic() + delay > start + reconnect_wait_s:
                    raise
                stalled(self.shown_url, "connect", f"connection lost ({one_line(str(e), 160) or type(e).__name__}); "
                        f"reconnecting for up to {reconnect_wait_s:g} s")
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
        replay, self._replayable = self._replayable, None  # a step tried: whatever happens, no replay after it
        started = time.monotonic()
        if not self.connected:
            if replay is None:
                raise EnvServerError(
                    "The env-server session was lost mid-episode (server restart or idle timeout); "
                    "this episode cannot continue. Stop calling tools.",
                    code="SESSION_LOST",
                )
            self._replay(replay, "before the episode's first step", started)
        closes = self._closes
        try:
            return self._step(action, probe=replay is not None)
        except (ConnectionClosed, Unresponsive, EnvServerError) as e:
            # SESSION_EXPIRED: the server reaped the session while the policy wrote its first call; it answers the
            # next frame with that error, then closes (envs/core/server.py). Nothing of the episode was answered.
            expired = isinstance(e, EnvServerError) and e.code == "SESSION_EXPIRED"
            if isinstance(e, EnvServerError) and not expired:
                raise
            if replay is None or self._closes != closes:  # closed by the caller, who gave up on this episode
                raise
            when = ("the episode's first step had no reply and the server no pong" if isinstance(e, Unresponsive)
                    else "the session expired (SESSION_TIMEOUT_S) before the episode's first step" if expired
                    else "during the episode's first step, before its reply")
            if isinstance(e, Unresponsive) and self._replicas is not None and self._replica is not None:
                self._replicas.refused(self._replica)  # a stopped replica: the replay goes elsewhere
            self._replay(replay, when, started)
            return self._step(action, probe=False)

    def _step(self, action: dict, probe: bool = False) -> dict:
        """One step. `probe`: when no reply came within SLOW_REPLY_S, ping the server; no pong within PONG_WAIT_S
        (a stopped server, a half-open link) raises Unresponsive (the socket closed), a pong keeps waiting (a slow
        tool on a live server)."""
        return self._run(self._request({"type": "step", "data": action}, self.message_timeout_s,
                                       probe_after_s=SLOW_REPLY_S if probe else None),
                         _deadline(self.message_timeout_s, self.connect_timeout_s))

    def _replay(self, replay: tuple[dict, dict], when: str, started: float) -> None:
        """The episode's reset again on a fresh session (within the step's own bound), which must answer as the first
        did: the session died with its socket and no step of it was answered, so the episode goes on as if nothing
        happened. Else SESSION_LOST, as before."""
        data, first = replay
        lost_at, lost_conn = self.shown_url, self._conn
        budget = self.message_timeout_s if self.message_timeout_s is not None else self.reconnect_wait_s
        # A replay is worth it only inside the step's own bound: each connect and reset reply gets REPLAY_REPLY_S (a
        # healthy server answers in ms), so one that lands on a stopped server is given up on in time for another.
        bounds = self.connect_timeout_s, self.reset_timeout_s
        self.connect_timeout_s = min(self.connect_timeout_s, REPLAY_REPLY_S)
        self.reset_timeout_s = REPLAY_REPLY_S if self.reset_timeout_s is None else min(self.reset_timeout_s,
                                                                                      REPLAY_REPLY_S)
        try:
            again = self._reset_within(data, min(self.capacity_wait_s, budget), min(self.reconnect_wait_s, budget))
        except (EnvServerError, ConnectionError, ConnectionClosed, TimeoutError, UntrustedReply) as e:
            stalled(lost_at, "replay", f"connection lost {when}; could not start the episode again on a fresh "
                    f"session ({one_line(str(e), 160)}); it is left out", every=True, conn=lost_conn)
            raise EnvServerError(f"The env-server session was lost mid-episode and could not be re-established "
                                 f"({one_line(str(e), 300)}); this episode cannot continue. Stop calling tools.",
                                 code="SESSION_LOST") from None
        finally:
            self.connect_timeout_s, self.reset_timeout_s = bounds
        self._replayable = None
        if again != first:
            stalled(lost_at, "replay", f"connection lost {when}; the env's reset answered differently on a fresh "
                    "session (not reproducible), so the episode is left out", every=True, conn=lost_conn)
            raise EnvServerError("The env-server session was lost mid-episode; this episode cannot continue. "
                                 "Stop calling tools.", code="SESSION_LOST")
        stalled(lost_at, "replay", f"connection lost {when}; the episode's reset was replayed on a fresh session "
                f"({self.shown_url}) {time.monotonic() - started:.1f} s into the step, which goes on", every=True,
                conn=lost_conn)

    def close(self) -> None:
        self._closes += 1
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
    def connection(self) -> Optional[str]:
        """The session's connection (the last one, once closed) by its local HOST:PORT, as its server sees it."""
        return self._conn

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
        self._conn = None
        try:
            self._ws = await open_session(
                self.url,
                open_timeout=self.connect_timeout_s,
                ping_interval=self.ping_interval_s,
                ping_timeout=self.ping_timeout_s,
            )
            self._conn = _local(self._ws)
            asyncio.get_running_loop().create_task(self._watch(self._ws, self.shown_url, self._conn))
        except RedirectRefused as e:
            self._ws = None
            raise RedirectRefused(f"env server at {self.shown_url} {e}") from None
        except Exception as e:
            self._ws = None
            raise ConnectionError(f"Cannot reach env server at {self.shown_url}: "
                                  f"{one_line(strip_credentials(str(e)), 300)}") from e

    async def _watch(self, ws: ClientConnection, where: str, conn: Optional[str]) -> None:
        """Say when a connection dies under the client (a crashed server, a dropped link, keepalive pings unanswered
        on a half-open one), not when the client or an idle-reaping server closes it in order."""
        await ws.wait_closed()
        if id(ws) in self._closing:
            self._closing.discard(id(ws))
            return
        code = ws.close_code
        if getattr(ws, "abort_reason", None):
            stalled(where, "flood", f"{ws.abort_reason}; the session's episode is left out or replayed", conn=conn)
        elif code in ABNORMAL_CLOSE:
            why = "keepalive pings unanswered" if code == 1011 else "closed without a close frame"
            stalled(where, "closed", f"connection lost ({why}, code {code}); an episode that has made no step "
                    "yet is replayed on a fresh session, one that has is left out, the next reset reconnects",
                    conn=conn)

    async def _recv_probing(self, ws: ClientConnection, timeout_s: Optional[float], probe_after_s: float) -> Any:
        """`ws.recv()` within `timeout_s`, asking the server for a pong once the reply is `probe_after_s` late
        (websockets: a cancelled recv loses no data; a ping is answered by the server's protocol layer, not the env)."""
        start = time.monotonic()
        recv = asyncio.ensure_future(ws.recv())
        done, _ = await asyncio.wait({recv}, timeout=probe_after_s)
        if not done:
            try:
                pong = await ws.ping()
                done, _ = await asyncio.wait({recv, pong}, timeout=PONG_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
            except ConnectionClosed:
                done = set()
            if not done:  # neither the reply nor a pong: nobody is there
                recv.cancel()
                await asyncio.gather(recv, return_exceptions=True)
                self._drop()
                raise Unresponsive(f"{self.shown_url}: no reply within {probe_after_s:g} s and no pong within "
                                   f"{PONG_WAIT_S:g} s; the session was closed")
            left = None if timeout_s is None else max(0.0, timeout_s - (time.monotonic() - start))
            return await asyncio.wait_for(recv, timeout=left)
        return recv.result()

    def _drop(self) -> None:
        """Close the socket at once, without a close handshake: a server that answers nothing would hold `_close` for
        its 5 s (on the shared loop)."""
        ws, self._ws = self._ws, None
        if ws is not None:
            self._closing.add(id(ws))
            ws.transport.abort()

    async def _close(self) -> None:
        """The session's close frame and handshake within CLOSE_HANDSHAKE_S, skipped where the server is not reading
        (unsent bytes wait) or unasked frames stopped our reading; the socket aborted in the end on every path, even
        cancelled (#63: a close blocked in `ws.send` into a server that stopped reading, and its socket stayed open)."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        self._closing.add(id(ws))
        try:
            if ws.state is State.OPEN and not _queued_frames(ws) and not ws.transport.get_write_buffer_size():
                await asyncio.wait_for(self._close_handshake(ws), CLOSE_HANDSHAKE_S)
        except asyncio.TimeoutError:  # the caller waited that long on a server that answers nothing: a stall
            stalled(self.shown_url, "close", f"no answer to the session's close within {CLOSE_HANDSHAKE_S:g} s (a "
                    "stopped server or a half-open link); the socket was aborted", conn=_local(ws) or self._conn)
        except Exception:
            pass
        finally:
            ws.transport.abort()

    @staticmethod
    async def _close_handshake(ws: ClientConnection) -> None:
        await ws.send('{"type":"close"}')
        await ws.close()

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

    async def _unasked(self, ws: ClientConnection) -> None:
        """A frame came while no request was out; the session is dropped. An error frame a server sends unasked before
        it closes (OpenEnv's and envs.core.server's: a reaper's SESSION_EXPIRED/SESSION_ERROR, stock create_app's
        CAPACITY_REACHED on connecting to a full server) is what a request would have got anyway: raised as that
        EnvServerError (a reset then opens a fresh session, or waits for capacity). Anything else: UntrustedReply."""
        try:
            raw = await asyncio.wait_for(ws.recv(), PONG_WAIT_S)  # queued already (or its message's last fragments)
            frame = loads_reply(raw) if len(raw) <= PARSE_INLINE_CHARS else None
        except (asyncio.TimeoutError, ConnectionClosed, UntrustedReply):
            frame = None
        self._drop()
        data = frame.get("data") if isinstance(frame, dict) and frame.get("type") == "error" else None
        if isinstance(data, dict) and data.get("code") in UNASKED_ERROR_CODES:
            raise EnvServerError(safe_text(data.get("message", "session expired"), ERROR_CHARS), data["code"], data)
        raise UntrustedReply(f"{self.shown_url}: sent a frame nobody asked for (an OpenEnv server answers each "
                             "request once); the session was closed")

    async def _request(self, message: dict, timeout_s: Optional[float], probe_after_s: Optional[float] = None) -> dict:
        ws = self._ws
        assert ws is not None
        if _queued_frames(ws):  # it would pair with this request as its reply
            await self._unasked(ws)
        try:
            await ws.send(json.dumps(message))
        except ConnectionClosed:
            pass  # a refused/expired session sends an error frame then closes: read it below
        sent_at = time.monotonic()
        try:
            if probe_after_s is not None and (timeout_s is None or timeout_s > probe_after_s + PONG_WAIT_S):
                raw = await self._recv_probing(ws, timeout_s, probe_after_s)
            else:
                raw = await asyncio.wait_for(ws.recv(), timeout=timeout_s)
        except asyncio.TimeoutError:
            self._drop()  # a late reply would pair with the next request: drop the socket (no close handshake)
            raise TimeoutError(f"No reply from {self.shown_url} within {timeout_s:g} s") from None
        except ConnectionClosed as e:
            if self._ws is ws:  # not a session opened since (a call abandoned on timeout fails late)
                self._ws = None
            if getattr(ws, "abort_reason", None):
                raise UntrustedReply(f"{self.shown_url}: {ws.abort_reason}") from None
            if e.rcvd is None and e.sent is not None and e.sent.code == 1009:  # websockets refused a big frame
                raise UntrustedReply(f"{self.shown_url}: a reply over the {MAX_REPLY_BYTES:,}-byte limit; the "
                                     "session was closed") from None
            raise
        took = time.monotonic() - sent_at
        if took > SLOW_REPLY_S:
            stalled(self.shown_url, "slow", f"a {message.get('type')} reply took {took:.1f} s (bound "
                    f"{_bound(timeout_s)}); answered, the episode goes on", conn=self._conn)
        try:
            reply = loads_reply(raw) if len(raw) <= PARSE_INLINE_CHARS else \
                await asyncio.get_running_loop().run_in_executor(_parser(), loads_reply, raw)
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
