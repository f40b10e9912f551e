"""Envs learned from their server (envs.generic), against the fixture envs run as local processes.

The fixtures (tests/fixtures/envs) are written on OpenEnv's public API: `notebook` an MCP tool env,
`guess` a typed-action env on stock `create_app` (one session per server). No Docker here; the
container tests (test_generic_containers.py) train on them through `.env` only.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests
from transformers.utils import get_json_schema

from tests.helpers import ROOT, free_port, start_fixture
from trainer.rollouts.envs_binding import tool_method_names

@pytest.fixture(scope="module")
def servers():
    procs, urls = [], {}
    try:
        for name, extra in (("notebook", {"MAX_CONCURRENT_ENVS": "3"}), ("guess", {})):
            port = free_port()
            procs.append(start_fixture(name, port, **extra))
            urls[name] = f"http://127.0.0.1:{port}"
        yield urls
    finally:
        for p in procs:
            p.kill()
            p.wait()


def spec(servers, name, **options):
    from envs.generic import GenericSpec

    return GenericSpec.discover(name, servers[name], **options)


def declared_tools(url: str) -> dict[str, dict]:
    """What the server itself declares: MCP tools' input schemas, or the action schema."""
    from envs.generic.interface import get_schema, list_tools, resolve_refs

    action = get_schema(url)["action"]
    if "tool_name" in (action.get("properties") or {}):
        return {t["name"]: resolve_refs(t.get("input_schema") or t.get("inputSchema"), {}) for t in list_tools(url, 30)}
    return {"action": resolve_refs(action, action.get("$defs", {}))}


# ---------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("name", ["notebook", "guess"])
def test_rendered_tools_are_exactly_what_the_server_declares(servers, name):
    """TRL renders tools with get_json_schema: types, required, enums and descriptions match the server."""
    learned = spec(servers, name)
    declared = declared_tools(servers[name])
    cls = learned.tool_class
    names = tool_method_names(cls)
    if name == "notebook":
        assert learned.interface.kind == "mcp" and names == sorted(declared) == ["count_notes", "write_note"]
    else:
        assert learned.interface.kind == "action" and names == ["guess_action"]
        declared = {"guess_action": declared["action"]}
    for tool in names:
        rendered = get_json_schema(getattr(cls, tool))["function"]
        schema = declared[tool]
        props = {k: v for k, v in schema["properties"].items() if k != "metadata"}
        assert rendered["name"] == tool and rendered["description"]
        assert set(rendered["parameters"]["properties"]) == set(props)
        assert set(rendered["parameters"].get("required", [])) == set(schema.get("required", []))
        for arg, want in props.items():
            got = rendered["parameters"]["properties"][arg]
            assert got.get("type") == want.get("type"), (tool, arg, got, want)
            assert got.get("enum") == want.get("enum"), (tool, arg, got, want)
            assert got["description"]
            if want.get("description"):
                assert got["description"] == want["description"]
    if name == "notebook":
        write = get_json_schema(cls.write_note)["function"]
        assert write["description"] == "Write a note into the notebook."
        assert write["parameters"]["properties"]["tag"] == {
            "type": "string", "enum": ["work", "home"], "description": "Which part of the notebook the note goes in."}
    else:  # no Field description: taken from the action docstring's Attributes section
        guess = get_json_schema(cls.guess_action)["function"]
        assert guess["parameters"]["properties"]["number"]["description"] == "Your guess, a whole number from 0 to 9."


def test_unsupported_schemas_name_the_tool_and_field():
    from envs.generic.interface import UnsupportedSchema, action_tool, mcp_tools

    with pytest.raises(UnsupportedSchema, match=r"tool 'mix' field 'value': anyOf of 2 types"):
        mcp_tools([{"name": "mix", "description": "d", "input_schema": {
            "type": "object", "properties": {"value": {"anyOf": [{"type": "string"}, {"type": "object"}]}}}}])
    with pytest.raises(UnsupportedSchema, match=r"tool 'raw' field 'blob': no JSON type"):
        mcp_tools([{"name": "raw", "description": "d", "input_schema": {"properties": {"blob": {}}}}])
    with pytest.raises(UnsupportedSchema, match=r"action NoopAction: no fields besides metadata"):
        action_tool({"title": "NoopAction", "type": "object", "properties": {"metadata": {"type": "object"}}})
    with pytest.raises(UnsupportedSchema, match="cannot be named 'get_reward'"):
        mcp_tools([{"name": "get_reward", "description": "d", "input_schema": {"properties": {}}}])
    # what TRL can express passes: nullable, arrays of scalars, enums via $defs (pydantic's Enum)
    [tool] = mcp_tools([{"name": "ok", "description": "d", "input_schema": {
        "$defs": {"Color": {"enum": ["red", "blue"], "type": "string"}},
        "properties": {"maybe": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
                       "many": {"type": "array", "items": {"type": "number"}},
                       "color": {"$ref": "#/$defs/Color"}}, "required": ["color"]}}])
    from envs.generic.tool import tool_function

    rendered = get_json_schema(tool_function(tool))["function"]["parameters"]
    assert rendered["properties"]["maybe"] == {"type": "integer", "nullable": True, "description": "maybe (integer or null)"}
    assert rendered["properties"]["many"]["items"] == {"type": "number"}
    assert rendered["properties"]["color"]["enum"] == ["red", "blue"] and rendered["required"] == ["color"]


