"""trainer.rollouts.rollout_loop.ToolRunner on in-process tools: order, timeouts, and which failures are whose."""

from __future__ import annotations

import threading

from trainer.rollouts.rollout_loop import NOT_RUN_ERROR, TIMEOUT_ERROR, RolloutCalls, ToolRunner, tool_messages


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_rollouts_calls_run_in_the_models_order():
    log = []
    tools = {"step": lambda n: log.append(n) or f"step {n}"}
    [results] = ToolRunner().run([RolloutCalls([call("step", n=k) for k in range(5)], tools, {})])
    assert log == [0, 1, 2, 3, 4] and [r.value for r in results] == [f"step {k}" for k in range(5)]


def test_a_tools_own_timeout_error_is_a_plain_failure():
    def slow_server(**_):
        raise TimeoutError("No reply from ws://env within 120 s")

    abandoned = []
    [results] = ToolRunner(timeout_s=60).run([RolloutCalls([call("t"), call("t")], {"t": slow_server}, {},
                                                           lambda: abandoned.append(1))])
    assert [r.value for r in results] == [{"error": "No reply from ws://env within 120 s"}] * 2
    assert not any(r.timed_out for r in results) and abandoned == []


def test_a_hung_call_times_out_the_rest_of_its_turn_is_not_run_and_others_finish():
    release = threading.Event()
    abandoned = []
    tools = {"hang": lambda: release.wait(600) and "late", "ok": lambda: "fine"}
    runner = ToolRunner(timeout_s=3)  # the hung call never ends by itself; the others take milliseconds
    try:
        hung, other = runner.run([RolloutCalls([call("hang"), call("ok")], tools, {}, lambda: abandoned.append("hung")),
                                  RolloutCalls([call("ok")], tools, {})])
    finally:
        release.set()
    assert hung[0].timed_out and hung[0].value == {"error": TIMEOUT_ERROR.format(name="hang", seconds=3)}
    assert hung[1].value == {"error": NOT_RUN_ERROR} and hung[1].failed
    assert [r.value for r in other] == ["fine"] and abandoned == ["hung"]


def test_unknown_tools_and_other_call_types_fail_like_trl():
    [results] = ToolRunner().run([RolloutCalls([call("nope"), {"type": "code", "name": "x"}], {}, {})])
    assert [r.value for r in results] == [{"error": "Tool nope not found."},
                                          {"error": "Unsupported tool call type: code"}]
    assert [m["content"] for m in tool_messages(results)] == [str(r.value) for r in results]
