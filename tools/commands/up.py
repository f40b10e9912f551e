"""Build what is missing and start the env servers (and vLLM in gpu mode), health-gated."""

from __future__ import annotations

from envs import naming
from tools import fleet, stack
from tools.commands.build import build
from tools.prepare import prepare


def long_running_services(env: dict[str, str], mode: str) -> list[str]:
    from envs import registry

    custom = stack.custom_envs(env)  # an env only in ENV_URLS runs elsewhere: no service here
    services = [] if stack.fleet_mode(env) else [naming.service_name(n) for n in stack.env_names(env)
                                                 if registry.is_builtin(n) or n in custom]
    if stack.mode_spec(mode).runs_vllm_service:
        services.append("vllm")
    return services


def dashboard_wanted(env: dict[str, str]) -> bool:
    return (env.get("DASHBOARD") or "0").strip().lower() in ("1", "true", "yes", "on")


def bring_up(compose_vars: dict[str, str], mode: str) -> None:
    """Build, deploy the fleet if any, start the long-running services and wait until they are healthy. Updates
    `compose_vars` in place with the replica counts, so later compose calls keep the scale."""
    env = stack.load_env()
    if stack.fleet_mode(env):
        fleet.role(env)  # no swarm: say so before any build
    build(compose_vars, mode)
    processes = int(compose_vars.get("TRAINER_PROCESSES") or env.get("TRAINER_PROCESSES") or 1)  # each opens its sessions
    if stack.fleet_mode(env):
        fleet.up_here(env, mode, processes)
    services = long_running_services(env, mode)
    profiles = compose_vars["COMPOSE_PROFILES"]
    if dashboard_wanted(env):
        problem = stack.check_port(env, "DASHBOARD_PORT")
        if problem:
            raise stack.StackError(problem)
        services.append("dashboard")
        profiles += ",dashboard"
    if not stack.fleet_mode(env):
        stack.check_custom_images(env)
        compose_vars.update(stack.resolve_auto_replicas(env, mode, processes))
    if not services:
        return
    stack.say("starting " + ", ".join(services) + " and waiting until healthy")
    if stack.compose({**compose_vars, "COMPOSE_PROFILES": profiles}, "up", "-d", "--wait", *services) != 0:
        custom = stack.unhealthy_custom_envs(compose_vars, env)
        raise stack.StackError("; ".join(custom) if custom else
                               "some services did not become healthy: `make ps` and `make logs` show why; "
                               "`make doctor` checks the usual causes")


def run(rest: list[str]) -> int:
    bring_up(*prepare())
    return 0
