"""#45 item 2: OpenEnv servers that serve only the HTTP routes: trained over MCP sessions on HTTP where they offer them
(transport `http-mcp`), else refused with the reason and the fix, instead of "not an OpenEnv server". In-process stubs
on 127.0.0.1 (uvicorn in a thread), no Docker.

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
    an MCPEnvironment returns the tool's CallToolResult without reward or done, while an env that takes
    CallToolAction in step() (no mcp_client) answers its CallToolObservation (reward, done). The sessioned stubs are
    upstream's own app (create_fastapi_app) with its /ws and /schema routes removed: bench/stock_echo_server.py's
    echo env, and `Counter` below (a CallToolAction env with a reward).
"""

from __future__ import annotations

import pytest
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


CAP = 4  # sessions the stock stubs hold


def stock_without(env_class, *paths: str):
    """Upstream's create_fastapi_app serving `env_class` (CAP sessions), minus the routes at `paths`."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    app = create_fastapi_app(env_class, CallToolAction, CallToolObservation, max_concurrent_envs=CAP)
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) not in paths]
    return app


def stock_echo_without(*paths: str):
    from bench.stock_echo_server import EchoEnvironment

    return stock_without(EchoEnvironment, *paths)


def counter_env():
    """An upstream-API env taking CallToolAction in step(): `add(n)` adds to this env's total, reward n, done at 10."""
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.mcp_types import (CallToolObservation, ListToolsAction, ListToolsObservation, Tool,
                                                   ToolError, ToolErrorType)
    from openenv.core.env_server.types import Observation, State

    class Counter(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self.total = 0

        def reset(self, seed=None, episode_id=None, **kwargs) -> Observation:
            self.total = 0
            return Observation()

        def step(self, action, timeout_s=None, **kwargs):
            if isinstance(action, ListToolsAction):
                return ListToolsObservation(tools=[Tool(
                    name="add", description="Add n to the total.\n\nArgs:\n    n: how much to add",
                    input_schema={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})])
            if action.tool_name != "add":
                return CallToolObservation(tool_name=action.tool_name, error=ToolError(
                    error_type=ToolErrorType.TOOL_NOT_FOUND, message=f"no tool {action.tool_name!r}"))
            self.total += int(action.arguments["n"])
            return CallToolObservation(tool_name="add", result={"total": self.total},
                                       reward=float(action.arguments["n"]), done=self.total >= 10)

        @property
        def state(self) -> State:
            return State(step_count=self.total)

    return Counter


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


def free_sessions(url: str) -> int:
    from envs.core import http_mcp

    accepted, problem = http_mcp.count_sessions(url, CAP + 1)
    assert problem is None, problem
    return accepted


def test_upstream_echo_without_ws_is_learned_over_mcp_sessions_and_left_as_found(served):
    """Before: refused as "not an OpenEnv server". create_app's /mcp sessions work over HTTP; the survey's session
    is closed again. A sessioned tools/call on an MCPEnvironment carries no reward or done (checked here: the
    preflight warns of it)."""
    url = served(stock_echo_without("/ws", "/schema"))
    spec = GenericSpec.discover("echo_http", url)
    assert spec.interface.transport == "http-mcp" and spec.interface.kind == "mcp"
    assert [t.name for t in spec.interface.tools] == ["echo_message", "echo_with_length"]
    assert free_sessions(url) == CAP
    tool = spec.tool_class(url)
    assert tool.reset(reset_kwargs={"seed": 3}) is None  # a session takes no reset arguments and has no observation
    assert tool.echo_message(message="hi") == "hi"
    assert free_sessions(url) == CAP - 1
    reply = tool._client._rpc("tools/call", {"name": "echo_message", "arguments": {"message": "x"},
                                             "session_id": tool._client.session_id}, 30)
    assert reply["data"] == "x" and not {"reward", "done"} & set(reply)
    assert tool.get_reward() == 0.0
    tool._client.close()
    assert free_sessions(url) == CAP


def test_an_episode_is_one_mcp_session_with_its_own_state_rewards_errors_and_end(served):
    from envs.generic.tool import EPISODE_OVER

    url = served(stock_without(counter_env(), "/ws", "/schema"))
    spec = GenericSpec.discover("counter", url)
    assert spec.interface.transport == "http-mcp"
    one, two = spec.tool_class(url), spec.tool_class(url)
    one.reset(), two.reset()
    assert one.add(n=3) == '{"total": 3}'
    assert two.add(n=1) == '{"total": 1}'  # its own env: sessions are isolated
    with pytest.raises(RuntimeError, match="no tool 'sub'"):
        one._step(type(spec.interface.tools[0])("sub", "", ()), {})
    assert one.add(n=7) == '{"total": 10}\n' + EPISODE_OVER
    with pytest.raises(RuntimeError, match="episode is over"):
        one.add(n=1)
    assert (one.get_reward(), two.get_reward()) == (10.0, 1.0)
    first = one._client.session_id
    one.reset()  # a new episode: a new session, the old one closed
    assert one._client.session_id != first and one.add(n=2) == '{"total": 2}'
    assert free_sessions(url) == CAP - 2
    one._client.close(), two._client.close()
    assert free_sessions(url) == CAP


def test_bound_as_trains_factory_the_bounds_apply_and_a_reaped_session_is_the_envs_failure(served):
    """The real rollout path (trainer.rollouts.envs_binding.bind): TOOL_TIMEOUT_S / RESET_TIMEOUT_S reach the HTTP
    session, and a session the server forgot (reaped, restarted) ends the episode as the env's failure (no reward,
    left out of training), not the model's."""
    from envs.core.client import EnvServerError
    from trainer.rollouts import envs_binding
    from trainer.core.metrics import RolloutStats

    url = served(stock_without(counter_env(), "/ws", "/schema"))
    spec = GenericSpec.discover("counter", url)
    env = envs_binding.bind("counter", spec.tool_class, url, RolloutStats(), 2000, step_timeout_s=7,
                            reset_timeout_s=9)()
    assert (env._client.message_timeout_s, env._client.reset_timeout_s) == (7 + envs_binding.REPLY_GRACE_S, 9)
    env.reset()
    assert env.add(n=2) == '{"total": 2}' and env.get_reward() == 2.0
    env.reset()
    env._client._rpc("openenv/session/close", {"session_id": env._client.session_id}, 30)  # what a reaper does
    with pytest.raises(EnvServerError, match="Unknown session_id") as caught:
        env.add(n=1)
    assert caught.value.code == "SESSION_EXPIRED" and env.get_reward() is None
    env._client.close()


def test_preflight_says_which_transport_each_env_uses(served):
    from contract.config import RunConfig
    from trainer.run import preflight

    counter = served(stock_without(counter_env(), "/ws", "/schema"))
    echo = ThreadServer("echo")
    try:
        cfg = RunConfig.load([], env_name="echo,counter", env_urls=f"echo={echo.url},counter={counter}",
                             per_device_train_batch_size=2, num_generations=2)
        report = preflight.PreflightReport()
        assert preflight.check_env_servers(cfg, report, wait_s=0) == []
    finally:
        echo.stop()
    echo_ok, counter_ok = (next(line for line in report.ok if line.startswith(f"env {name}: ") and "capacity" in line)
                           for name in ("echo", "counter"))
    assert "; transport websocket (/ws sessions)" in echo_ok
    assert counter_ok.endswith("; seed not checked (an MCP session over HTTP takes no reset arguments)"), counter_ok
    # counted by opening MCP sessions up to what this trainer needs (then closed)
    needed = report.sessions["counter"]
    assert f"capacity {needed} sessions in all (probed: the server does not report it)" in counter_ok
    assert "; transport http-mcp (MCP sessions over HTTP POST /mcp: the server has no /ws" in counter_ok
    assert any(w.startswith("env counter: over MCP sessions on HTTP a tool call reports a reward only") for w in
               report.warnings)
    assert free_sessions(counter) == CAP  # the count's sessions were closed


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


def test_auto_replicas_measures_an_http_only_image_by_its_mcp_sessions(served):
    """ENV_<NAME>_REPLICAS=auto's measurement (tools/env_replicas.measure) counted /ws sessions only: 0 for a server
    with none, "opening session 1" and the run stopped. Docker is faked: `docker port` names the in-process stub."""
    import subprocess

    from tools import env_ports, env_replicas

    url = served(stock_without(counter_env(), "/ws", "/schema"))
    port = url.rsplit(":", 1)[1]

    def run(cmd, **_):
        out = f"127.0.0.1:{port}\n" if cmd[:2] == ["docker", "port"] else "true\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    got = env_replicas.measure("openenv/counter:latest", 3, {}, run, lambda _: None, port=env_ports.default("counter"))
    assert (got.per_container, got.upto, got.source) == (3, 3, "counted")
    assert free_sessions(url) == CAP


def test_auto_replicas_names_why_an_http_only_image_without_sessions_cannot_be_measured(served):
    """The same measurement of a calendar-shaped server (no /ws, no MCP sessions): the line says what discovery says
    (HTTP routes only, episodes cannot be isolated, what the author can add), not the /ws handshake's 403."""
    import subprocess

    from tools import env_ports, env_replicas

    url = served(calendar_app([]))
    port = url.rsplit(":", 1)[1]

    def run(cmd, **_):
        out = f"127.0.0.1:{port}\n" if cmd[:2] == ["docker", "port"] else "true\n"
        return subprocess.CompletedProcess(cmd, 0, out, "")

    with pytest.raises(env_replicas.ReplicasError) as caught:
        env_replicas.measure("openenv/calendar:latest", 3, {}, run, lambda _: None, port=env_ports.EnvPort(8004, "the image's EXPOSE"))
    line = str(caught.value)
    assert line.startswith("measuring openenv/calendar:latest: its server on port 8004 serves OpenEnv's HTTP routes "
                           "only (/health, /mcp; no /ws"), line
    assert "episodes cannot be isolated" in line and "403" not in line and "\n" not in line
