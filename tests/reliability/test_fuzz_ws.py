"""Fuzz every env server's `/ws` with generated frames (hypothesis).

For each env (echo, wordle, catch) one fuzz session receives generated frames: raw text and bytes
(invalid JSON, binary), JSON values that are not messages, messages with unknown types and fields,
wrong types, mutated and out-of-range actions, odd reset kwargs, JSON-RPC over `mcp`, oversized and
deeply nested payloads, and calls after the episode is `done`. Every frame must get exactly one
structured reply (an observation/state/mcp frame, or an error with `code` and `message`) and the
session must stay usable; `/health` stays healthy, the container never restarts, and a well-behaved
session running alongside sees exactly what it saw before the fuzzing started.

FUZZ_EXAMPLES (default 300) is the number of generated frames per strategy and env; raise it for a
longer run, e.g. `FUZZ_EXAMPLES=2000 pytest tests/reliability -k fuzz`.
"""

from __future__ import annotations

import collections
import json
import os
import threading
import time
from typing import Any, Optional, Union

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from tests.reliability.common import ENV_NAMES, VALID_ACTIONS, assert_structured, recv_json, report

pytestmark = pytest.mark.docker

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
REPLY_TIMEOUT_S = 30.0

Frame = Union[str, bytes]


class FuzzSession:
    """One `/ws` connection that sends a frame and insists on one structured reply."""

    def __init__(self, url: str, env: str) -> None:
        self.url, self.env = url, env
        self.ws = None
        self.frames = 0
        self.replies: collections.Counter[str] = collections.Counter()
        self.reconnects = 0
        self.probes = 0
        self.connect()

    def connect(self) -> None:
        if self.ws is not None:
            try:
                self.ws.close()
            except Exception:
                pass
        self.ws = connect(self.url, open_timeout=30, max_size=None, ping_interval=None).__enter__()

    def send(self, frame: Frame, describe: str = "") -> Optional[dict]:
        """Send one frame; return its reply (None when it was a well-formed close)."""
        self.frames += 1
        closes = _is_close(frame)
        try:
            self.ws.send(frame)
            msg = recv_json(self.ws, timeout=REPLY_TIMEOUT_S)
        except ConnectionClosed as e:
            if closes:
                self.replies["closed-by-request"] += 1
                self.reconnects += 1
                self.connect()
                return None
            raise AssertionError(
                f"{self.env}: server closed the session ({e.rcvd}) on frame {describe or _short(frame)}"
            ) from None
        except TimeoutError:
            raise AssertionError(f"{self.env}: no reply within {REPLY_TIMEOUT_S}s to {describe or _short(frame)}")
        kind = assert_structured(msg, describe or _short(frame))
        self.replies[kind] += 1
        assert not closes, f"{self.env}: a close message was answered with {msg!r:.200}"
        if msg["type"] == "error":
            self.probe(kind, describe or _short(frame))
        return msg

    def probe(self, code: str, describe: str) -> None:
        """After an error reply the session must still answer (stock closes it on some errors)."""
        self.probes += 1
        try:
            self.ws.send('{"type":"state"}')
            msg = recv_json(self.ws, timeout=REPLY_TIMEOUT_S)
        except ConnectionClosed as e:
            self.connect()
            raise AssertionError(
                f"{self.env}: session ended ({e.rcvd}) after the {code} reply to frame {describe}"
            ) from None
        assert msg.get("type") == "state", f"{self.env}: state probe after {describe} got {msg!r:.300}"

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


def _short(frame: Frame) -> str:
    return repr(frame[:160]) + (f"... ({len(frame)} bytes)" if len(frame) > 160 else "")


def _is_close(frame: Frame) -> bool:
    try:
        value = json.loads(frame)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return False
    return isinstance(value, dict) and value.get("type") == "close" and set(value) <= {"type"}


# ------------------------------------------------------------------ the well-behaved neighbour
class Neighbour(threading.Thread):
    """Plays the same short seeded episode over and over on its own session, and records it."""

    def __init__(self, url: str, env: str) -> None:
        super().__init__(daemon=True, name=f"neighbour-{env}")
        self.url, self.env = url, env
        self.stop = threading.Event()
        self.baseline: Optional[list] = None
        self.deterministic = False
        self.episodes = 0
        self.problems: list[str] = []

    def episode(self, ws) -> list:
        seen = []
        for frame in ({"type": "reset", "data": {"seed": 7}},
                      {"type": "step", "data": VALID_ACTIONS[self.env]},
                      {"type": "step", "data": VALID_ACTIONS[self.env]}):
            ws.send(json.dumps(frame))
            msg = recv_json(ws, timeout=REPLY_TIMEOUT_S)
            if msg.get("type") != "observation":
                raise AssertionError(f"well-behaved {frame['type']} got {msg!r:.300}")
            seen.append(_stable(msg["data"]))
            if msg["data"].get("done"):
                break
        return seen

    def prepare(self) -> None:
        with connect(self.url, open_timeout=30, max_size=None) as ws:
            first, second = self.episode(ws), self.episode(ws)
        self.baseline, self.deterministic = first, first == second

    def run(self) -> None:
        try:
            with connect(self.url, open_timeout=30, max_size=None) as ws:
                while not self.stop.is_set():
                    seen = self.episode(ws)
                    self.episodes += 1
                    if self.deterministic and seen != self.baseline:
                        self.problems.append(f"episode {self.episodes} differs: {seen!r:.400} != {self.baseline!r:.400}")
                    time.sleep(0.02)
        except Exception as e:  # reported by the test, not lost in the thread
            self.problems.append(f"{type(e).__name__}: {e}")


