"""#45 item 2: OpenEnv servers that serve only the HTTP routes are recognised and refused with the reason and the fix,
instead of "not an OpenEnv server". In-process stubs on 127.0.0.1 (uvicorn in a thread), no Docker.

What the stubs answer, as upstream produces it (read in openenv 0.10.0 and upstream's repository, May 2026):
  * upstream's calendar env (envs/calendar_env/server: main.py, apis/core_apis.py, apis/database_router.py,
    apis/mcp/router.py, handlers/mcp_handler.py, openenv_wrapper/custom_http_server.py) is a hand-written FastAPI
    app, not create_app: GET /health -> {"status": "healthy", "service": "calendar-env"}; GET /schema -> its
    database's schema {"success": true, "message": "Database schema retrieved successfully", "schema": {...}}, no
    `action`; POST /reset, /step and GET /state on ONE env shared by every client; POST /mcp answers
    `mcp.types.JSONRPCResponse(...).model_dump()`: tools/list -> result `ListToolsResult(...).model_dump(
    exclude_none=True)`, an unknown method -> result {"error": "Method not found: <method>"} (a result, not a JSON-RPC
    error); no /metadata and no /ws (Starlette refuses the handshake of an unknown WebSocket path).
  * openenv 0.10.0's create_app (http_server.py) always serves /ws and /schema; its POST /mcp offers sessions
    (`openenv/session/create` -> result {"session_id": ...}; `openenv/session/close`), and a sessioned tools/call on
    an MCPEnvironment returns the tool's CallToolResult without reward or done. The sessioned stub is upstream's own
    app (bench/stock_echo_server.py's echo env under create_fastapi_app) with its /ws and /schema routes removed.
"""

from __future__ import annotations

import pytest
import requests
from fastapi import FastAPI, Request

from envs.generic import GenericSpec, InterfaceError
from tests.envs.inprocess import ThreadServer


def calendar_app(calls: list[str]) -> FastAPI:
    """Upstream calendar env's routes and replies (module docstring); `calls` records each request's path."""
    from mcp.types import JSONRPCResponse, ListToolsResult, Tool

    app = FastAPI()
    tools = [Tool(name="calendars_get", description="Get a calendar by id.",
                  inputSchema={"type": "object", "properties": {"calendarId": {"type": "string"}},
                               "required": ["calendarId"]})]

    @app.middleware("http")
    async def record(request: Request, call_next):
        calls.append(request.url.path)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "healthy", "service": "calendar-env"}

    @app.get("/schema")
    async def schema():
        return {"success": True, "message": "Database schema retrieved successfully",
                "schema": {"tables": {"calendars": {"columns": ["id", "summary"]}}}}

    @app.post("/mcp")
    async def mcp(request: Request):
        body = await request.json()
        method, request_id = body.get("method"), body.get("id")
        if method == "tools/list":
            result = ListToolsResult(tools=tools).model_dump(exclude_none=True)
        else:
            result = {"error": f"Method not found: {method}"}
        return JSONRPCResponse(jsonrpc="2.0", id=request_id, result=result).model_dump()

    @app.post("/reset")
    async def reset():
        return {"observation": {"success": True, "metadata": {}}, "done": False, "reward": 0.0}

    @app.post("/step")
    async def step():
        return {"observation": {"success": True, "metadata": {}}, "done": False, "reward": 0.0}

    @app.get("/state")
    async def state():
        return {"episode_id": None, "step_count": 0, "database_id": "default"}

    return app


