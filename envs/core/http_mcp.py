"""One OpenEnv MCP session over HTTP (`POST /mcp`), for servers that serve no `/ws` (envs.generic.http_only).

The transport `http-mcp`, next to `/ws` sessions (envs.core.client.SessionClient, transport `websocket`), with the
surface the tool classes and the trainer use (reset, step, close, shown_url, connected, the two reply bounds).
OpenEnv 0.10.0's `POST /mcp` (openenv/core/env_server/http_server.py `mcp_handler`):
  * `openenv/session/create` -> `{"session_id": ...}`: a fresh env of the server's own (its factory; no reset
    arguments), counted against its session cap (over it: a JSON-RPC error whose `data` has `max_sessions`);
  * `tools/call` with `params.session_id` runs on that env; its result is the tool's `CallToolResult` (an
    `MCPEnvironment`: no reward, no done) or the env's `CallToolObservation` (an env that takes `CallToolAction`
    in `step()`: reward and done included, used here);
  * `openenv/session/close` with `session_id` ends it; an unknown id answers "Unknown session_id: ...".
So an episode is a session: reset closes the old one and creates a new one. Each session stays on one replica (a
request sent to the service name could reach another). Replies are read with the probes' bounds and the untrusted
reply caps (MAX_REPLY_BYTES, nesting, no redirects, no proxies: envs.core.probe, envs.core.untrusted).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Optional

from envs.core import probe
from envs.core.client import DEFAULT_REPLY_TIMEOUT_S, EnvServerError, stalled
from envs.core.replicas import ReplicaSet
from envs.core.untrusted import MAX_REPLY_BYTES, UntrustedReply, loads_reply, one_line, strip_credentials

TRANSPORT = "http-mcp"
CLOSE_TIMEOUT_S = 5.0
ERROR_CHARS = 2000
_DEFAULT: Any = object()


def rpc(base_url: str, method: str, params: dict, timeout_s: Optional[float], request_id: int = 1) -> dict:
    """The JSON-RPC `result` of one POST to `base_url`/mcp. Raises TimeoutError (no reply in time), ConnectionError
    (no answer, or not 200), UntrustedReply (too big, not JSON, not JSON-RPC), EnvServerError (a JSON-RPC error:
    code CAPACITY_REACHED when the server is full, SESSION_EXPIRED for a session it no longer knows, else RPC_<n>)."""
    import httpx

    url = f"{base_url.rstrip('/')}/mcp"
    shown = strip_credentials(url)
    payload = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": params}
    try:
        status, raw = probe.run_bounded(probe.fetch(url, MAX_REPLY_BYTES, payload),
                                        DEFAULT_REPLY_TIMEOUT_S if timeout_s is None else timeout_s, url)
    except probe.ProbeTimeout:
        raise
    except probe.ProbeError as exc:  # too big
        raise UntrustedReply(str(exc)) from None
    except httpx.HTTPError as exc:
        raise ConnectionError(f"{shown}: no answer ({type(exc).__name__})") from None
    if status != 200:
        raise ConnectionError(f"{shown} answered {status}")
    body = loads_reply(raw)
    if not isinstance(body, dict) or not ("result" in body or "error" in body):
        raise UntrustedReply(f"{shown} answered {one_line(body, 120)}: not a JSON-RPC reply")
    error = body.get("error")
    if error:
        error = error if isinstance(error, dict) else {"message": error}
        message = one_line(error.get("message") or error, ERROR_CHARS)
        data = error.get("data") if isinstance(error.get("data"), dict) else {}
        code = ("CAPACITY_REACHED" if "max_sessions" in data else
                "SESSION_EXPIRED" if message.startswith("Unknown session_id") else f"RPC_{error.get('code')}")
        raise EnvServerError(message, code, data)
    result = body.get("result")
    if not isinstance(result, dict):
        raise UntrustedReply(f"{shown} answered a result that is not an object: {one_line(result, 120)}")
    return result


class McpHttpSession:
    """One env-server session over HTTP `POST /mcp`, driven synchronously from any thread."""

    transport = TRANSPORT

    def __init__(self, base_url: str, *, message_timeout_s: Optional[float] = _DEFAULT,
                 reset_timeout_s: Optional[float] = _DEFAULT, capacity_wait_s: float = 30.0,
                 reconnect_wait_s: float = 90.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url  # the replica the current session lives on, once chosen
        self._replicas = ReplicaSet.for_url(base_url)  # None: keep the host name (TLS)
        self._replica: Optional[str] = None
        self.message_timeout_s = DEFAULT_REPLY_TIMEOUT_S if message_timeout_s is _DEFAULT else message_timeout_s
        self.reset_timeout_s = self.message_timeout_s if reset_timeout_s is _DEFAULT else reset_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.reconnect_wait_s = reconnect_wait_s
        self.session_id: Optional[str] = None
        self._ids = itertools.count(1)

    def _rpc(self, method: str, params: dict, timeout_s: Optional[float]) -> dict:
        return rpc(self.url, method, params, timeout_s, next(self._ids))

    # -- the surface of SessionClient the tool classes use -----------------------------------------
    def reset(self, **data: Any) -> dict:
        """A new episode: the old session closed, a new one created (on the least-loaded replica). `data` (a row's
        reset arguments) is not sent: openenv/session/create takes none. Waits, with backoff, up to capacity_wait_s
        for a free slot and up to reconnect_wait_s for a server that is down, then raises."""
        self.close()
        start, delay = time.monotonic(), 0.25
        while True:
            if self._replicas is not None:
                self._replica = self._replicas.acquire()
                self.url = self._replica
            try:
                result = self._rpc("openenv/session/create", {}, self.reset_timeout_s)
                session_id = result.get("session_id")
                if not isinstance(session_id, str) or not session_id:
                    raise UntrustedReply(f"{self.shown_url}/mcp: openenv/session/create answered no session_id: "
                                         f"{one_line(result, 120)}")
                self.session_id = session_id
                return {"observation": {}, "reward": None, "done": False}
            except EnvServerError as exc:
                self._release()
                if exc.code != "CAPACITY_REACHED" or time.monotonic() + delay > start + self.capacity_wait_s:
                    raise
                stalled(self.shown_url, "capacity", f"no free session slot ({exc}); waiting up to "
                        f"{self.capacity_wait_s:g} s for one")
            except ConnectionError as exc:
                if self._replicas is not None and self._replica is not None:
                    self._replicas.refused(self._replica)
                self._release()
                if time.monotonic() + delay > start + self.reconnect_wait_s:
                    raise
                stalled(self.shown_url, "connect", f"{one_line(str(exc), 160)}; retrying for up to "
                        f"{self.reconnect_wait_s:g} s")
            except Exception:
                self._release()
                raise
            time.sleep(delay)  # backoff between retries of a full or restarting server
            delay = min(delay * 2, 2.0)

    def step(self, action: dict) -> dict:
        """One MCP tool call in this session, as a `/ws` step reply ({"observation", "reward", "done"}). A JSON-RPC
        error about the call (an unknown tool, bad arguments) is the observation's `error`, for the model to see;
        one about the session (reaped, server restarted) raises EnvServerError SESSION_EXPIRED."""
        if action.get("type") != "call_tool":
            raise ValueError(f"an {TRANSPORT} session takes MCP tool calls only, not {one_line(action, 80)}")
        if self.session_id is None:
            raise EnvServerError("No episode yet: send a reset first", "SESSION_EXPIRED")
        params = {"name": action.get("tool_name"), "arguments": action.get("arguments") or {},
                  "session_id": self.session_id}
        try:
            result = self._rpc("tools/call", params, self.message_timeout_s)
        except EnvServerError as exc:
            if exc.code in ("SESSION_EXPIRED", "CAPACITY_REACHED"):
                raise
            return {"observation": {"error": {"message": str(exc)}}, "reward": None, "done": False}
        if "tool_name" in result and "result" in result:  # a CallToolObservation: the env's step() ran
            return {"observation": result, "reward": result.get("reward"), "done": bool(result.get("done"))}
        return {"observation": {"result": result}, "reward": None, "done": False}

    def close(self) -> None:
        """End the session (bounded, never raises); the next reset creates a new one."""
        session_id, self.session_id = self.session_id, None
        if session_id is not None:
            try:
                self._rpc("openenv/session/close", {"session_id": session_id}, CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - a dead server or a reaped session: nothing left to close
                pass
        self._release()

    def _release(self) -> None:
        if self._replicas is not None and self._replica is not None:
            self._replicas.release(self._replica)
            self._replica = None

    @property
    def shown_url(self) -> str:
        return strip_credentials(self.url)

    @property
    def connected(self) -> bool:
        return self.session_id is not None


def count_sessions(url: str, want: int, deadline_s: Optional[float] = None) -> tuple[int, Optional[str]]:
    """Like envs.core.probe.count_sessions for `/mcp` sessions: created one by one up to `want`, then all closed."""
    deadline = time.monotonic() + (probe.capacity_deadline_s(want) if deadline_s is None else deadline_s)
    opened: list[str] = []
    problem = None
    try:
        while len(opened) < want:
            left = deadline - time.monotonic()
            if left <= 0:
                problem = f"counting sessions stopped at {len(opened)} accepted (the server answers too slowly)"
                break
            try:
                session_id = rpc(url, "openenv/session/create", {}, left).get("session_id")
            except EnvServerError as exc:
                problem = None if exc.code == "CAPACITY_REACHED" else f"session {len(opened) + 1}: {exc}"
                break
            except (TimeoutError, ConnectionError, UntrustedReply) as exc:
                problem = f"opening session {len(opened) + 1}: {one_line(str(exc), 200)}"
                break
            if not isinstance(session_id, str) or not session_id:
                problem = f"session {len(opened) + 1}: openenv/session/create answered no session_id"
                break
            opened.append(session_id)
    finally:
        for session_id in opened:
            try:
                rpc(url, "openenv/session/close", {"session_id": session_id}, CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - best effort: the server's reaper ends what is left
                pass
    return len(opened), problem