def test_not_an_openenv_server_is_named():
    from envs.generic import GenericSpec, InterfaceError

    port = free_port()
    proc = start_fixture("not_openenv", port)
    try:
        with pytest.raises(InterfaceError, match=r"/schema answered 404 without an action schema: not an OpenEnv server"):
            GenericSpec.discover("web", f"http://127.0.0.1:{port}")
    finally:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- episodes
def test_mcp_episode_rewards_errors_and_end(servers):
    tool = spec(servers, "notebook").tool_class(servers["notebook"])
    try:
        prompt_tail = tool.reset(reset_kwargs={"seed": 1})
        assert prompt_tail == "\n\ntask: Write the word river in a note."
        assert tool.write_note(text="river") == "noted; the notebook holds 1 note(s)"
        with pytest.raises(RuntimeError, match="min_length must be >= 0"):  # a tool that raises: the model sees it
            tool.count_notes(min_length=-1)
        with pytest.raises(TypeError):  # an argument the tool does not declare
            tool.write_note(text="x", colour="red")
        last = tool.count_notes(min_length=1)
        assert last.startswith("1") and "The episode is over" in last  # 3 calls: done
        with pytest.raises(RuntimeError, match="The episode is over"):
            tool.write_note(text="river")
        assert tool.get_reward() == 1.0  # sum: 1.0 + 0 + 0
        tool.reset(reset_kwargs={"seed": 1})
        assert tool.get_reward() == 0.0
    finally:
        tool._client.close()


def test_typed_action_episode_shows_observations_and_sums_or_takes_last_reward(servers):
    for mode, want in (("sum", 1.0), ("last", 1.0)):
        tool = spec(servers, "guess", reward=mode, observation_chars=120).tool_class(servers["guess"])
        try:
            assert tool.reset(reset_kwargs={"seed": 5}).startswith("\n\nhint: I picked a number from 0 to 9.")
            seen = []
            for number in range(10):
                seen.append(tool.guess_action(number=number))
                if "The episode is over" in seen[-1]:
                    break
            assert "hint: right!" in seen[-1] or "guesses_left: 0" in seen[-1]
            assert all(len(text.split("\nThe episode is over")[0]) <= 120 for text in seen)
            assert "tried: \n0" in seen[0]  # a list of rows renders as a grid
            assert tool.get_reward() in (0.0, want)
        finally:
            tool._client.close()


def test_prompts_file_rows_and_bad_files(tmp_path):
    from envs.generic.task import PromptsFileError, make_dataset

    f = tmp_path / "prompts.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Guess my number.", "reset": {"seed": 3}},
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}], "reset": {}},
        {"prompt": "For another env.", "environment": "other"},
    ]) + "\n")
    rows = make_dataset(99, 0, "guess", prompts_file=str(f))
    derived = rows[1]["reset_kwargs"]["seed"]  # no seed in the file: one from the row (tests/envs/test_group_seeds.py)
    assert rows == [{"prompt": [{"role": "user", "content": "Guess my number."}], "reset_kwargs": {"seed": 3}},
                    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go."}],
                     "reset_kwargs": {"seed": derived}}]
    assert make_dataset(2, 7, "guess", instruction="Play.") == [
        {"prompt": [{"role": "user", "content": "Play."}], "reset_kwargs": {"seed": 7}},
        {"prompt": [{"role": "user", "content": "Play."}], "reset_kwargs": {"seed": 8}}]
    f.write_text('{"prompt": 3}\n')
    with pytest.raises(PromptsFileError, match="line 1: needs \"prompt\""):
        make_dataset(1, 0, "guess", prompts_file=str(f))
    with pytest.raises(PromptsFileError, match="no such file"):
        make_dataset(1, 0, "guess", prompts_file=str(tmp_path / "missing.jsonl"))


# ---------------------------------------------------------------------------- capacity
def open_connections_to(url: str) -> list:
    """This process's TCP connections to `url`'s port that are still open."""
    import psutil

    port = int(url.rsplit(":", 1)[1])
    return [c for c in psutil.Process().net_connections(kind="tcp")
            if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED]


