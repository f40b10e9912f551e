"""Our env servers answer as upstream openenv 0.10.0 where a client can tell (#45 item 1).

Each case is checked against upstream's own code: stock `create_fastapi_app` (openenv http_server.py) on the
same env classes, upstream's echo env (FastMCP, bench/stock_echo_server.py), OpenSpiel's rl_environment,
and upstream's clients (tests/envs/upstream_clients.py, openenv's MCPToolClient). In-process: Starlette's
TestClient, or uvicorn in a thread on 127.0.0.1 where a client needs a URL. No Docker.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from envs.core.settings import ServerSettings
from tests.envs.inprocess import ThreadServer, ours


def stock(env_name: str, mode: str = "simulation"):
    """Upstream's create_fastapi_app on our env classes: the routes upstream serves."""
    from openenv.core.env_server.http_server import create_fastapi_app

    from envs.registry import get

    factory, action_cls, observation_cls, state_cls = get(env_name).server_parts()
    return create_fastapi_app(factory, action_cls, observation_cls, max_concurrent_envs=4, state_cls=state_cls,
                              mode=mode)


# ---------------------------------------------------------------------------------------------- (a) Catch
def test_catch_step_before_any_reset_answers_a_first_observation_as_upstream():
    """Upstream's OpenSpiel env steps rl_environment, which starts an episode on a step before any reset; stock
    HTTP /step is always such a step (a fresh env per call). Before: 500 (ours raised "No episode yet")."""
    from open_spiel.python import rl_environment

    assert rl_environment.Environment("catch").step([1]).first()  # upstream's behaviour, at its source
    app, _ = ours("catch")
    with TestClient(app) as client:
        reply = client.post("/step", json={"action": {"action_id": 1}})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["done"] is False and body["reward"] is None
        assert body["observation"]["game_phase"] == "initial" and body["observation"]["legal_actions"] == [0, 1, 2]
        with client.websocket_connect("/ws") as ws:  # the same on the WebSocket
            ws.send_text(json.dumps({"type": "step", "data": {"action_id": 1}}))
            frame = json.loads(ws.receive_text())
            assert frame["type"] == "observation" and frame["data"]["observation"]["game_phase"] == "initial"
            ws.send_text(json.dumps({"type": "step", "data": {"action_id": 1}}))  # then the episode goes on
            assert json.loads(ws.receive_text())["data"]["observation"]["game_phase"] in ("playing", "terminal")


# ---------------------------------------------------------------------------------------------- (b) expiry
def test_a_reaped_session_tells_upstreams_client_before_it_goes_on():
    """Before: the server closed a reaped socket at once; upstream's client reconnected on its next call and
    went on in a new, un-reset session with no error. Now that call raises, naming the expiry."""
    from tests.envs.upstream_clients import OpenSpielAction, OpenSpielEnv

    server = ThreadServer("catch")
    try:
        with OpenSpielEnv(base_url=server.url).sync() as env:
            env.reset()
            server.reap()
            assert server.server.capacity()["active_sessions"] == 0  # the slot is free at once
            with pytest.raises(RuntimeError, match="SESSION_EXPIRED") as caught:
                env.step(OpenSpielAction(action_id=1))
            assert "SESSION_TIMEOUT_S" in str(caught.value)
            assert server.server.capacity()["reaped_sessions"] == 1
            # The server closes the socket right after the error frame; a call made before the client has seen
            # that close fails once more (ConnectionClosed, as after any server-side close): wait for it.
            server.wait_for_no_connections()
            # told, the client starts over in a new session
            assert env.reset().observation.game_phase == "initial"
            assert env.step(OpenSpielAction(action_id=1)).observation.game_phase in ("playing", "terminal")
    finally:
        server.stop()


# ---------------------------------------------------------------------------------------------- (c) mode
PATHS = (("post", "/reset", {}), ("post", "/step", {"action": {"action_id": 1}}), ("get", "/state", None),
         ("get", "/health", None), ("get", "/schema", None), ("get", "/metadata", None))


