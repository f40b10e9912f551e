"""The env servers in their image, through the real compose.yaml (one project, all three envs)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import requests

from tests.helpers import ROOT, build_images, compose_stack, service_url

pytestmark = pytest.mark.docker

CAP = 4
# SESSION_TIMEOUT_S of the shared servers: far longer than any of these tests, however slow this machine,
# so what frees a slot here is a close or a dropped client, never the idle reaper (a short timeout reaped
# sessions that tests still held, and freed a dropped client's slots even where drops went unnoticed).
TIMEOUT_S = 3600
# The reaping test's own server: an idle session goes 6 to 11 s after its last frame (the stock reaper
# checks every max(T/4, 5) s); the test waits for the reaper's frame, not for that time.
REAP_TIMEOUT_S = 6
GUARD_S = 120  # deadlines that only stop a hang: every wait below ends on what the server reports


@pytest.fixture(scope="module")
def urls(docker, tmp_path_factory):
    build_images("env-server")
    overrides = {"MAX_CONCURRENT_ENVS": str(CAP), "ENV_SESSION_TIMEOUT_S": str(TIMEOUT_S)}
    with compose_stack(tmp_path_factory.mktemp("envs"), ["echo", "wordle", "catch"], overrides=overrides) as stack:
        yield {n: service_url(stack, f"env-{n}") for n in ("echo", "wordle", "catch")}


@pytest.fixture
def reaping_url(docker, tmp_path):
    build_images("env-server")
    overrides = {"MAX_CONCURRENT_ENVS": str(CAP), "ENV_SESSION_TIMEOUT_S": str(REAP_TIMEOUT_S)}
    with compose_stack(tmp_path, ["echo"], services=["env-echo"], overrides=overrides) as stack:
        yield service_url(stack, "env-echo")


def ws_url(url: str) -> str:
    return url.replace("http://", "ws://") + "/ws"


async def rpc(ws, message) -> dict:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    return json.loads(await ws.recv())


def capacity(url: str) -> dict:
    return requests.get(url + "/capacity", timeout=5).json()


def wait_for_capacity(url: str, done, what: str) -> dict:
    """Poll /capacity until `done(it)`: the server reports the slots freed, the sessions reaped, ..."""
    deadline = time.monotonic() + GUARD_S
    while not done(cap := capacity(url)):
        assert time.monotonic() < deadline, f"{what}: not reported in {GUARD_S} s, last {cap}"
        time.sleep(0.1)
    return cap


def wait_for_active(url: str, n: int) -> dict:
    return wait_for_capacity(url, lambda cap: cap["active_sessions"] == n, f"{n} active sessions")


# ---------------------------------------------------------------- full episodes
def test_echo_upstream_client(urls):
    from openenv.core.mcp_client import MCPToolClient

    with MCPToolClient(base_url=urls["echo"]).sync() as env:
        env.reset()
        assert [t.name for t in env.list_tools()] == ["echo_message", "echo_with_length"]
        assert env.call_tool("echo_message", message="Hello!") == "Hello!"
        assert env.call_tool("echo_with_length", message="Test") == {"message": "Test", "length": 4}


def test_wordle_upstream_client(urls):
    from tests.envs.upstream_clients import TextArenaAction, TextArenaEnv

    from envs.wordle.task import secret_for

    with TextArenaEnv(base_url=urls["wordle"]).sync() as env:
        first = env.reset(seed=7)
        assert "Wordle" in first.observation.prompt and not first.done
        r = env.step(TextArenaAction(message="[crane]" if secret_for(7) != "crane" else "[plant]"))
        assert "Feedback" in r.observation.messages[-1].content and not r.done
        assert set(r.observation.info["reward_signals"]) >= {"wordle.greens", "wordle.correct"}
        r = env.step(TextArenaAction(message=f"[{secret_for(7)}]"))
        assert r.done and r.reward == 1.0


def test_catch_upstream_client(urls):
    from tests.envs.upstream_clients import OpenSpielAction, OpenSpielEnv

    with OpenSpielEnv(base_url=urls["catch"]).sync() as env:
        r = env.reset()
        assert len(r.observation.info_state) == 50 and r.observation.legal_actions == [0, 1, 2]
        steps = 0
        while not r.done:
            r = env.step(OpenSpielAction(action_id=1, game_name="catch"))
            steps += 1
        assert steps == 9 and r.reward in (1.0, -1.0) and r.observation.game_phase == "terminal"


@pytest.mark.parametrize("name", ["echo", "wordle", "catch"])
def test_tool_class_expert_episode(urls, name):
    from envs.registry import get

    spec = get(name)
    tool = spec.tool_class(urls[name])
    for row in spec.make_dataset(3, seed=11):
        tool.reset(**row)
        outputs = [getattr(tool, fn)(**kw) for fn, kw in spec.demo_calls(row)]
        assert tool.get_reward() == 1.0, (row, outputs)
        with pytest.raises(RuntimeError, match="[Ss]top calling tools"):
            getattr(tool, spec.demo_calls(row)[0][0])(**spec.demo_calls(row)[0][1])
    tool._client.close()


def test_wordle_tool_returns_only_new_text(urls):
    from envs.wordle.tool import WordleTool

    tool = WordleTool(urls["wordle"])
    tool.reset(seed=5)
    a, b = tool.guess("crane"), tool.guess("zzzzz")
    assert "C R A N E" in a and "Wordle" not in a
    assert "not an English word" in b and "C R A N E" not in b
    tool._client.close()


# ---------------------------------------------------------------- capacity and slots
def test_capacity_error_then_a_slot_frees(urls):
    from websockets.asyncio.client import connect

    url = urls["catch"]

    async def go():
        held = [await connect(ws_url(url), proxy=None) for _ in range(CAP)]
        for ws in held:
            assert (await rpc(ws, {"type": "reset", "data": {}}))["type"] == "observation"
        assert capacity(url)["available_slots"] == 0
        extra = await connect(ws_url(url), proxy=None)
        err = json.loads(await extra.recv())
        assert err["type"] == "error" and err["data"]["code"] == "CAPACITY_REACHED"
        assert f"{CAP}/{CAP}" in err["data"]["message"] and "MAX_CONCURRENT_ENVS" in err["data"]["message"]
        await held.pop().close()
        wait_for_active(url, CAP - 1)  # the close is processed after close() returns
        late = await connect(ws_url(url), proxy=None)
        assert (await rpc(late, {"type": "reset", "data": {}}))["type"] == "observation"
        for ws in held + [late]:
            await ws.close()

    asyncio.run(go())
    assert wait_for_active(url, 0)["active_sessions"] == 0


def test_health_counts_episodes_awaiting_their_first_step(urls):
    """`episodes_awaiting_step`: sessions whose last frame was a reset (rollouts being generated)."""
    from websockets.asyncio.client import connect

    url = urls["catch"]
    step = {"type": "step", "data": {"action_id": 1}}
    # Earlier tests' sessions: a closed one leaves active_sessions first and episodes_awaiting_step a moment later
    # (the server uncounts it after OpenEnv's handler returns), so wait for both before taking the baseline.
    wait_for_capacity(url, lambda cap: cap["active_sessions"] == 0 and cap["episodes_awaiting_step"] == 0,
                      "earlier tests' sessions gone")

    async def play() -> list[int]:
        seen = [capacity(url)["episodes_awaiting_step"]]
        a, b = await connect(ws_url(url), proxy=None), await connect(ws_url(url), proxy=None)
        for ws in (a, b):
            await rpc(ws, {"type": "reset", "data": {}})
        seen.append(capacity(url)["episodes_awaiting_step"])
        await rpc(a, step)
        await rpc(a, step)  # a later step of the same episode changes nothing
        await rpc(b, {"type": "reset", "data": {}})  # a second reset of a waiting session neither
        seen.append(capacity(url)["episodes_awaiting_step"])
        await b.close()  # a session that leaves while waiting stops counting
        await a.close()
        return seen

    before, both, one = asyncio.run(play())
    assert (both - before, one - before) == (2, 1)
    wait_for_capacity(url, lambda cap: cap["episodes_awaiting_step"] == before, "the closed sessions uncounted")


def test_dropped_clients_free_their_slots(urls):
    url = urls["echo"]
    holder = textwrap.dedent(
        f"""
        import asyncio, json, time
        from websockets.asyncio.client import connect
        async def main():
            socks = [await connect({ws_url(url)!r}, proxy=None) for _ in range({CAP})]
            for ws in socks:
                await ws.send(json.dumps({{"type": "reset", "data": {{}}}})); await ws.recv()
            print("held", flush=True)
            await asyncio.sleep(600)
        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", holder], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert capacity(url)["active_sessions"] == CAP
        os.kill(proc.pid, signal.SIGKILL)  # no close frame, no goodbye
    finally:
        proc.wait(10)
    # freed when the server notices the dead sockets; the reaper would take an hour (TIMEOUT_S)
    assert wait_for_active(url, 0)["available_slots"] == CAP


