"""Env-server fleets on Docker Swarm: `make fleet-up`, `fleet-ps`, `fleet-logs`, `fleet-down` (docs/fleets.md).

The env servers .env names (ENV_NAME, ENV_<NAME>_IMAGE, ENV_<NAME>_REPLICAS, MAX_CONCURRENT_ENVS, ENV_MEM_LIMIT, ...)
become one Swarm stack, FLEET_STACK. Each service is the Compose stack's own env service as `docker compose config`
resolves it (same image, environment, health check, limits), reshaped for Swarm:
  * endpoint_mode dnsrr: `tasks.env-<name>` lists every healthy task and the trainer spreads its sessions over
    them (the service's virtual IP needs IPVS, which not every host has);
  * replicas spread over nodes, and kept off nodes labelled grpo.role=gpu (the GPU host);
  * restarted on any exit; rolling updates start a new task before stopping an old one, one at a time, so the
    capacity the trainer needs never drops; a failed update rolls back;
  * memory and pids limits, read-only root with a tmpfs /tmp, no capabilities, env-template's non-root user;
  * no-new-privileges, which Swarm drops from `security_opt`: required from every env node's Docker daemon
    ("no-new-privileges": true in daemon.json), checked by a one-shot job of our own image (check_no_new_privileges);
  * one encrypted, attachable overlay network named FLEET_STACK, which the trainer (under Compose) joins.
vLLM never joins it: its unauthenticated dev routes stay on the GPU host's private network.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
from pathlib import Path

from contract.config import TrainModeVariant
from envs import naming
from tools import compose_file, derive, docker_host, env_ports, settings
from tools.plan import env_servers_plan
from tools.prepare import compose_vars_for
from tools.docker_host import run
from tools.env_kinds import env_kinds
from tools.errors import StackError, say
from tools.images import local_env_image
from tools.settings import ROOT

FLEET_ENVS_FILE = "compose.fleet-envs"  # .stack/: the env servers as Compose services, what the fleet is made from
WAIT_S = 300  # for every task of a deploy to be running and healthy (an image pull on a new node included)
GPU_HOST_LABEL = "grpo.role"  # `docker node update --label-add grpo.role=gpu <gpu host>`: no env task lands there


# ------------------------------------------------------------------ the swarm
def swarm_role() -> tuple[str | None, str | None]:
    """(`manager` | `worker` | None, what to run when this node cannot manage the fleet)."""
    r = run(["docker", "info", "--format", "{{json .Swarm}}"])
    if r.returncode != 0:
        return None, docker_host.check_docker()
    swarm = json.loads(r.stdout or "{}")
    state = swarm.get("LocalNodeState")
    if state != "active":
        return None, (f"this Docker engine is not in a swarm (state: {state or 'inactive'}): run `docker swarm init` on "
                      "the first machine, `docker swarm join --token ...` on the others (docs/fleets.md)")
    if not swarm.get("ControlAvailable"):
        return "worker", ("this node is a swarm worker: run `make fleet-up` / `fleet-down` on a manager (`docker node "
                          "ls` there lists them); `make train` here joins the fleet's network without managing it")
    return "manager", None


def swarm_problem() -> str | None:
    """None on a swarm manager; else one line saying what to run."""
    return swarm_role()[1]


@contextlib.contextmanager
def local_swarm():
    """A one-node swarm for tests and benchmarks: this engine's, or one initialised now and left on exit. Leaving
    breaks the name resolution of containers started afterwards on bridge networks made before (Docker 20.10: a new
    container on a running stack's network no longer resolves its services), so nothing else should run meanwhile
    (`make test` runs these tests first, alone: the `swarm` marker)."""
    state = json.loads(run(["docker", "info", "--format", "{{json .Swarm}}"]).stdout or "{}")
    created = state.get("LocalNodeState") != "active"
    if created and run(["docker", "swarm", "init"]).returncode != 0:  # several addresses: the default route's
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.254", 9))  # sends nothing: picks the route's source address
            address = s.getsockname()[0]
        r = run(["docker", "swarm", "init", "--advertise-addr", address])
        if r.returncode != 0:
            raise StackError(f"`docker swarm init` failed: {r.stderr.strip()}")
    problem = swarm_problem()
    if problem:
        raise StackError(problem)
    try:
        yield created
    finally:
        if created:
            run(["docker", "swarm", "leave", "--force"], timeout=120)


def require_manager() -> None:
    problem = swarm_problem()
    if problem:
        raise StackError(problem)


stack_name = derive.fleet_stack_name


def fleet_envs(dotenv: dict[str, str]) -> list[str]:
    """The envs the fleet serves: ENV_NAME's, but those ENV_URLS points elsewhere."""
    return list(env_kinds(dotenv).served_here)


# ------------------------------------------------------------------ the stack file
def compose_services(dotenv: dict[str, str]) -> dict[str, dict]:
    """The Compose stack's env services for .env, resolved by `docker compose config` (interpolated, extended)."""
    names = fleet_envs(dotenv)
    compose_vars = compose_vars_for(env_servers_plan(dotenv), FLEET_ENVS_FILE)
    compose_vars["COMPOSE_PROFILES"] = ",".join(names)
    cmd, cmd_env = docker_host.compose_command(compose_vars, "config", "--format", "json", *[naming.service_name(n) for n in names])
    r = subprocess.run(cmd, cwd=ROOT, env=cmd_env, capture_output=True, text=True)
    if r.returncode != 0:
        raise StackError(f"`docker compose config` failed: {r.stderr.strip()[-400:]}")
    return json.loads(r.stdout)["services"]


def size_bytes(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kmg]?)b?", str(text).strip().lower())
    if not m:
        raise StackError(f"cannot read the size {text!r}; write it as e.g. 4g or 512m in .env")
    return int(m[1]) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m[2]]


