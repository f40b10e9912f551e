"""Start the dashboard on 127.0.0.1:$DASHBOARD_PORT (opt-in; its port is never published beyond loopback)."""

from __future__ import annotations

from tools import stack
from tools.prepare import Prepared, prepare


def start(prepared: Prepared) -> None:
    env = prepared.plan.values
    problem = stack.check_port(env, "DASHBOARD_PORT")
    if problem:
        raise stack.StackError(problem)
    if prepared.mode != "cpu":  # the dashboard runs on the CPU trainer image
        prepared.compose("build", "trainer-cpu-image", extra_profiles=("build",))
    if prepared.compose("up", "-d", "dashboard", extra_profiles=("dashboard",)) != 0:
        raise stack.StackError("the dashboard did not start: `make logs` shows why")
    stack.say(f"dashboard: http://127.0.0.1:{env.get('DASHBOARD_PORT') or 6006}")


def run(rest: list[str]) -> int:
    start(prepare())
    return 0
