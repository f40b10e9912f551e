"""`make chaos`'s faults by step (#63 item 8), host-only: the plan of a default run holds every kind at least twice
(it was a rate per second: a 40-step run of 39 s drew one delay and the trainer kill), faults fire as the trainer's
step records say its steps are logged (whatever the clock says), one that found nothing to break is tried again, and
the proxy's hostile control frames go only between the server's own frames."""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from types import SimpleNamespace

import pytest

from bench import chaos, chaos_faults, chaos_proxy
from bench.chaos_faults import ENV_KINDS, Injector, Planned, plan


def default_plan(*argv: str) -> tuple[list[Planned], object]:
    args = chaos.parse_args(list(argv))
    return plan(args.steps, args.seed, args.per_kind, tuple(args.kill_after),
                args.vllm_restart_after if args.rollouts == "async" else None,
                args.judge_restart_after if args.judge else None), args


@pytest.mark.parametrize("argv", [(), ("--rollouts", "async"), ("--seed", "7"), ("--steps", "60", "--seed", "7")])
def test_a_default_run_plans_every_kind_at_least_twice(argv):
    planned, args = default_plan(*argv)
    kinds = Counter(p.kind for p in planned)
    for kind in ENV_KINDS + ("trainer_kill",):
        assert kinds[kind] >= 2, (kind, kinds)
    assert kinds["vllm_restart"] == (1 if args.rollouts == "async" else 0)
    assert {p.variant for p in planned if p.kind == "hostile_frames"} == {"pong", "ping"}
    restarts = {p.after_step for p in planned if p.kind in chaos_faults.RESTARTS}
    for p in planned:
        last = args.steps - 1 if p.kind in chaos_faults.RESTARTS else args.steps - 2
        assert 1 <= p.after_step <= last, p  # a whole step after the one it lands in: to time what it did
        assert p.kind in chaos_faults.RESTARTS or p.after_step not in restarts, p  # not lost inside a restart
    # spread over the run, not bunched at its start
    env_steps = sorted(p.after_step for p in planned if p.kind in ENV_KINDS)
    assert env_steps[0] <= args.steps // 4 and env_steps[-1] >= args.steps * 3 // 4, env_steps


def test_the_plan_is_the_seeds():
    assert default_plan("--seed", "3")[0] == default_plan("--seed", "3")[0] != default_plan("--seed", "4")[0]


def test_a_short_run_still_gets_each_kind_several_to_a_step():
    planned, _ = default_plan("--steps", "6", "--kill-after", "3", "--per-kind", "1")
    assert Counter(p.kind for p in planned) == Counter({**{k: 1 for k in ENV_KINDS}, "trainer_kill": 1})


@pytest.mark.parametrize("argv", [("--kill-after", "40"), ("--kill-after", "5,5"), ("--kill-after", "x"),
                                  ("--rollouts", "async", "--vllm-restart-after", "20", "--kill-after", "20")])
def test_restart_steps_outside_the_run_or_twice_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        chaos.parse_args(list(argv))
    assert "--kill-after" in capsys.readouterr().err


class ProxyDouble:
    """Test double for the chaos proxy: no live link until `links` says so."""

    def __init__(self) -> None:
        self.links: list[dict] = []

    def drop(self):
        return self.links.pop() if self.links else None

    def hostile_frames(self, kind: str):
        return {"link": 1, "backend": 1, "frames": kind} if self.links else None


def injector(tmp_path, planned, proxy=None, envs=None) -> Injector:
    return Injector(envs, proxy or ProxyDouble(), 0, planned, tmp_path / "chaos-log.jsonl")


def test_a_fault_fires_when_its_step_is_logged_not_when_time_has_passed(tmp_path):
    """Three steps of 10 s each; a fault planned half a step after step 2 is due at step 2's time + 5 s, and never
    before step 2 is logged, however late the clock."""
    fault = Planned(2, "drop", 0.5)
    inj = injector(tmp_path, [fault])
    one = [{"step": 1, "time": 100.0}]
    assert inj.due([], 1e9) == [] and inj.due(one, 1e9) == []
    two = one + [{"step": 2, "time": 110.0}]
    assert inj.due(two, 110.0) == []  # step 2 just logged: the fault lands inside step 3, half a step in
    assert inj.step_s() == 10.0
    assert inj.due(two, 114.9) == [] and inj.due(two, 115.0) == [fault]
    # a resume rewrites step 2 later: the step was reached when it was first logged
    assert inj.due([{"step": 1, "time": 100.0}, {"step": 2, "time": 500.0}], 115.0) == [fault]