def _stable(value: Any) -> Any:
    """Drop per-episode identifiers so seeded episodes compare equal."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if "id" not in k.lower() or k == "action_id"}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


# ------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module", params=ENV_NAMES)
def target(request, env_stack):
    env = request.param
    if env not in env_stack.urls:
        pytest.skip(f"no {env} server in RELIABILITY_URLS")
    url = env_stack.ws(env)
    before = env_stack.inspect(env)["RestartCount"] if env_stack.in_containers else None
    neighbour = Neighbour(url, env)
    neighbour.prepare()
    neighbour.start()
    session = FuzzSession(url, env)
    session.send(json.dumps({"type": "reset", "data": {}}))
    t0 = time.monotonic()
    yield session
    elapsed = time.monotonic() - t0
    neighbour.stop.set()
    neighbour.join(timeout=60)
    # The session still plays after everything it was sent.
    assert session.send(json.dumps({"type": "reset", "data": {}}))["type"] == "observation"
    session.close()
    env_stack.health(env)
    if env_stack.in_containers:
        state = env_stack.inspect(env)
        assert state["RestartCount"] == before and state["State"]["Running"], state["State"]
        assert not state["State"]["OOMKilled"]
    report(
        f"fuzz {env}: {session.frames} frames in {elapsed:.0f}s, replies {dict(session.replies)}; "
        f"neighbour played {neighbour.episodes} episodes "
        f"({'deterministic, all identical' if neighbour.deterministic else 'not seeded-deterministic, no errors'})"
        + (f", PROBLEMS {neighbour.problems[:3]}" if neighbour.problems else "")
    )
    assert neighbour.episodes > 0, "the well-behaved session never finished an episode"
    assert not neighbour.problems, neighbour.problems


# ------------------------------------------------------------------ strategies
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**80), max_value=2**80)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
message_types = st.sampled_from(["reset", "step", "state", "mcp", "close", "Reset", "", "observation", "error"]) | st.text(max_size=10)
# Names a careless env might treat as a file, a game to load, or a config to read.
kwarg_names = st.sampled_from([
    "seed", "episode_id", "target", "word", "words", "game_name", "game_params", "path", "file",
    "filename", "config", "dataset", "env_id", "render", "max_turns", "num_players",
]) | st.text(max_size=12)


@st.composite
def mutated_action(draw, env: str) -> dict:
    """The env's valid action with fields dropped, retyped, pushed out of range, or added."""
    action = dict(VALID_ACTIONS[env])
    for key in list(action):
        choice = draw(st.sampled_from(["keep", "drop", "value", "int", "text"]))
        if choice == "drop":
            del action[key]
        elif choice == "value":
            action[key] = draw(json_values)
        elif choice == "int":
            action[key] = draw(st.integers(min_value=-(2**70), max_value=2**70) | st.integers(-3, 10))
        elif choice == "text":
            action[key] = draw(st.text(max_size=30) | st.sampled_from(["[crane]", "[]", "[zzzzz]", "[crane crane]", "/etc/passwd"]))
    if env == "echo" and draw(st.booleans()):
        action["tool_name"] = draw(st.sampled_from(["echo_message", "echo_with_length", "reset", "get_reward", "__init__", ""]) | st.text(max_size=15))
        action["arguments"] = draw(st.dictionaries(st.sampled_from(["message", "msg", "path"]) | st.text(max_size=8), json_values, max_size=3))
    if draw(st.booleans()):
        action.update(draw(st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=2)))
    return action