def stock_echo_without(*paths: str):
    """(app, its HTTPEnvServer's live sessions) for upstream's echo env on create_fastapi_app, minus `paths`."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    from bench.stock_echo_server import EchoEnvironment

    app = create_fastapi_app(EchoEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=4)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in paths]
    return app


@pytest.fixture
def served():
    servers = []

    def serve(app) -> str:
        servers.append(ThreadServer("stub", app=app))
        return servers[-1].url

    yield serve
    for server in servers:
        server.stop()


def test_calendar_shaped_server_is_refused_with_why_and_the_fix(served):
    """Before: "answered 200 without an action schema: not an OpenEnv server"."""
    calls: list[str] = []
    url = served(calendar_app(calls))
    with pytest.raises(InterfaceError) as caught:
        GenericSpec.discover("calendar", url)
    line = str(caught.value)
    assert "\n" not in line and "not an OpenEnv server" not in line
    assert line.startswith(f"{url} serves OpenEnv's HTTP routes only (/health, /mcp; no /ws, no action schema at "
                           "/schema): its HTTP /reset and /step hold no episode per client")
    assert "episodes cannot be isolated and it cannot be trained" in line
    assert "the WebSocket route /ws (OpenEnv's create_app serves it) or MCP sessions over HTTP" in line
    assert "/reset" not in calls and "/step" not in calls  # the survey never starts or steps an episode


def test_preflight_line_names_the_env_its_image_and_url(served, monkeypatch):
    from contract.config import RunConfig
    from envs import naming
    from trainer.run import preflight

    url = served(calendar_app([]))
    monkeypatch.setenv(naming.image_var("calendar"), "openenv/calendar-env:latest")
    cfg = RunConfig.load([], env_name="calendar", env_urls=f"calendar={url}", per_device_train_batch_size=2,
                         num_generations=2)
    errors = preflight.check_env_servers(cfg, preflight.PreflightReport(), wait_s=0)
    assert len(errors) == 1
    assert errors[0].startswith(f"env calendar (image openenv/calendar-env:latest): {url} serves OpenEnv's HTTP "
                                "routes only")


def test_upstream_app_without_ws_offers_mcp_sessions_and_is_refused_and_left_as_found(served):
    """create_app's /mcp sessions work over HTTP, but a sessioned tools/call carries no reward or done (checked
    here), so training over them would learn nothing from the env: refused, naming /ws; the session the survey
    opened is closed again."""
    url = served(stock_echo_without("/ws", "/schema"))
    rpc = f"{url}/mcp"
    session = requests.post(rpc, json={"jsonrpc": "2.0", "id": 1, "method": "openenv/session/create", "params": {}},
                            timeout=30).json()["result"]["session_id"]
    reply = requests.post(rpc, json={"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {
        "name": "echo_message", "arguments": {"message": "hi"}, "session_id": session}}, timeout=30).json()
    assert reply["result"]["data"] == "hi" and not {"reward", "done"} & set(reply["result"])
    with pytest.raises(InterfaceError, match=r"serves OpenEnv's HTTP routes only \(/health, /metadata, /mcp; no /ws, "
                                             r"no action schema at /schema\) with MCP sessions over HTTP, which this "
                                             r"stack does not train yet .* can serve the WebSocket route /ws"):
        GenericSpec.discover("echo_http", url)
    closed = requests.post(rpc, json={"jsonrpc": "2.0", "id": 3, "method": "openenv/session/close",
                                      "params": {"session_id": session}}, timeout=30).json()
    assert closed["result"]["closed"] is True
    # only our own session was left: the survey's was closed (a fourth create fits the cap of 4 after three more)
    for n in range(4):
        created = requests.post(rpc, json={"jsonrpc": "2.0", "id": 10 + n, "method": "openenv/session/create",
                                           "params": {}}, timeout=30).json()
        assert "session_id" in created["result"], created


def test_a_server_with_ws_but_no_schema_says_so(served):
    url = served(stock_echo_without("/schema"))
    with pytest.raises(InterfaceError, match=r"opens sessions on /ws but has no action schema at /schema "
                                             r"\(/health, /metadata, /mcp answered\).*can serve /schema"):
        GenericSpec.discover("echo_noschema", url)


def test_a_web_app_that_is_not_openenv_is_still_named(served):
    app = FastAPI()
    app.get("/health")(lambda: {"status": "healthy"})
    url = served(app)
    with pytest.raises(InterfaceError, match=r"/schema answered 404 without an action schema: not an OpenEnv server"):
        GenericSpec.discover("web", url)