def swarm_service(svc: dict) -> dict:
    """One Compose env service as a Swarm service (module docstring: what changes and why)."""
    tmpfs = []
    for entry in svc.get("tmpfs") or []:
        target, _, opts = entry.partition(":")
        size = dict(o.split("=", 1) for o in opts.split(",") if "=" in o).get("size")
        tmpfs.append({"type": "tmpfs", "target": target, **({"tmpfs": {"size": size_bytes(size)}} if size else {})})
    limits: dict = {}
    if svc.get("mem_limit"):
        limits["memory"] = str(size_bytes(svc["mem_limit"]))  # the stack file wants a string
    if svc.get("pids_limit"):
        limits["pids"] = int(svc["pids_limit"])
    out = {
        "image": svc["image"],
        "environment": svc.get("environment") or {},
        "healthcheck": svc["healthcheck"],
        "read_only": bool(svc.get("read_only")),
        "cap_drop": svc.get("cap_drop") or [],
        "volumes": tmpfs,
        "networks": ["fleet"],
        "stop_grace_period": "20s",
        "deploy": {
            "mode": "replicated",
            "replicas": int((svc.get("deploy") or {}).get("replicas") or 1),
            "endpoint_mode": "dnsrr",
            "placement": {"preferences": [{"spread": "node.id"}],
                          "constraints": [f"node.labels.{GPU_HOST_LABEL} != gpu"]},
            "restart_policy": {"condition": "any", "delay": "2s"},
            "update_config": {"parallelism": 1, "order": "start-first", "failure_action": "rollback",
                              "monitor": "30s"},
            "rollback_config": {"parallelism": 1, "order": "start-first"},
            "resources": {"limits": limits},
        },
    }
    for key in ("user", "command", "entrypoint"):  # as Compose runs it (user: env-template's non-root uid)
        if svc.get(key):
            out[key] = svc[key]
    return out


def stack_file(dotenv: dict[str, str]) -> dict:
    services = compose_services(dotenv)
    return {
        "services": {name: swarm_service(svc) for name, svc in services.items()},
        "networks": {"fleet": {"name": stack_name(dotenv), "driver": "overlay", "attachable": True,
                               "driver_opts": {"encrypted": ""}}},  # IPsec between nodes
    }


