"""Start the dashboard on 127.0.0.1:$DASHBOARD_PORT (opt-in; never published beyond loopback): TensorBoard, or
trackio's UI when REPORT_TO names trackio."""

from __future__ import annotations

from contract import tracker_names
from tools import docker_host
from tools.errors import StackError, say
from tools.prepare import Prepared, prepare


def start(prepared: Prepared) -> None:
    values = prepared.plan.values
    problem = docker_host.check_port(values, "DASHBOARD_PORT")
    if problem:
        raise StackError(problem)
    # The dashboard runs on the CPU trainer image, which holds the trackers REPORT_TO names once built with them.
    prepared.build("trainer-cpu-image", extra_profiles=("build",), quiet=True)
    if prepared.compose("up", "-d", "dashboard", extra_profiles=("dashboard",)) != 0:
        raise StackError("the dashboard did not start: `make logs` shows why")
    url = f"http://127.0.0.1:{prepared.plan.settings.DASHBOARD_PORT}"
    if "trackio" in tracker_names.parse(values.get("REPORT_TO") or "tensorboard"):
        url += f"/?project={tracker_names.PROJECT}"
    say(f"dashboard: {url}")


def run(rest: list[str]) -> int:
    start(prepare())
    return 0