def test_idle_session_is_reaped_and_tool_reconnects(reaping_url):
    from websockets.asyncio.client import connect

    from envs.echo.tool import EchoTool

    url = reaping_url
    tool = EchoTool(url)
    tool.reset(target="apple")

    async def idle():
        ws = await connect(ws_url(url), proxy=None)
        assert (await rpc(ws, {"type": "reset", "data": {}}))["type"] == "observation"
        # then nothing until both idle sessions are reaped: the socket stays open, its next frame is
        # answered with the expiry, then it closes
        await asyncio.to_thread(wait_for_capacity, url, lambda cap: cap["active_sessions"] == 0
                                and cap["reaped_sessions"] >= 2, "both idle sessions reaped")
        frame = await rpc(ws, {"type": "step", "data": {"tool_name": "echo_message", "arguments": {"message": "x"}}})
        assert frame["data"]["code"] == "SESSION_EXPIRED" and "SESSION_TIMEOUT_S" in frame["data"]["message"]
        await asyncio.wait_for(ws.wait_closed(), GUARD_S)
        assert ws.close_code == 4408

    asyncio.run(idle())
    assert capacity(url)["reaped_sessions"] == 2
    tool.reset(target="apple")  # reconnects by itself
    assert tool.echo_message("apple") == "apple" and tool.get_reward() == 1.0
    tool._client.close()