def stack_path(dotenv: dict[str, str]) -> Path:
    return ROOT / ".stack" / f"fleet.{stack_name(dotenv)}.yaml"


def write_stack_file(dotenv: dict[str, str]) -> tuple[Path, dict]:
    path, spec = stack_path(dotenv), stack_file(dotenv)
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"# Generated by tools/fleet.py from {settings.ENV_FILE.name}; do not edit. Deploy: make fleet-up\n"
                    + compose_file.yaml_text(spec))
    return path, spec


# ------------------------------------------------------------------ no-new-privileges
# Swarm ignores `security_opt`, and nothing an env image runs can vouch for its own flag (a `setpriv` or `grep` in it
# can be a script that lies), so the flag must come from each node's daemon and be read by a program we trust: our
# env-server image, as a one-shot job on every node that takes env tasks. `docker info` cannot tell: Docker 20.10 does
# not list the daemon's no-new-privileges in SecurityOptions (24.0 does), and it only describes the local daemon.
NNP_SETTING = "FLEET_ALLOW_NEW_PRIVILEGES"  # =1: deploy even where a daemon does not set it (SECURITY.md says the risk)
NNP_CHECK_S = 120  # for every node's check task to finish (the image must already be on the node: no pull)
NNP_OFF_EXIT = 3
NNP_SCRIPT = ("import sys; s = open('/proc/self/status').read(); "
              f"sys.exit(0 if 'NoNewPrivs:\\t1' in s else {NNP_OFF_EXIT})")
TERMINAL = ("Complete", "Failed", "Rejected", "Shutdown", "Orphaned", "Remove")


def nnp_check_command(name: str, image: str) -> list[str]:
    """The check job: on every ready, active node not labelled grpo.role=gpu (where fleet tasks may land), once, with
    the env servers' hardening and small limits; no security_opt (Swarm would drop it; the daemon's is what it reads)."""
    return ["docker", "service", "create", "--detach", "--name", name, "--mode", "global-job", "--no-resolve-image",
            "--restart-condition", "none", "--constraint", f"node.labels.{GPU_HOST_LABEL} != gpu",
            "--read-only", "--cap-drop", "ALL", "--user", naming.SERVER_USER, "--limit-memory", "64m",
            "--limit-pids", "16", "--entrypoint", "python3", "--", image, "-c", NNP_SCRIPT]


def env_nodes() -> list[str]:
    """Hostnames of the nodes Swarm may put env tasks on now: ready, active, not labelled grpo.role=gpu."""
    ids = run(["docker", "node", "ls", "-q"]).stdout.split()
    if not ids:
        return []
    r = run(["docker", "node", "inspect", "--format", "{{.Description.Hostname}} {{.Status.State}} "
             f'{{{{.Spec.Availability}}}} {{{{index .Spec.Labels "{GPU_HOST_LABEL}"}}}}', *ids])
    rows = [line.split() + [""] for line in r.stdout.splitlines() if line.strip()]
    return sorted(row[0] for row in rows if row[1:3] == ["ready", "active"] and row[3] != "gpu")


def nnp_verdicts(rows: list[dict]) -> dict[str, str]:
    """Node -> `on`, `off` or why it could not be checked, from the check job's finished tasks (`docker service ps`)."""
    out = {}
    for t in rows:
        state = t.get("CurrentState", "").split(" ", 1)[0]
        if state not in TERMINAL:
            continue
        error = t.get("Error", "").strip('"')
        out[t["Node"]] = ("on" if state == "Complete" else "off" if error.endswith(f"exit ({NNP_OFF_EXIT})")
                          else f"{state.lower()}: {error or 'no error given'}")
    return out