def test_a_fault_that_found_nothing_to_break_is_tried_again_until_it_does(tmp_path, monkeypatch):
    fault = Planned(1, "drop", 0.0)
    proxy = ProxyDouble()
    inj = injector(tmp_path, [fault], proxy)
    rows = [{"step": 1, "time": 100.0}]
    clock = [200.0]
    monkeypatch.setattr(chaos_faults.time, "time", lambda: clock[0])
    assert inj.due(rows, clock[0]) == [fault] and inj.fire(fault) is False
    assert inj.due(rows, clock[0]) == []  # not again at once
    clock[0] += chaos_faults.RETRY_S
    proxy.links.append({"link": 7, "backend": 32801})
    assert inj.due(rows, clock[0]) == [fault] and inj.fire(fault) is True
    assert inj.pending == [] and inj.counts()["drop"] == 1
    assert [e.get("error") for e in inj.events] == ["no live link", None]


def test_a_stop_never_signals_a_server_with_no_process(tmp_path, monkeypatch):
    """A container mid-restart shows pid 0, and os.kill(0, SIGSTOP) would stop the driver's own process group."""
    signalled = []
    monkeypatch.setattr(chaos_faults, "pid_of", lambda target: 0)
    monkeypatch.setattr(chaos_faults.os, "kill", lambda pid, sig: signalled.append(pid))
    envs = SimpleNamespace(targets=lambda: ["c0ffee"], backend_of=lambda target: None)
    fault = Planned(1, "stop", 0.0)
    inj = injector(tmp_path, [fault], envs=envs)
    for kind in ("stop", "kill"):
        assert inj.fire(Planned(1, kind, 0.0)) is False
    assert signalled == [] and inj.counts()["stop"] == 0 and "no process" in inj.events[0]["error"]


# ---------------------------------------------------------------------------- a run with a judge (#64)
JUDGE = ("--rollouts", "async", "--judge", "/models/tiny-qwen3")


@pytest.mark.parametrize("steps", ["20", "8"])
def test_a_run_with_a_judge_plans_one_judge_kill_between_the_restarts_and_keeps_the_seeds_other_faults(steps):
    with_judge, args = default_plan(*JUDGE, "--steps", steps)
    without, _ = default_plan("--rollouts", "async", "--steps", steps)
    judged = [p for p in with_judge if p.kind == "judge_restart"]
    assert len(judged) == 1 and judged[0].after_step == args.judge_restart_after
    assert args.vllm_restart_after <= args.judge_restart_after <= min(args.kill_after), args  # between the restarts
    assert 1 <= args.judge_restart_after <= args.steps - 2  # a step after it shows what the dead judge did
    assert [p for p in with_judge if p.kind != "judge_restart"] == without


@pytest.mark.parametrize("argv", [("--judge", "/models/tiny-qwen3"), (*JUDGE, "--steps", "10", "--judge-restart-after", "9")])
def test_a_judge_needs_the_async_run_and_a_step_after_its_kill(argv, capsys):
    with pytest.raises(SystemExit):
        chaos.parse_args(list(argv))
    assert "--judge" in capsys.readouterr().err


STAND_IN_DOCKER = """#!/bin/bash
# a test double for the docker CLI: each call's verb logged; `exec -i C python3 -c SCRIPT WAIT` runs SCRIPT here against
# the stand-in judge's /metrics port; `kill` ends that poller (as the container's death would); `inspect`: healthy
echo "$1" >> "$DIR/calls"
case "$1" in
  exec) shift 4; "$PY" "$@" "$PORT" <&0 & echo $! > "$DIR/poller"; wait ;;
  kill) kill -9 "$(cat "$DIR/poller")" 2>/dev/null; true ;;
  inspect) echo healthy ;;
esac
"""