# ---------------------------------------------------------------- bad input
BAD_STEP = {
    "echo": ({"type": "call_tool", "tool_name": "echo_message", "arguments": {"msg": 1}}, None),
    "wordle": ({"word": "crane"}, "VALIDATION_ERROR"),
    "catch": ({"action_id": 7}, "EXECUTION_ERROR"),
}
GOOD_STEP = {
    "echo": {"type": "call_tool", "tool_name": "echo_message", "arguments": {"message": "hi"}},
    "wordle": {"message": "[crane]"},
    "catch": {"action_id": 1},
}


@pytest.mark.parametrize("name", ["echo", "wordle", "catch"])
def test_bad_input_gets_structured_errors_and_session_survives(urls, name):
    from websockets.asyncio.client import connect

    url = urls[name]

    async def go():
        ws = await connect(ws_url(url), proxy=None, max_size=None)
        other = await connect(ws_url(url), proxy=None)
        assert (await rpc(ws, {"type": "reset", "data": {"seed": 3}}))["type"] == "observation"
        before = await rpc(other, {"type": "reset", "data": {"seed": 3}})
        cases = {
            "{oops": "INVALID_JSON",
            b"\xff\xfe": "INVALID_JSON",
            "[1, 2]": "VALIDATION_ERROR",
            json.dumps({"type": 3}): "UNKNOWN_TYPE",  # as upstream
            json.dumps({"type": "teleport"}): "UNKNOWN_TYPE",
            json.dumps({"type": "step", "data": "x"}): "VALIDATION_ERROR",
            json.dumps({"type": "step", "data": {"message": "x" * (2 << 20)}}): "MESSAGE_TOO_LARGE",
        }
        for frame, code in cases.items():
            reply = await rpc(ws, frame)
            assert reply["type"] == "error" and reply["data"]["code"] == code, (frame[:40], reply)
            assert reply["data"]["message"]
        action, code = BAD_STEP[name]
        reply = await rpc(ws, {"type": "step", "data": action})
        if code is None:  # MCP envs report tool errors inside the observation, like upstream
            assert reply["data"]["observation"]["error"]["error_type"] == "invalid_args"
        else:
            assert reply["type"] == "error" and reply["data"]["code"] == code, reply
        # the session still plays
        assert (await rpc(ws, {"type": "step", "data": GOOD_STEP[name]}))["type"] == "observation"
        if name != "echo":  # echo episodes never end (upstream's behaviour)
            done = False
            for _ in range(20):
                r = await rpc(ws, {"type": "step", "data": GOOD_STEP[name] if name == "catch" else {"message": "[xxxxx]"}})
                if r["type"] == "observation" and r["data"]["done"]:
                    done = True
                    break
            assert done
            after = await rpc(ws, {"type": "step", "data": GOOD_STEP[name]})
            assert after["type"] == "error" and after["data"]["code"] == "EXECUTION_ERROR"
            assert "reset" in after["data"]["message"]
        # the other session saw nothing of it
        assert (await rpc(other, {"type": "state"}))["data"]["step_count"] == 0
        assert before["type"] == "observation"
        await ws.close()
        await other.close()

    asyncio.run(go())
    assert requests.get(url + "/health", timeout=5).json()["status"] == "healthy"