def test_capacity_is_probed_when_health_does_not_report_it():
    """Each probe gets a server of its own with every slot free: a stock server frees a closed session's slot
    after the socket is gone, when it gets to it, and says so nowhere but in accepting a session again, so
    a probe right after another one (or after another test's session) could find slots not yet freed."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer.run.preflight import probe_capacity

    wanted = {"guess": ("guess", {}), "notebook": ("notebook", {"MAX_CONCURRENT_ENVS": "3"}),
              "notebook2": ("notebook", {"MAX_CONCURRENT_ENVS": "3"})}
    ports = {key: free_port() for key in wanted}
    urls = {key: f"http://127.0.0.1:{port}" for key, port in ports.items()}
    with ThreadPoolExecutor(len(wanted)) as pool:  # started side by side: each returns once /health answers
        started = [pool.submit(start_fixture, name, ports[key], **extra) for key, (name, extra) in wanted.items()]
    procs = [f.result() for f in started if f.exception() is None]
    try:
        for f in started:
            f.result()  # a fixture that did not start fails here, the others are stopped below
        assert requests.get(urls["guess"] + "/health", timeout=5).json() == {"status": "healthy"}  # says nothing
        assert probe_capacity(urls["guess"], 4) == (1, None)  # stock create_app: one session per server
        assert probe_capacity(urls["notebook"], 8) == (3, None)  # MAX_CONCURRENT_ENVS=3 for this one
        assert probe_capacity(urls["notebook2"], 2) == (2, None)  # counts only as far as needed
        # the probe's sessions are closed again: none of its sockets is left open (close() returns once the
        # TCP connection is gone) ...
        for url in urls.values():
            assert open_connections_to(url) == []
        # ... so the server frees the slot, and a client gets it: the client waits (with backoff) until the
        # server accepts it, the moment the slot is free; a slot the probe kept would fail this after 2 min.
        tool = spec(urls, "guess").tool_class(urls["guess"])
        tool._client.capacity_wait_s = 120
        try:
            assert "hint:" in tool.reset(reset_kwargs={"seed": 0})
        finally:
            tool._client.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_synthetic_demo_calls_fit_the_declared_schemas(servers):
    import random

    from envs.generic.task import demo_calls

    learned = spec(servers, "notebook")
    rng = random.Random(0)
    for _ in range(50):
        for name, args in demo_calls(learned.interface, rng):
            tool = learned.interface.tool(name)
            assert {p.name for p in tool.params if p.required} <= set(args) <= {p.name for p in tool.params}
            if "tag" in args:
                assert args["tag"] in ("work", "home")
            if "min_length" in args:
                assert isinstance(args["min_length"], int)


def test_adapter_bench_script_runs():
    """bench/adapter_overhead.py (make bench) keeps working: both classes play, a ratio is printed."""
    res = subprocess.run([sys.executable, "bench/adapter_overhead.py", "--steps", "3", "--rollouts", "2"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1200)  # hang guard: 174 s behind a CPU burner
    assert res.returncode == 0, res.stderr[-2000:]
    assert "hand-written EchoTool" in res.stdout and "zero-code (learned)" in res.stdout
    assert "ratio zero-code / hand-written:" in res.stdout


def test_a_server_that_dies_mid_episode_gives_the_model_an_error_and_the_next_episode_reconnects():
    """The episode's session dies with its server after a step was answered: the next tool call raises (TRL shows
    the model the error, the run goes on); after a restart on the same port, the next reset opens a new session.
    (Before any answered step the client replays the reset on a fresh session instead, waiting up to its
    reconnect bound for the server: tests/reliability/test_client_reconnect.py.)"""
    from websockets.exceptions import ConnectionClosed

    from envs.core.client import EnvServerError
    from envs.generic import GenericSpec

    port = free_port()
    server = start_fixture("guess", port)
    try:
        url = f"http://127.0.0.1:{port}"
        tool = GenericSpec.discover("guess", url).tool_class(url)
        tool.reset(reset_kwargs={"seed": 1})
        assert "guesses_left" in tool.guess_action(number=1)  # a step answered: the session holds state now
        server.kill()  # mid-episode
        server.wait()
        # the client notices the dead socket (SESSION_LOST), or the send/receive fails: either way it raises
        with pytest.raises((EnvServerError, ConnectionClosed, ConnectionError)):
            tool.guess_action(number=3)
        server = start_fixture("guess", port)  # Compose's restart
        assert "hint:" in tool.reset(reset_kwargs={"seed": 2})
        assert "guesses_left: 3" in tool.guess_action(number=3)
        tool._client.close()
    finally:
        server.kill()
        server.wait()