def frames_for(env: str):
    raw = st.text(max_size=300) | st.binary(max_size=300)
    not_messages = json_values.map(json.dumps)
    envelopes = st.builds(
        lambda t, data, extra: json.dumps({"type": t, **({"data": data} if data is not None else {}), **extra}),
        message_types, st.none() | json_values, st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=2),
    )
    steps = mutated_action(env).map(lambda a: json.dumps({"type": "step", "data": a}))
    resets = st.dictionaries(kwarg_names, json_values, max_size=4).map(lambda d: json.dumps({"type": "reset", "data": d}))
    mcp = st.builds(
        lambda method, params, i: json.dumps({"type": "mcp", "data": {"jsonrpc": "2.0", "method": method, "params": params, "id": i}}),
        st.sampled_from(["tools/list", "tools/call", "initialize", "resources/list", "x"]) | st.text(max_size=10),
        json_values, st.integers(-5, 5) | st.text(max_size=5) | st.none(),
    )
    return {"raw": raw, "json": not_messages, "envelope": envelopes, "step": steps, "reset": resets, "mcp": mcp}


STRATEGIES = ("raw", "json", "envelope", "step", "reset", "mcp")


@pytest.mark.parametrize("kind", STRATEGIES)
def test_fuzz_frames_get_structured_replies(target: FuzzSession, kind: str):
    strategy = frames_for(target.env)[kind]

    @FUZZ_SETTINGS
    @given(frame=strategy)
    def run(frame):
        target.send(frame)

    run()


def test_fuzz_edge_frames(target: FuzzSession):
    """Hand-picked frames that took down stock servers: huge, deep, binary, huge numbers."""
    mib = 1 << 20
    edge: list[tuple[str, Frame]] = [
        ("empty text", ""),
        ("nul bytes", "\x00" * 64),
        ("invalid utf-8 bytes", b"\xff\xfe\xfa" * 100),
        ("utf-8 json as bytes", json.dumps({"type": "state"}).encode()),
        ("2 MiB text", "x" * (2 * mib)),
        ("2 MiB binary", b"\x01" * (2 * mib)),
        ("2 MiB json step", json.dumps({"type": "step", "data": {**VALID_ACTIONS[target.env], "pad": "a" * (2 * mib)}})),
        ("900 KiB string field", json.dumps({"type": "step", "data": {**VALID_ACTIONS[target.env], "metadata": {"pad": "b" * (900 << 10)}}})),
        ("deep list", "[" * 100_000 + "]" * 100_000),
        ("300-deep unknown field in a step", '{"type":"step","data":' + '{"a":' * 300 + "1" + "}" * 300 + "}"),
        ("deep dict in data", '{"type":"step","data":' + '{"a":' * 5000 + "1" + "}" * 5000 + "}"),
        ("5000-digit int", '{"type":"step","data":{"action_id":' + "9" * 5000 + "}}"),
        ("5000-digit int at top", "9" * 5000),
        ("NaN seed", '{"type":"reset","data":{"seed":NaN}}'),
        ("negative seed", '{"type":"reset","data":{"seed":-1}}'),
        ("huge seed", '{"type":"reset","data":{"seed":' + str(2**200) + "}}"),
        ("type is a list", '{"type":["step"],"data":{}}'),
        ("type is null", '{"type":null}'),
        ("data is a list", '{"type":"step","data":[1,2]}'),
        ("data is a string", '{"type":"reset","data":"x"}'),
        ("close with junk", '{"type":"close","data":{"x":1}}'),
        ("state with data", '{"type":"state","data":{"x":1}}'),
        ("session_id attach in body", '{"type":"reset","data":{"session_id":"../../etc"}}'),
    ]
    problems = []
    for desc, frame in edge:
        try:
            target.send(frame, describe=desc)
        except AssertionError as e:  # keep going: report every frame that misbehaves
            problems.append(str(e).splitlines()[0])
            target.connect()
    assert not problems, "\n".join(problems)
    # A well-formed close ends the session; the next connection gets a fresh one.
    assert target.send(json.dumps({"type": "close"})) is None
    assert target.send(json.dumps({"type": "reset", "data": {}}))["type"] == "observation"


def test_fuzz_calls_after_done(target: FuzzSession):
    """Play to the end of an episode, then keep calling: structured replies, and reset still works."""
    target.send(json.dumps({"type": "reset", "data": {"seed": 3}}))
    done = False
    for _ in range(60):
        msg = target.send(json.dumps({"type": "step", "data": VALID_ACTIONS[target.env]}))
        if msg["type"] == "observation" and msg["data"].get("done"):
            done = True
            break
    if target.env != "echo":  # echo never ends an episode by itself
        assert done, f"{target.env}: no done after 60 valid steps"
    for frame in ({"type": "step", "data": VALID_ACTIONS[target.env]}, {"type": "state"},
                  {"type": "step", "data": {"action_id": 99}}, {"type": "step", "data": {"message": "[zzzzz]"}},
                  {"type": "step", "data": VALID_ACTIONS[target.env]}):
        target.send(json.dumps(frame), describe=f"after done: {frame}")
    msg = target.send(json.dumps({"type": "reset", "data": {"seed": 4}}))
    assert msg["type"] == "observation" and not msg["data"].get("done"), msg