@pytest.mark.parametrize("mode", ["production", "simulation"])
def test_openenv_mode_gives_upstreams_routes(mode):
    """OPENENV_MODE=production: no HTTP /reset, /step, /state (404), as stock; /ws still plays. Before: ignored."""
    def statuses(client) -> dict:
        return {path: getattr(client, verb)(path, **({"json": body} if body is not None else {})).status_code
                for verb, path, body in PATHS}

    with TestClient(stock("catch", mode)) as client:
        upstream = statuses(client)
    app, _ = ours("catch", OPENENV_MODE=mode.upper())
    with TestClient(app) as client:  # one client: the app's shutdown stops its session executor
        got = statuses(client)
        with client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "reset", "data": {"seed": 1}}))
            assert json.loads(ws.receive_text())["type"] == "observation"
    assert got == upstream
    assert (got["/reset"], got["/step"], got["/state"]) == ((404,) * 3 if mode == "production" else (200,) * 3)


def test_a_bad_openenv_mode_is_one_line():
    with pytest.raises(SystemExit, match=r"OPENENV_MODE: choose one of simulation, production \(got 'prod'\)"):
        ServerSettings.load({"ENV_NAME": "echo", "OPENENV_MODE": "prod"})


# ---------------------------------------------------------------------------------------------- (d) MCP
MCP_CALLS = (
    {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {}},
    {"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": {"name": "nope", "arguments": {}}},
    {"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "echo_message",
                                                                   "arguments": {"message": "hi"}}},
    {"jsonrpc": "2.0", "id": 4, "method": "tools/call", "params": {"name": "echo_with_length",
                                                                   "arguments": {"message": "hey"}}},
)


def test_mcp_answers_and_unknown_frame_types_as_upstream_echo():
    """Upstream's echo env (FastMCP) behind stock create_app, and ours, over HTTP /mcp and the WebSocket: the
    same JSON. Before: unknown tool -32602 "Tool not found: nope" (upstream -32603 "Unknown tool: 'nope'"),
    tools/list without title/outputSchema/annotations, and {"type": 1} got VALIDATION_ERROR (upstream
    UNKNOWN_TYPE)."""
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

    from bench.stock_echo_server import EchoEnvironment

    def answers(app) -> list:
        out = []
        with TestClient(app) as client:
            out += [client.post("/mcp", json=call).json() for call in MCP_CALLS]
            with client.websocket_connect("/ws") as ws:
                for frame in [{"type": 1}, {"type": None}, *({"type": "mcp", "data": call} for call in MCP_CALLS)]:
                    ws.send_text(json.dumps(frame))
                    out.append(json.loads(ws.receive_text()))
        return out

    upstream = answers(create_fastapi_app(EchoEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=4))
    got = answers(ours("echo")[0])
    assert got == upstream
    assert got[1]["error"] == {"code": -32603, "message": "Unknown tool: 'nope'", "data": None}
    assert {"title", "outputSchema", "annotations"} <= set(got[0]["result"]["tools"][0])
    assert got[len(MCP_CALLS)]["data"]["code"] == "UNKNOWN_TYPE"


def test_upstreams_mcp_client_sees_the_same_tools():
    from openenv.core.mcp_client import MCPToolClient

    server = ThreadServer("echo")
    try:
        with MCPToolClient(base_url=server.url).sync() as env:
            env.reset()
            tools = env.list_tools()
            assert [t.name for t in tools] == ["echo_message", "echo_with_length"]
            assert env.call_tool("echo_message", message="hi") == "hi"
            with pytest.raises(Exception, match="nope"):
                env.call_tool("nope")
    finally:
        server.stop()


WEB_PATHS = (("get", "/", None), ("get", "/web/metadata", None), ("post", "/web/reset", {}), ("get", "/web/state", None),
             ("get", "/health", None), ("get", "/schema", None))


