"""Bounded probes of an env server, which may be an image nobody here wrote.

Every probe has a total deadline (not a per-read timeout: a server trickling one byte a second resets those
forever), a cap on what it reads, and closes its WebSocket sessions all at once with a short close timeout (a
server that ignores close frames costs about a second in all, not seconds per session). Like the session client,
probes never go through HTTP(S)_PROXY: env servers sit on the stack's private network, and never follow a redirect
(one could send the trainer onto vLLM's network). Bodies and frames are parsed with a nesting cap
(envs.core.untrusted). Each failure is a ProbeError whose message is one line saying what hung or what was too big,
with no credentials from the URL.

Runs on the session client's background loop, so it works from any thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import ssl
from typing import Any, Awaitable, TypeVar

from envs.core.untrusted import UntrustedReply, loads_reply, one_line, strip_credentials

HEALTH_DEADLINE_S = 5.0
SCHEMA_DEADLINE_S = 15.0
MAX_HEALTH_BYTES = 64 << 10
MAX_SCHEMA_BYTES = 4 << 20  # a 10,000-field action schema is ~1 MB
CLOSE_TIMEOUT_S = 1.0
# A body trickled in small pieces (#63: 300 KB a byte a write took 3.9 s of the shared loop, each piece parsed in
# Python): past its first FREE_READS reads, a read under SMALL_READ_BYTES is followed by a TRICKLE_WAIT_S pause, so
# the socket gathers what comes meanwhile and a read takes it all (at most 1 / TRICKLE_WAIT_S reads a second).
FREE_READS = 16
SMALL_READ_BYTES = 16 << 10
TRICKLE_WAIT_S = 0.02
# Counting sessions: a base allowance plus a little per session (opening one is milliseconds on a live server).
CAPACITY_DEADLINE_S = 30.0
CAPACITY_DEADLINE_PER_SESSION_S = 0.25

T = TypeVar("T")


class ProbeError(RuntimeError):
    """One line: the URL and what went wrong (no answer in time, too big, not JSON)."""


class ProbeTimeout(ProbeError, TimeoutError):
    """No complete answer within the deadline (a TimeoutError too: a session client's callers read it as one)."""


def run_bounded(coro: Awaitable[T], deadline_s: float, what: str) -> T:
    """Run `coro` on the shared loop; past `deadline_s` it is cancelled (its sockets closed) and ProbeError raised."""
    from envs.core.client import _background_loop

    async def bounded() -> T:
        try:
            return await asyncio.wait_for(coro, deadline_s)
        except asyncio.TimeoutError:
            raise ProbeTimeout(f"{strip_credentials(what)}: no complete answer within {deadline_s:g} s") from None

    future = asyncio.run_coroutine_threadsafe(bounded(), _background_loop())
    try:
        return future.result(timeout=deadline_s + 4 * CLOSE_TIMEOUT_S + 5)
    except concurrent.futures.TimeoutError:  # the loop itself is stuck: never wait on it longer
        future.cancel()
        raise ProbeTimeout(f"{strip_credentials(what)}: no complete answer within {deadline_s:g} s") from None


# ------------------------------------------------------------------------------------------ HTTP
@functools.lru_cache(maxsize=1)
def _tls() -> ssl.SSLContext:
    """httpx's default verification (certifi's CAs), made once: each client made its own, ~30 ms of the shared loop
    per request (#63)."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


async def fetch(url: str, max_bytes: int, payload: Any = None) -> tuple[int, bytes]:
    """GET `url`, or POST `payload` as JSON to it; the body read up to `max_bytes`, a trickled one in few reads (the
    total time is the caller's deadline: run_bounded)."""
    import httpx

    shown = strip_credentials(url)
    async with httpx.AsyncClient(trust_env=False, timeout=None, follow_redirects=False, verify=_tls()) as client:
        request = client.stream("GET", url) if payload is None else client.stream("POST", url, json=payload)
        async with request as resp:
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise ProbeError(f"{shown}: answer of {int(declared):,} bytes, more than the {max_bytes:,} read")
            body = bytearray()
            reads = 0
            async for chunk in resp.aiter_bytes():
                body += chunk
                if len(body) > max_bytes:
                    raise ProbeError(f"{shown}: answer longer than the {max_bytes:,} bytes read")
                reads += 1
                if reads > FREE_READS and len(chunk) < SMALL_READ_BYTES:
                    await asyncio.sleep(TRICKLE_WAIT_S)  # a trickle: let the socket gather it (FREE_READS)
            return resp.status_code, bytes(body)


def get_json(url: str, deadline_s: float, max_bytes: int, payload: Any = None) -> tuple[int, Any]:
    """(status, parsed JSON body or None when it is not JSON) of a GET, or of a POST of `payload` as JSON.
    ProbeError: no answer in time, too big, unreachable."""
    import httpx

    try:
        status, body = run_bounded(fetch(url, max_bytes, payload), deadline_s, url)
    except httpx.HTTPError as exc:
        raise ProbeError(f"{strip_credentials(url)}: no answer ({type(exc).__name__})") from None
    try:
        return status, loads_reply(body)
    except UntrustedReply:  # not JSON, or nested too deep to be a health or schema answer
        return status, None


# ------------------------------------------------------------------------------------- WebSocket
def capacity_deadline_s(want: int) -> float:
    return CAPACITY_DEADLINE_S + CAPACITY_DEADLINE_PER_SESSION_S * want


async def _count_sessions(url: str, want: int, counted: list[int]) -> str | None:
    """Open sessions one by one until `want`, a refusal or a failure; each is asked for its state (a live one answers,
    a refused one gets CAPACITY_REACHED or is closed: OpenEnv refuses right after the handshake). All are closed at
    once on the way out, cancelled or not."""
    from websockets.exceptions import ConnectionClosed

    from envs.core.client import open_session, ws_url

    opened = []
    try:
        while counted[0] < want:
            try:
                ws = await open_session(ws_url(url), close_timeout=CLOSE_TIMEOUT_S, ping_interval=None,
                                        open_timeout=None)
            except Exception as exc:  # noqa: BLE001 - any failure to connect ends the count
                why = one_line(strip_credentials(str(exc)), 200)
                return f"opening session {counted[0] + 1}: {type(exc).__name__}: {why}"
            opened.append(ws)
            try:
                await ws.send('{"type": "state"}')
                reply = loads_reply(await ws.recv())
            except ConnectionClosed as exc:  # closed instead of answering: refused (or by us: a frame too big)
                if exc.rcvd is None and exc.sent is not None and exc.sent.code == 1009:
                    return f"session {counted[0] + 1} answered a frame over the size limit"
                return None
            except UntrustedReply as exc:
                return f"session {counted[0] + 1} answered {exc}"
            if isinstance(reply, dict) and ((reply.get("data") or {}).get("code") == "CAPACITY_REACHED"):
                return None
            counted[0] += 1
        return None
    finally:
        await _close_all(opened)


async def _close_all(sessions: list) -> None:
    """Close every session together; one that ignores the close frame is dropped after CLOSE_TIMEOUT_S."""
    if not sessions:
        return
    closing = [asyncio.ensure_future(ws.close()) for ws in sessions]
    _, late = await asyncio.wait(closing, timeout=3 * CLOSE_TIMEOUT_S)
    for task in late:
        task.cancel()
    for ws in sessions:
        if ws.transport is not None and not ws.transport.is_closing():
            ws.transport.abort()


def count_sessions(url: str, want: int, deadline_s: float | None = None) -> tuple[int, str | None]:
    """Sessions one replica accepts, counted up to `want` by opening them (then all closed again).

    Returns (accepted, None), or (accepted so far, one line saying what stopped the count)."""
    deadline_s = capacity_deadline_s(want) if deadline_s is None else deadline_s
    counted = [0]
    try:
        problem = run_bounded(_count_sessions(url, want, counted), deadline_s, f"{url} /ws")
    except ProbeError:
        return counted[0], (f"counting sessions stopped after {deadline_s:g} s at {counted[0]} accepted (the server "
                            "answers too slowly or not at all)")
    return counted[0], problem


def opens_session(url: str, deadline_s: float = HEALTH_DEADLINE_S) -> bool:
    """Whether the server's `/ws` accepts a WebSocket session (closed again at once); False for a refusal (a server
    with no such route answers the handshake 403 or 404), no answer in time, or any other failure."""
    from envs.core.client import open_session, ws_url

    async def handshake() -> bool:
        try:
            ws = await open_session(ws_url(url), close_timeout=CLOSE_TIMEOUT_S, ping_interval=None, open_timeout=None)
        except Exception:  # noqa: BLE001 - any failure to open is "no session here"
            return False
        await _close_all([ws])
        return True

    try:
        return run_bounded(handshake(), deadline_s, f"{url} /ws")
    except ProbeError:
        return False


# ------------------------------------------------------------------------------------ seed check
SEED_CHECK_DEADLINE_S = 30.0  # both resets together, connecting included (each reply within RESET_TIMEOUT_S too)


async def _reset_twice(url: str, data: dict, reply_s: float) -> tuple[Any, Any]:
    """One session, two resets with the same `data`: the two replies' `data` (an error frame raises ProbeError)."""
    from envs.core.client import open_session, ws_url

    shown = strip_credentials(ws_url(url))
    ws = await open_session(ws_url(url), close_timeout=CLOSE_TIMEOUT_S, ping_interval=None, open_timeout=None)
    try:
        replies = []
        for n in (1, 2):
            await ws.send(json.dumps({"type": "reset", "data": data}))
            try:
                reply = loads_reply(await asyncio.wait_for(ws.recv(), reply_s))
            except asyncio.TimeoutError:
                raise ProbeError(f"{shown}: reset {n} got no answer within {reply_s:g} s") from None
            if not isinstance(reply, dict) or not isinstance(reply.get("data"), dict):
                raise ProbeError(f"{shown}: reset {n} answered something that is not an OpenEnv frame")
            if reply.get("type") == "error":
                raise ProbeError(f"{shown}: reset {n} answered an error: {one_line(reply['data'].get('message'), 160)}")
            replies.append(reply["data"])
        return replies[0], replies[1]
    finally:
        await _close_all([ws])


def reset_twice(url: str, data: dict, reply_s: float, deadline_s: float | None = None) -> tuple[Any, Any]:
    """The replies to two resets with the same kwargs on one fresh session (closed on every path), bounded as a whole
    by `deadline_s` (default SEED_CHECK_DEADLINE_S) and each reply by `reply_s`. ProbeError: one line saying what hung,
    failed or was too big."""
    from websockets.exceptions import ConnectionClosed

    deadline_s = SEED_CHECK_DEADLINE_S if deadline_s is None else deadline_s
    try:
        return run_bounded(_reset_twice(url, data, min(reply_s, deadline_s)), deadline_s, f"{url} /ws")
    except (ProbeError, UntrustedReply) as exc:
        raise ProbeError(one_line(strip_credentials(str(exc)), 300)) from None
    except ConnectionClosed as exc:  # refused (no capacity), or closed on a frame over the size limit
        why = ("a reply over the size limit" if exc.rcvd is None and exc.sent is not None and exc.sent.code == 1009
               else "the server closed the session")
        raise ProbeError(f"{strip_credentials(url)}: {why}") from None
    except Exception as exc:  # noqa: BLE001 - cannot connect, a refused handshake: one line, never a traceback
        raise ProbeError(f"{strip_credentials(url)}: {type(exc).__name__}: "
                         f"{one_line(strip_credentials(str(exc)), 200)}") from None