@pytest.fixture
def stand_in_judge(tmp_path, monkeypatch):
    """A stand-in docker CLI on PATH and a stand-in for the judge's vLLM /metrics (its running count settable)."""
    import http.server
    import os
    import sys

    metrics = {"running": 0.0}

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = ('# HELP vllm:num_requests_running\n'
                    f'vllm:num_requests_running{{engine="0",model_name="judge"}} {metrics["running"]}\n'
                    'vllm:num_requests_waiting{engine="0",model_name="judge"} 0.0\n').encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(STAND_IN_DOCKER)
    (bin_dir / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DIR", str(tmp_path))
    monkeypatch.setenv("PY", sys.executable)
    monkeypatch.setenv("PORT", str(server.server_address[1]))
    monkeypatch.setattr(chaos_faults, "JUDGE_DOWN_S", 0.0)
    monkeypatch.setattr(chaos_faults, "JUDGE_BUSY_WAIT_S", 0.5)
    yield metrics, lambda: (tmp_path / "calls").read_text().split() if (tmp_path / "calls").exists() else []
    server.shutdown()


def test_the_judge_fault_kills_the_judge_only_with_calls_in_flight_and_starts_it_again(tmp_path, stand_in_judge):
    """A test double for Docker (a stand-in CLI) and for the judge's /metrics: no judge container yet, none of its
    calls in flight, or a trainer restarted since the last step (its calls are a start's preflight), is tried again
    later (the kill must land on a training run's judge traffic); then the kill the moment a call is running, docker
    start JUDGE_DOWN_S later, followed to healthy; counted once."""
    metrics, calls = stand_in_judge
    container = [""]
    fault = Planned(2, "judge_restart", 0.5)
    inj = Injector(None, ProxyDouble(), 0, [fault], tmp_path / "chaos-log.jsonl", judge=lambda: container[0])
    assert inj.due([{"step": 2, "time": 100.0}], 1e9) == [fault]
    assert inj.fire(fault) is False and calls() == [] and "no judge container" in inj.events[0]["error"]
    container[0] = "d00dfeed" * 8
    assert inj.fire(fault) is False and calls() == ["exec"] and "no judge call" in inj.events[1]["error"]
    metrics["running"] = 2.0
    inj.record("trainer_kill", when=101.0, after_step=2)  # restarting: no step logged since
    assert inj.due([{"step": 2, "time": 100.0}], 2e9) == [] and not inj.training()
    assert inj.fire(fault) is False and calls() == ["exec", "exec"]  # a call in flight, but not a training run's
    assert inj.due([{"step": 2, "time": 100.0}, {"step": 3, "time": 102.0}], 2e9) == [fault]
    assert inj.fire(fault) is True
    inj.end()
    assert calls() == ["exec", "exec", "exec", "kill", "start", "inspect"]
    event = inj.events[-1]
    assert event["container"] == "d00dfeed" * 1 + "d00d" and event["healthy"] >= event["started"] >= event["time"]
    assert event["in_flight"] == {"running": 2.0, "waiting": 0.0}
    assert inj.counts()["judge_restart"] == 1 and inj.pending == []
    from bench.chaos_figures import judge_restart_figure

    traces = [{"reward": 0.5, "rewards": {"judge": 0.5}, "judge": {"score": 0.5, "failure": None}},
              {"reward": None, "rewards": {"judge": None}, "judge": {"score": None, "failure": "judge unreachable: "
               "RemoteProtocolError at http://judge:8000/v1/chat/completions: Server disconnected"}},
              {"reward": None, "rewards": {"judge": None}, "judge": {"score": None, "failure": "judge unreachable: "
               "ConnectError at http://judge:8000/v1/chat/completions: [Errno -2] Name or service not known"}},
              {"reward": 0.0, "rewards": {"judge": None}, "judge": {"score": None, "failure": "judge timeout: ..."}}]
    figure = judge_restart_figure(inj.events, [{"step": 3, "judge/failures": 2}, {"step": 4, "judge/failures": 0}],
                                  traces)
    assert figure["after_step"] == 2 and figure["judge_failures"] == 2 and figure["healthy_after_s"] >= 0
    assert figure["failure_steps"] == [3] and figure["in_flight"]["running"] == 2.0
    assert (figure["traced_judged"], figure["traced_failed"], figure["traced_cut"], figure["traced_absent"]) == \
        (4, 3, 1, 2)
    assert figure["traced_failed_scored"] == 1  # the timed-out row given a reward: a failed call scored
    assert judge_restart_figure(inj.events, [{"step": 3}])["judge_failures"] is None  # the trainer logs none


# ---------------------------------------------------------------------------- the proxy's hostile frames
HANDSHAKE = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"


def text_frame(payload: bytes) -> bytes:
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big")
    return b"\x81" + size + payload


def test_the_frame_cursor_knows_where_frames_end():
    cursor = chaos_proxy.FrameCursor()
    cursor.feed(HANDSHAKE[:20])
    assert cursor.websocket is None and not cursor.at_boundary
    cursor.feed(HANDSHAKE[20:])
    assert cursor.at_boundary
    long = text_frame(b"x" * 300)  # a 16-bit length
    for cut in (1, 3, 150):  # inside the header, at its end, inside the payload
        cursor.feed(long[:cut])
        assert not cursor.at_boundary, cut
        cursor.feed(long[cut:])
        assert cursor.at_boundary, cut
    masked = b"\x81\x85abcd" + b"hello"  # a client's frame shape (mask key) is parsed too
    cursor.feed(masked + text_frame(b"hi")[:2])
    assert not cursor.at_boundary
    cursor.feed(b"hi" + b"\x8a\x00" * 3)
    assert cursor.at_boundary
    plain = chaos_proxy.FrameCursor()
    plain.feed(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n\x8a\x00")
    assert plain.websocket is False and not plain.at_boundary  # not an upgrade: never a frame injected


def serve_once(ready: threading.Event, port: list, conn: list) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port.append(srv.getsockname()[1])
        ready.set()
        conn.append(srv.accept()[0])


def read_exactly(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, f"closed after {out!r}"
        out += chunk
    return out


@pytest.mark.parametrize("kind", ["pong", "ping"])
def test_hostile_frames_go_between_the_servers_frames_until_the_client_closes(kind):
    """A stand-in WebSocket server (a raw socket: the handshake's 101, then frames) behind the real proxy; the
    burst asked for while a frame is half sent comes only after that frame's last byte."""
    ready, port, conn = threading.Event(), [], []
    threading.Thread(target=serve_once, args=(ready, port, conn), daemon=True).start()
    ready.wait(30)
    proxy = chaos_proxy.ChaosProxy([("127.0.0.1", port[0])])
    client = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
    try:
        client.sendall(b"GET /ws HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 30
        while not conn:  # the proxy connects to the stand-in once the client is in
            assert time.monotonic() < deadline, "the proxy never reached the stand-in server"
            time.sleep(0.01)
        server = conn[0]
        frame = text_frame(b"a reply of some length " * 8)
        server.sendall(HANDSHAKE + frame[:40])
        assert read_exactly(client, len(HANDSHAKE) + 40) == HANDSHAKE + frame[:40]
        got = proxy.hostile_frames(kind)
        assert got is not None and got["frames"] == kind
        server.sendall(frame[40:])
        burst = chaos_proxy.HOSTILE_FRAMES[kind] * chaos_proxy.HOSTILE_BURST
        assert read_exactly(client, len(frame) - 40 + len(burst)) == frame[40:] + burst
        assert proxy.link_ends(got["link"]) == {"client": None, "server": None}
    finally:
        client.close()
    deadline = time.monotonic() + 30
    while proxy.link_ends(got["link"])["client"] is None:  # the proxy's loop reads the close
        assert time.monotonic() < deadline, "the proxy never saw the client close"
        time.sleep(0.01)
    assert proxy.hostile_frames(kind) is None  # no live WebSocket link left
    ends = proxy.link_ends(got["link"])
    assert ends["server"] is None or ends["server"] >= ends["client"]  # the trainer's side ended it first
    server.close()
    proxy.close()

