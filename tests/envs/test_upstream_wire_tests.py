"""Upstream OpenEnv's own wire tests, those that need only a URL, against our servers and, for comparison, upstream's own (#45 item 1).

tests/envs/upstream_test_websockets.py is upstream's tests/envs/test_websockets.py verbatim; its classes start
upstream's servers as subprocesses (`envs.echo_env.server.app`, not installable here), so each is run here with its
server fixture pointed at our echo server (in-process, tests/envs/inprocess.py) and upstream's echo client
(`envs.echo_env.client.EchoEnv`, an `MCPToolClient` subclass, registered under upstream's module name).
"""

from __future__ import annotations

import sys
import types

import pytest
from openenv.core.mcp_client import MCPToolClient

from tests.envs.inprocess import ThreadServer


class EchoEnv(MCPToolClient):
    """Upstream's envs/echo_env/client.py: MCPToolClient with nothing added."""


_client = types.ModuleType("envs.echo_env.client")
_client.EchoEnv = EchoEnv
sys.modules.setdefault("envs.echo_env", types.ModuleType("envs.echo_env"))
sys.modules.setdefault("envs.echo_env.client", _client)

from tests.envs import upstream_test_websockets as upstream  # noqa: E402  (after the client is registered)


@pytest.fixture(params=["ours", "upstream"])
def our_echo(request):
    """Each test against our echo server and upstream's (its FastMCP echo behind stock create_app): the outcomes
    must be the same."""
    app = None
    if request.param == "upstream":
        from openenv.core.env_server.http_server import create_fastapi_app
        from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation

        from bench.stock_echo_server import EchoEnvironment

        app = create_fastapi_app(EchoEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=16)
    with ThreadServer("echo", app=app) as server:
        yield server.url


# Upstream's own server fails these too (openenv 0.10.0): MCPToolClient.call_tool goes over the MCP path, which
# does not count a step, so `state().step_count` stays 0. Strict: a change on either side shows here.
UPSTREAM_FAILS = pytest.mark.xfail(strict=True, reason="fails against upstream's echo server as well")


class TestOurEchoHttp(upstream.TestProtocolHttpEndpoints):
    @pytest.fixture
    def echo_server(self, our_echo):
        return our_echo


class TestOurEchoWebSocket(upstream.TestProtocolWebSocketClient):
    @pytest.fixture
    def echo_server(self, our_echo):
        return our_echo

    test_protocol_client_state = UPSTREAM_FAILS(upstream.TestProtocolWebSocketClient.test_protocol_client_state)
    test_protocol_client_multiple_episodes = UPSTREAM_FAILS(
        upstream.TestProtocolWebSocketClient.test_protocol_client_multiple_episodes)


class TestOurEchoEnvironment(upstream.TestEchoEnvironment):
    @pytest.fixture
    def server(self, our_echo):
        return our_echo


class TestOurEchoConcurrency(upstream.TestConcurrencyMultipleSessions):
    """Upstream skips these unless run by hand against a server with MAX_CONCURRENT_ENVS > 1: ours holds 256,
    upstream's is given 16 here."""

    @pytest.fixture
    def echo_server_concurrent(self, our_echo):
        return our_echo

    # the same bodies without upstream's skip mark
    @UPSTREAM_FAILS
    def test_concurrency_two_independent_sessions(self, echo_server_concurrent):
        upstream.TestConcurrencyMultipleSessions.test_concurrency_two_independent_sessions(self, echo_server_concurrent)

    def test_concurrency_session_isolation(self, echo_server_concurrent):
        upstream.TestConcurrencyMultipleSessions.test_concurrency_session_isolation(self, echo_server_concurrent)
