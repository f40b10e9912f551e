"""Two swarm nodes on one machine: this engine (manager) and a second Docker engine in a container (worker).

What it shows, on a real two-node swarm: `fleet up` spreads an env's tasks over the nodes, and a node
labelled grpo.role=gpu (the GPU host) gets none of them; no-new-privileges is checked per node (the nested engine's
daemon sets it, this one's does not), and the GPU host, which gets no env task, is not checked.
What it cannot show here: traffic to the tasks on the nested node. It joins and runs healthy tasks, but
the overlay's VXLAN packets that reach it are never answered: on this host it cannot be `--privileged`
(the engine lacks CAP_SYS_RESOURCE, and --privileged asks for every capability), and without that it
cannot set up its overlay bridge ("/sys/class/net/br0/bridge/default_pvid: permission denied" in its
log). Sessions over the overlay are what tests/tools/test_fleet_swarm.py trains across, on one node.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter

import pytest

from tests.helpers import ROOT, EnvFileStack, build_images
from tools.images import local_env_image

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.swarm]  # joins and leaves this engine's swarm

NODE_IMAGE = "grpo-fixture/swarm-node:local"
# Every capability this host's engine may hand out (all but CAP_SYS_RESOURCE), unconfined, cgroups writable.
NESTED_ENGINE = ["--cap-add", "ALL", "--cap-drop", "SYS_RESOURCE", "--security-opt", "seccomp=unconfined",
                 "--security-opt", "apparmor=unconfined", "--security-opt", "systempaths=unconfined",
                 "--device-cgroup-rule", "a *:* rwm", "-v", "/sys/fs/cgroup:/sys/fs/cgroup:rw"]


def cli(*args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {res.returncode}: {res.stderr[-2000:]}")
    return res


def wait_for(what: str, condition, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(1)
    return result


@pytest.fixture(scope="module")
def two_nodes(docker, tmp_path_factory):
    from tools.fleet import local_swarm

    build_images("env-server")
    cli("build", "-q", "-t", NODE_IMAGE, str(ROOT / "tests/fixtures/swarm-node"))
    with local_swarm():
        stack = EnvFileStack(tmp_path_factory.mktemp("two-nodes"), {
            "ENV_NAME": "echo", "ENV_FLEET": "swarm", "ENV_ECHO_REPLICAS": "4", "MAX_CONCURRENT_ENVS": "16",
            "ENV_MEM_LIMIT": "512m"})
        stack.name = f"{stack.project}-fleet"
        stack.env_file.write_text(stack.env_file.read_text() + f"FLEET_STACK={stack.name}\n")
        node = f"{stack.project}-node"
        manager = json.loads(cli("info", "--format", "{{json .Swarm}}").stdout)
        cli("run", "-d", "--name", node, "--hostname", node, *NESTED_ENGINE, "-v", f"{node}:/var/lib/docker",
            NODE_IMAGE, "--no-new-privileges")  # dockerd's flag: every container there gets it
        try:
            wait_for("the nested engine answers", lambda: cli("exec", node, "docker", "info", check=False).returncode == 0)
            token = cli("swarm", "join-token", "-q", "worker").stdout.strip()
            cli("exec", node, "docker", "swarm", "join", "--token", token, f"{manager['NodeAddr']}:2377")
            wait_for("the worker is Ready", lambda: f"{node} Ready" in cli("node", "ls", "--format",
                                                                        "{{.Hostname}} {{.Status}}").stdout)
            save = subprocess.Popen(["docker", "save", local_env_image()], stdout=subprocess.PIPE)
            cli("exec", "-i", node, "docker", "load", stdin=save.stdout)  # no registry: the image goes over by hand
            assert save.wait() == 0
            yield stack, manager["NodeID"], node
        finally:
            stack.stack("fleet", "down")
            cli("node", "update", "--label-rm", "grpo.role", manager["NodeID"], check=False)
            cli("exec", node, "docker", "swarm", "leave", "--force", check=False)
            cli("rm", "-f", node, check=False)
            cli("node", "rm", "--force", node, check=False)
            cli("volume", "rm", node, check=False)


def placement(stack) -> Counter:
    out = cli("service", "ps", f"{stack.name}_env-echo", "--filter", "desired-state=running", "--format",
              "{{.Node}} {{.CurrentState}}").stdout
    return Counter(line.split()[0] for line in out.splitlines() if " Running" in line)


def nnp_here(image: str) -> bool:
    """Whether this engine's daemon sets no-new-privileges (read with our image, as tools.fleet does)."""
    out = cli("run", "--rm", "--network", "none", "--entrypoint", "grep", image, "NoNewPrivs", "/proc/self/status")
    return out.stdout.split() == ["NoNewPrivs:", "1"]


def test_tasks_spread_over_both_nodes_and_keep_off_the_labelled_gpu_host(two_nodes):
    stack, manager_id, node = two_nodes
    manager = cli("node", "inspect", manager_id, "--format", "{{.Description.Hostname}}").stdout.strip()
    if not nnp_here(local_env_image()):  # refused, naming this node only: the nested one's daemon sets it
        refused = stack.stack("fleet", "up")
        [line] = [x for x in (refused.stdout + refused.stderr).splitlines() if "only from each node's" in x]
        assert refused.returncode != 0 and f"the Docker daemon of {manager} does not set it" in line, line
        assert node not in line, line
    up = stack.stack("fleet", "up", env={"FLEET_ALLOW_NEW_PRIVILEGES": "1"})
    assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
    assert f"image(s) only on this machine: {local_env_image()}" in up.stdout  # the warning a user gets
    assert placement(stack) == {manager: 2, node: 2}

    cli("node", "update", "--label-add", "grpo.role=gpu", manager_id)  # docs/fleets.md, step 2
    # Swarm moves tasks off a node that no longer meets their constraints
    wait_for("every task on the worker", lambda: placement(stack) == {node: 4})
    again = stack.stack("fleet", "up")  # no opt-out: the one env node left, the worker, sets no-new-privileges
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert placement(stack) == {node: 4}
    tasks = cli("exec", node, "docker", "ps", "-q", "--filter", f"label=com.docker.swarm.service.name={stack.name}_env-echo")
    for cid in tasks.stdout.split():
        status = cli("exec", node, "docker", "exec", cid, "grep", "NoNewPrivs", "/proc/1/status").stdout
        assert status.split() == ["NoNewPrivs:", "1"], status
