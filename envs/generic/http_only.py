"""OpenEnv servers that serve only the HTTP routes: recognised; trained over MCP sessions where they offer them
(transport `http-mcp`, envs.core.http_mcp), else refused with the reason and the fix.

Facts this builds on (openenv 0.10.0, openenv/core/env_server/http_server.py, and upstream's repository):
  * `create_app` always serves `/ws` and `/schema` (production mode too), so a server without them is written by
    hand; upstream's calendar env is one (envs/calendar_env: `/health`, `/reset`, `/step`, `/state`, `POST /mcp`;
    its `/schema` is its database's schema, without an `action`; no `/metadata`, no `/ws`).
  * Over HTTP an episode cannot be held per client: create_app's `/reset` and `/step` build a fresh env per request
    and close it; the calendar server steps ONE env shared by every client.
  * create_app's `POST /mcp` offers sessions (`openenv/session/create` answers `{"session_id": ...}`, then
    `tools/call` with `params.session_id` reaches that session's env, `openenv/session/close` ends it); the calendar
    server answers that method with `result: {"error": "Method not found: ..."}`. A sessioned `tools/call` on an
    `MCPEnvironment` goes straight to its MCP client, skipping `step()`: its reply carries no reward and no `done`.

The survey reads `/health`, `/metadata` and `/mcp` (tools/list) with the probes' bounds (envs.core.probe); a server
that looks like OpenEnv is then asked for one MCP session and one `/ws` session, each closed again. It never POSTs
`/reset` or `/step`: the calendar's `/reset` wipes a database.
"""

from __future__ import annotations

from dataclasses import dataclass

from envs.core import probe
from envs.core.untrusted import strip_credentials

MCP_LIST = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}}
MCP_SESSION_CREATE = {"jsonrpc": "2.0", "id": 2, "method": "openenv/session/create", "params": {}}
FIX = ("the env's author can serve the WebSocket route /ws (OpenEnv's create_app serves it) or MCP sessions over "
       "HTTP (`openenv/session/create` on /mcp, as create_app's /mcp offers)")


@dataclass(frozen=True)
class Survey:
    health: bool  # GET /health: 200 {"status": "healthy"}
    metadata: bool  # GET /metadata: 200 with a `name` (EnvironmentMetadata)
    mcp_tools: bool  # POST /mcp tools/list: a JSON-RPC result with a `tools` list
    mcp_sessions: bool  # POST /mcp openenv/session/create: a JSON-RPC result with a `session_id`
    ws: bool  # /ws accepts a WebSocket session
    tools: tuple = ()  # tools/list's tools (untrusted: envs.generic.interface.mcp_tools checks them)

    @property
    def openenv(self) -> bool:
        return self.health and (self.metadata or self.mcp_tools)

    @property
    def trainable(self) -> bool:
        """One episode per MCP session over HTTP: the `http-mcp` transport (a server with /ws uses that)."""
        return self.openenv and self.mcp_tools and self.mcp_sessions and not self.ws

    def routes(self) -> str:
        answered = [("/health", self.health), ("/metadata", self.metadata), ("/mcp", self.mcp_tools)]
        return ", ".join(route for route, ok in answered if ok)


def _answer(url: str, payload: dict | None = None, max_bytes: int = probe.MAX_HEALTH_BYTES):
    """The JSON body of a 200 answer, else None (any status, no answer in time, too big, not JSON)."""
    try:
        status, body = probe.get_json(url, probe.HEALTH_DEADLINE_S, max_bytes, payload)
    except probe.ProbeError:
        return None
    return body if status == 200 else None


def _rpc_result(body) -> dict:
    """A JSON-RPC reply's `result` object, or {} (an `error` reply, or not JSON-RPC)."""
    result = body.get("result") if isinstance(body, dict) else None
    return result if isinstance(result, dict) else {}


def survey(base_url: str) -> Survey:
    base = base_url.rstrip("/")
    health = _answer(f"{base}/health")
    health_ok = isinstance(health, dict) and str(health.get("status", "")).lower() in ("healthy", "ok")
    metadata = _answer(f"{base}/metadata")
    metadata_ok = isinstance(metadata, dict) and isinstance(metadata.get("name"), str)
    tools = _rpc_result(_answer(f"{base}/mcp", MCP_LIST, probe.MAX_SCHEMA_BYTES)).get("tools")
    tools_ok = isinstance(tools, list)
    sessions_ok = ws = False
    if health_ok and (metadata_ok or tools_ok):  # only an OpenEnv-looking server is asked to open a session
        ws = probe.opens_session(base)
        session_id = _rpc_result(_answer(f"{base}/mcp", MCP_SESSION_CREATE)).get("session_id")
        sessions_ok = isinstance(session_id, str) and bool(session_id)
        if sessions_ok:  # it holds a slot of the server's capacity: given back at once
            _answer(f"{base}/mcp", {"jsonrpc": "2.0", "id": 3, "method": "openenv/session/close",
                                    "params": {"session_id": session_id}})
    return Survey(health_ok, metadata_ok, tools_ok, sessions_ok, ws, tuple(tools) if tools_ok else ())


def refusal(base_url: str, found: Survey) -> str | None:
    """One line saying why the server at `base_url` (`found`: its survey), which has no action schema at /schema and
    is not `trainable`, cannot be trained and what its author can add; None when it does not look like an OpenEnv
    server at all (the caller says so)."""
    shown = strip_credentials(base_url.rstrip("/"))
    if not found.openenv:
        return None
    if found.ws:
        return (f"{shown} opens sessions on /ws but has no action schema at /schema ({found.routes()} answered), so "
                "its action's fields cannot be learned; the env's author can serve /schema (OpenEnv's create_app does)")
    if found.mcp_sessions:  # sessions, but tools/list did not answer
        return (f"{shown} serves OpenEnv's HTTP routes only ({found.routes()}; no /ws, no action schema at /schema) "
                "and offers MCP sessions over HTTP, but its /mcp lists no tools (tools/list), so there is nothing to "
                "learn; the env's author can answer MCP tools/list on /mcp or serve the WebSocket route /ws "
                "(OpenEnv's create_app serves it)")
    return (f"{shown} serves OpenEnv's HTTP routes only ({found.routes()}; no /ws, no action schema at /schema): its "
            "HTTP /reset and /step hold no episode per client (OpenEnv's are stateless, a fresh env per request) and "
            "its /mcp offers no sessions, so episodes cannot be isolated and it cannot be trained; " + FIX)