def check_no_new_privileges(name: str, image: str, timeout_s: float = NNP_CHECK_S) -> str | None:
    """None when every env node's daemon sets no-new-privileges; else one line: which nodes, and what to set."""
    job = f"{name}-nnp-check"
    run(["docker", "service", "rm", job])  # one a crash left behind
    nodes = env_nodes()
    try:
        r = run(nnp_check_command(job, image), timeout=60)
        if r.returncode != 0:
            return (f"could not start the no-new-privileges check ({r.stderr.strip()[-300:]}): a swarm job needs Docker "
                    f"20.10 or newer on the managers; or set {NNP_SETTING}=1 in .env to deploy without no-new-privileges")
        deadline = time.monotonic() + timeout_s
        while True:
            verdicts = nnp_verdicts(tasks_of(job, "--no-trunc"))  # whole error texts
            if set(nodes) <= set(verdicts) or time.monotonic() > deadline:
                break
            time.sleep(1)
    finally:
        run(["docker", "service", "rm", job], timeout=60)  # done or timed out: removed by name
    off = [n for n in nodes if verdicts.get(n) == "off"]
    unknown = [f"{n} ({verdicts.get(n) or f'no answer in {timeout_s:.0f} s'})" for n in nodes
               if verdicts.get(n) not in ("on", "off")]
    if not off and not unknown:
        return None
    what = "; ".join(filter(None, [
        off and (f"the Docker daemon of {', '.join(off)} does not set it: add \"no-new-privileges\": true to "
                 "/etc/docker/daemon.json there and restart Docker (`sudo systemctl restart docker`)"),
        unknown and (f"{', '.join(unknown)} could not run the check with {image}: load it there (`docker save "
                     f"{image} | ssh <node> docker load`)")]))
    return (f"fleet tasks get no-new-privileges only from each node's Docker daemon (Swarm drops security_opt): "
            f"{what}; or set {NNP_SETTING}=1 in .env to deploy without it (setuid binaries in an env image can then "
            "regain privileges; SECURITY.md)")


def allows_new_privileges(dotenv: dict[str, str]) -> bool:
    return settings.StackEnv.from_values(dotenv).FLEET_ALLOW_NEW_PRIVILEGES  # a bad value: one line naming it


def require_no_new_privileges(dotenv: dict[str, str]) -> None:
    """`fleet up` refuses unless every env node's daemon sets no-new-privileges, or .env opts out."""
    if allows_new_privileges(dotenv):
        say(f"note: {NNP_SETTING}=1: fleet tasks run without no-new-privileges wherever a node's Docker daemon does "
            "not set it (SECURITY.md)")
        return
    problem = check_no_new_privileges(stack_name(dotenv), local_env_image())
    if problem:
        raise StackError(problem)


# ------------------------------------------------------------------ state
def services(name: str) -> dict[str, dict]:
    """Service name -> `docker service ls` row, for the stack's services."""
    r = run(["docker", "service", "ls", "--filter", f"label=com.docker.stack.namespace={name}", "--format", "json"])
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]
    return {row["Name"]: row for row in rows}


def tasks(service: str) -> list[dict]:
    return tasks_of(service, "--filter", "desired-state=running")


def tasks_of(service: str, *args: str) -> list[dict]:
    r = run(["docker", "service", "ps", service, *args, "--format", "json"])
    return [json.loads(line) for line in r.stdout.splitlines() if line.strip().startswith("{")]


def converged(service: str) -> tuple[bool, str]:
    """(every desired task running and healthy, and no update in flight; `docker service ls`'s REPLICAS)."""
    r = run(["docker", "service", "inspect", service, "--format",
             "{{json .Spec.Mode.Replicated.Replicas}} {{json .UpdateStatus}}"])
    if r.returncode != 0:
        return False, "not found"
    want_text, _, update_text = r.stdout.strip().partition(" ")
    update = json.loads(update_text or "null") or {}
    if update.get("State") in ("updating", "rollback_started", "paused", "rollback_paused"):
        return False, f"update {update['State']}"
    states = [t.get("CurrentState", "") for t in tasks(service)]
    running = sum(s.startswith("Running") for s in states)  # Swarm keeps a task `Starting` until it is healthy
    want = int(want_text or 0)
    return running == want and len(states) == want, f"{running}/{want} running and healthy"


