"""Build what is missing and start the env servers (and vLLM in gpu mode), health-gated."""

from __future__ import annotations

from tools import docker_host, fleet
from tools.errors import StackError, say
from tools.commands.build import build
from tools.prepare import Prepared, prepare


def bring_up(prepared: Prepared, hold: tuple[str, ...] = ()) -> None:
    """Build, deploy the fleet if any, start the plan's long-running services (but those in `hold`, the caller's to
    start) and wait until they are healthy. Adds the resolved replica counts to `prepared.compose_vars`, so later
    compose calls keep the scale."""
    plan, values = prepared.plan, prepared.plan.values
    if plan.fleet:
        fleet.role(values)  # no swarm: say so before any build
    exposure = docker_host.check_loopback_guarantee()
    if exposure:  # warn, do not stop: CI's Debian engine is 20.10, and the fix is the host's (SECURITY.md)
        say(f"WARNING: {exposure}")
    build(prepared)
    processes = int(prepared.compose_vars.get("TRAINER_PROCESSES") or values.get("TRAINER_PROCESSES") or 1)
    if plan.fleet:
        fleet.up_here(values, plan.mode, processes)
        prepared.read_ports_again()  # the fleet's images are here now: the trainer reaches their servers' ports
    services, profiles = [s for s in plan.services if s not in hold], prepared.compose_vars["COMPOSE_PROFILES"]
    if plan.settings.DASHBOARD:
        problem = docker_host.check_port(values, "DASHBOARD_PORT")
        if problem:
            raise StackError(problem)
        services.append("dashboard")
        profiles += ",dashboard"
    if not plan.fleet:
        if docker_host.check_custom_images(plan.envs):  # pulled now: their EXPOSE was not known to the plan
            prepared.read_ports_again()
        prepared.compose_vars.update(docker_host.resolve_auto_replicas(plan.envs, values, plan.mode, processes,
                                                                       prepared.plan.ports))  # each opens sessions
    if not services:
        return
    say("starting " + ", ".join(services) + " and waiting until healthy")
    if docker_host.compose({**prepared.compose_vars, "COMPOSE_PROFILES": profiles}, "up", "-d", "--wait", *services) != 0:
        custom = docker_host.unhealthy_custom_envs(prepared.compose_vars, plan.envs, prepared.plan.ports)
        raise StackError("; ".join(custom) if custom else
                               "some services did not become healthy: `make ps` and `make logs` show why; "
                               "`make doctor` checks the usual causes")


def run(rest: list[str]) -> int:
    bring_up(prepare())
    return 0