def test_enable_web_interface_adds_upstreams_ui_and_keeps_ours(monkeypatch):
    """ENABLE_WEB_INTERFACE=true: upstream's Gradio UI routes answer as stock create_app's; ours (/health with
    capacity, /ws) are unchanged. Before: ignored (404 at /web)."""
    from openenv.core.env_server.http_server import create_app

    from envs.registry import get

    def statuses(client) -> dict:
        return {path: getattr(client, verb)(path, follow_redirects=False,
                                            **({"json": body} if body is not None else {})).status_code
                for verb, path, body in WEB_PATHS}

    monkeypatch.setenv("ENABLE_WEB_INTERFACE", "true")  # what stock create_app reads
    factory, action_cls, observation_cls, state_cls = get("echo").server_parts()
    with TestClient(create_app(factory, action_cls, observation_cls, state_cls=state_cls)) as client:
        upstream = statuses(client)
    app, _ = ours("echo", ENABLE_WEB_INTERFACE="true")
    with TestClient(app) as client:
        got = statuses(client)
        assert "available_slots" in client.get("/health").json()
        with client.websocket_connect("/ws") as ws:
            ws.send_text(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(ws.receive_text())["type"] == "observation"
    assert got == upstream and got["/web/metadata"] == 200 and got["/"] in (302, 307)


def test_the_server_process_with_enable_web_interface_loads_gradio_and_serves_the_ui():
    """`python -m envs.serve` leaves Gradio out of its start-up unless ENABLE_WEB_INTERFACE (envs/serve.py); turned
    on, the UI is there. (Without it, every env-server process the suite starts shows the server works.)"""
    import os
    import subprocess
    import sys
    import time

    import requests

    from tests.helpers import ROOT, free_port

    port = free_port()
    env = dict(os.environ, ENV_NAME="echo", PORT=str(port), HOST="127.0.0.1", LOG_LEVEL="warning",
               ENABLE_WEB_INTERFACE="true")
    proc = subprocess.Popen([sys.executable, "-m", "envs.serve"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 900  # a hang guard only: a starved host part starts servers slowly
        while True:
            try:
                health = requests.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except requests.RequestException:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1].decode()[-2000:]
                time.sleep(0.2)
        assert "available_slots" in health.json()
        assert requests.get(f"http://127.0.0.1:{port}/web/metadata", timeout=10).status_code == 200
    finally:
        proc.kill()
        proc.wait()


def test_our_client_replays_an_episode_reaped_before_its_first_step_and_reports_one_reaped_later():
    """The socket of a reaped session stays open until its next frame: our client (envs/core/client.py) still
    replays the reset of an episode whose session expired before its first step (as when the socket was closed at
    once), and reports SESSION_EXPIRED (an infra failure) for one reaped mid-episode."""
    from envs.core.client import EnvServerError, SessionClient

    call = {"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hi"}}
    with ThreadServer("echo") as server:
        client = SessionClient(server.url)
        try:
            client.reset()
            server.reap()
            assert client.step(call)["observation"]["result"]["data"] == "hi"  # replayed on a new session
            server.reap()
            with pytest.raises(EnvServerError) as caught:
                client.step(call)
            assert caught.value.code == "SESSION_EXPIRED"
            assert server.server.capacity()["reaped_sessions"] == 2
        finally:
            client.close()


def test_reaped_sockets_kept_open_are_bounded_by_the_session_cap():
    """A reaped session's socket stays open until its next frame, but no more of them than MAX_CONCURRENT_ENVS: past
    that the oldest gets the error frame and the close at once (a client cannot pile up sockets)."""
    import asyncio

    from websockets.asyncio.client import connect

    with ThreadServer("echo", MAX_CONCURRENT_ENVS="2") as server:
        ws_url = server.url.replace("http", "ws") + "/ws"

        async def session():
            ws = await connect(ws_url, proxy=None)
            await ws.send(json.dumps({"type": "reset", "data": {}}))
            assert json.loads(await ws.recv())["type"] == "observation"
            return ws

        async def go():
            first, second = await session(), await session()
            await asyncio.to_thread(server.reap)
            third = await session()
            await asyncio.to_thread(server.reap)  # 3 expired sockets > 2: the first is closed now
            frame = json.loads(await asyncio.wait_for(first.recv(), 30))
            assert frame["data"]["code"] == "SESSION_EXPIRED"
            await asyncio.wait_for(first.wait_closed(), 30)
            assert first.close_code == 4408
            for ws in (second, third):  # still open; told on their next frame
                await ws.send(json.dumps({"type": "reset", "data": {}}))
                assert json.loads(await asyncio.wait_for(ws.recv(), 30))["data"]["code"] == "SESSION_EXPIRED"
                await asyncio.wait_for(ws.wait_closed(), 30)
            assert server.server.capacity()["reaped_sessions"] == 3
            await asyncio.to_thread(server.wait_for_no_connections)  # their handlers ended: none is kept
            assert not server.server._expired_sockets

        asyncio.run(go())