def test_frames_are_not_compressed_even_when_the_client_offers_it(urls):
    """WS_PER_MESSAGE_DEFLATE defaults off: deflating each few-hundred-byte frame cost ~15 % of a step."""
    from websockets.asyncio.client import connect

    async def go():
        async with connect(ws_url(urls["catch"]), compression="deflate", proxy=None) as ws:  # the client offers it
            assert ws.response.headers.get("Sec-WebSocket-Extensions") is None
            assert ws.protocol.extensions == []
            reply = await rpc(ws, {"type": "reset", "data": {"seed": 3}})
            assert reply["type"] == "observation" and len(reply["data"]["observation"]["info_state"]) == 50

    asyncio.run(go())


@pytest.mark.parametrize("name", ["echo", "wordle", "catch"])
def test_bench_load_script_plays_valid_episodes(urls, name, tmp_path):
    """bench/env_load.py (behind `make bench`) keeps working: its policy's actions are valid for each
    server, all at once and in turn. Not a timed test: it checks counts and errors, never speed."""
    n = CAP - 1
    length = ["--steps", "3"] if name == "echo" else ["--one-episode"]  # an echo episode never ends
    out = tmp_path / "load.json"
    for mode in ([], ["--in-turn"]):
        wait_for_active(urls[name], 0)
        res = subprocess.run([sys.executable, "bench/env_load.py", "--env", name, "--url", urls[name],
                              "--sessions", str(n), "--json", str(out), *length, *mode],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert res.returncode == 0, res.stderr[-2000:]
        [r] = json.loads(out.read_text())
        assert r["sessions"] == n and r["errors"] == 0, (mode, r)
        if name == "echo":
            assert r["steps"] == 3 * n, (mode, r)
        else:
            assert r["episodes"] == n and r["steps"] >= n, (mode, r)  # one whole episode per session