def wait_converged(name: str, expected: list[str], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = {s: converged(s) for s in expected}
        if all(ok for ok, _ in status.values()):
            return
        if time.monotonic() > deadline:
            detail = "; ".join(f"{s}: {why}" for s, (ok, why) in status.items() if not ok)
            errors = [f"{t['Name']} {t['CurrentState']} {t.get('Error', '')}".strip() for s in expected for t in
                      tasks(s) if not t.get("CurrentState", "").startswith("Running")]
            raise StackError(f"the fleet did not converge in {timeout_s:.0f} s ({detail})"
                             + (f"; tasks: {', '.join(errors[:6])}" if errors else "")
                             + ". `make fleet-ps` and `make fleet-logs` show why; an image missing on a node is "
                             "the usual cause (docs/fleets.md)")
        time.sleep(2)


# ------------------------------------------------------------------ commands
def local_only(image: str) -> bool:
    r = run(["docker", "image", "inspect", "--format", "{{json .RepoDigests}}", "--", image])
    return r.returncode == 0 and json.loads(r.stdout or "[]") == []


def cmd_up(dotenv: dict[str, str], mode: TrainModeVariant | None = None, processes: int | None = None) -> int:
    """Deploy or update the fleet; ENV_<NAME>_REPLICAS=auto sized for `processes` trainer processes (default:
    TRAINER_PROCESSES, else 1) in the resolved `mode` (None: TRAIN_MODE as .env says)."""
    require_manager()
    name = stack_name(dotenv)
    if not derive.fleet_mode(dotenv):
        say("note: ENV_FLEET=compose in .env: `make train` keeps using the Compose env servers; set ENV_FLEET=swarm "
            "to train against this fleet")
    envs = env_kinds(dotenv)
    docker_host.check_custom_images(envs)
    local = local_env_image()
    checks = not allows_new_privileges(dotenv)  # the no-new-privileges check runs our image
    if checks or any(envs.images.get(n, local) == local for n in envs.served_here):
        compose_vars = compose_vars_for(env_servers_plan(dotenv), FLEET_ENVS_FILE)
        if docker_host.build(compose_vars, "env-server-image", extra_profiles=("build",), quiet=True) != 0:
            raise StackError("building the env-server image failed (see above)")
    require_no_new_privileges(dotenv)  # before anything of the env images runs
    ports, lines = env_ports.resolve(envs, dotenv, docker_host.exposed_ports(envs))
    for line in lines:
        say(line)
    dotenv = {**dotenv, **env_ports.compose_vars(ports)}  # the stack file's env services: their servers' ports
    processes = processes or int(dotenv.get("TRAINER_PROCESSES") or 1)
    dotenv = {**dotenv, **docker_host.resolve_auto_replicas(envs, dotenv, mode, processes, ports)}
    path, spec = write_stack_file(dotenv)
    images = sorted({svc["image"] for svc in spec["services"].values()})
    local = [i for i in images if local_only(i)]
    nodes = len([line for line in run(["docker", "node", "ls", "-q"]).stdout.split() if line])
    if local and nodes > 1:
        say(f"note: image(s) only on this machine: {', '.join(local)}; a node without them cannot run their tasks: "
            "push them to a registry every node can pull from, or `docker save` | `docker load` them on each node")
    # --resolve-image never: a local-only image has no registry digest to pin (and CI has no registry).
    r = subprocess.run(["docker", "stack", "deploy", "--prune", "--detach=true", "--resolve-image",
                        "never" if local else "always", "-c", str(path), name],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise StackError(f"`docker stack deploy` failed: {r.stderr.strip()[-600:]}")
    expected = [f"{name}_{svc}" for svc in spec["services"]]
    say(f"fleet {name}: deployed {', '.join(expected)} ({path.relative_to(ROOT)}); waiting until every task is healthy")
    wait_converged(name, expected)
    for service in expected:  # start-first + rollback: a bad update leaves the old tasks serving; say so
        r = run(["docker", "service", "inspect", service, "--format", "{{json .UpdateStatus}}"])
        status = json.loads(r.stdout or "null") or {}
        if status.get("State") == "rollback_completed":
            say(f"note: {service}'s last update was rolled back ({status.get('Message', '')}); it runs the previous "
                "spec. `make fleet-logs` shows why the new tasks failed")
    print_ps(name)
    return 0


def print_ps(name: str) -> None:
    rows = services(name)
    if not rows:
        say(f"fleet {name}: no services (`make fleet-up` deploys them)")
        return
    for service, row in sorted(rows.items()):
        say(f"{service}: {row.get('Replicas')} tasks, image {row.get('Image')}")
        for t in sorted(tasks(service), key=lambda t: t["Name"]):
            say(f"  {t['Name']:<28} node {t['Node']:<20} {t['CurrentState']}"
                + (f"  {t['Error']}" if t.get("Error") else ""))


def cmd_ps(dotenv: dict[str, str]) -> int:
    require_manager()
    print_ps(stack_name(dotenv))
    return 0


def cmd_logs(dotenv: dict[str, str]) -> int:
    require_manager()
    for service in sorted(services(stack_name(dotenv))):
        say(f"--- {service}")
        subprocess.call(["docker", "service", "logs", "--tail", "100", "--timestamps", service])
    return 0


def cmd_down(dotenv: dict[str, str], timeout_s: float = 120) -> int:
    """Remove the stack and wait until its containers and network are gone (`docker stack rm` returns at once)."""
    require_manager()
    name = stack_name(dotenv)
    r = run(["docker", "stack", "rm", name], timeout=60)
    if r.returncode != 0 and "Nothing found in stack" not in r.stderr + r.stdout:
        raise StackError(f"`docker stack rm {name}` failed: {r.stderr.strip()}")
    deadline = time.monotonic() + timeout_s
    while True:
        left = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.stack.namespace={name}"]).stdout.split()
        network = run(["docker", "network", "inspect", name]).returncode == 0
        if not left and not network:
            say(f"fleet {name}: removed (services, tasks and the {name} network)")
            return 0
        if time.monotonic() > deadline:
            what = (f"{len(left)} container(s)" if left else "") + (" and " if left and network else "") + \
                   (f"the {name} network (a container outside the stack still uses it? `docker network inspect "
                    f"{name}`)" if network else "")
            raise StackError(f"fleet {name}: still there after {timeout_s:.0f} s: {what}")
        time.sleep(1)


def role(dotenv: dict[str, str]) -> str:
    """ENV_FLEET=swarm: `manager` (this node deploys the fleet) or `worker` (it joins the fleet's network as it
    is); anything else stops with what to run."""
    found, problem = swarm_role()
    if found == "manager":
        return found
    if found == "worker" and run(["docker", "network", "inspect", stack_name(dotenv)]).returncode == 0:
        return found
    raise StackError(f"ENV_FLEET=swarm: {problem}")


def up_here(dotenv: dict[str, str], mode: TrainModeVariant, processes: int) -> None:
    """`make up/train` with ENV_FLEET=swarm: on a manager, deploy or update the fleet (a no-op when .env did not
    change); on a worker, join the fleet's network as it is."""
    if role(dotenv) == "manager":
        cmd_up(dotenv, mode, processes)
    else:
        say(f"fleet {stack_name(dotenv)}: this node is a worker; joining the fleet's network as it is (a manager "
            "runs make fleet-up)")


def main(argv: list[str]) -> int:
    dotenv = settings.load_env()
    commands = {"up": cmd_up, "ps": cmd_ps, "logs": cmd_logs, "down": cmd_down}
    if not argv or argv[0] not in commands:
        print(__doc__)
        return 2
    return commands[argv[0]](dotenv)
