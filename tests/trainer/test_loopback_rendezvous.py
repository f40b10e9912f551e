"""Several trainer processes: what they listen on stays on loopback (issue #30 item 1, SECURITY.md).

Real: trainer.launch's own command (accelerate launch with the `loopback` torchrun backend, 2 gloo processes) on
this machine, and `ss` listing what the agent and both ranks listen on. The container version, probed from an env
server's container, is tests/reliability/test_env_network_isolation.py."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from contract.config import ColocateMode, CpuMode, GpuMode
from tests.helpers import ROOT, free_port


def listeners(pid: int, port: int | None = None) -> list[str]:
    """The addresses `pid` listens on (on `port` only, when given: other tests of the same pytest process may hold
    listeners of their own, on other ports)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = [line.split()[3] for line in out.splitlines() if f"pid={pid}," in line]
    return [a for a in found if port is None or a.rsplit(":", 1)[-1] == str(port)]


def test_fact__torch_tcpstore_given_loopback_still_listens_on_every_interface():
    """Why the launcher hands the store a socket: TCPStore(host_name="127.0.0.1") binds `*` (torch 2.13)."""
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, True, timedelta(seconds=10))
    assert listeners(os.getpid(), port) == [f"*:{port}"]
    del store


def test_the_loopback_backend_store_listens_on_127_0_0_1_only():
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from trainer.run.loopback_launch import BACKEND, create_handler

    port = free_port()
    params = RendezvousParameters(BACKEND, "", "run", 1, 1, port=str(port), timeout="10")
    handler = create_handler(params)
    info = handler.next_rendezvous()
    assert handler.get_backend() == BACKEND and (info.rank, info.world_size) == (0, 1)
    assert (info.bootstrap_store_info.master_addr, info.bootstrap_store_info.master_port) == ("127.0.0.1", port)
    info.store.set("k", "v")
    assert info.store.get("k") == b"v"
    assert listeners(os.getpid(), port) == [f"127.0.0.1:{port}"]


def test_two_processes_from_trainer_launch_listen_on_loopback_only(tmp_path):
    """And each CPU rank restores a checkpoint's optimizer state on its device (a resume with several processes)."""
    from trainer.launch import launch_argv, pin_interfaces, place_cpu_ranks

    port = free_port()
    argv = launch_argv(2, CpuMode(), "ddp", [], port=port)
    at = argv.index("trainer.train") - 1  # "-m trainer.train" -> the script that reports the listeners
    argv[at:at + 2] = [str(ROOT / "tests" / "trainer" / "rank_listeners.py")]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    pin_interfaces(CpuMode(), "http://vllm:8000", env)  # what trainer.launch does before it execs the launcher
    place_cpu_ranks(env)
    env["PYTHONPATH"] = str(ROOT)
    res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    seen = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("LISTEN ")]
    assert f"127.0.0.1:{port}" in seen, res.stdout  # the store, found
    assert len(seen) >= 3 and all(addr.startswith("127.0.0.1:") for addr in seen), seen  # + gloo's, per rank
    assert "GLOO_SOCKET_IFNAME lo" in res.stdout
    assert res.stdout.count("RESTORED on cpu\n") == 2, res.stdout  # "cpu:0" (accelerate's own pick) cannot restore


def test_two_processes_exit_with_the_code_rank_0_chose_not_the_launchers_1(tmp_path):
    """#33: with several trainer processes the host still sees the trainer's own exit code (77: vLLM went away, which
    `make train` acts on by restarting vLLM and resuming), not the 1 of torchrun's ChildFailedError."""
    from trainer.launch import launch_argv, pin_interfaces

    argv = launch_argv(2, CpuMode(), "ddp", [], port=free_port())
    at = argv.index("trainer.train") - 1
    argv[at:at + 2] = [str(ROOT / "tests" / "trainer" / "rank_exits.py")]
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    pin_interfaces(CpuMode(), "http://vllm:8000", env)
    env.update(PYTHONPATH=str(ROOT), RANK0_EXIT="77", TORCH_ELASTIC_SHUTDOWN_TIMEOUT="10")
    res = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 77, res.stdout[-3000:] + res.stderr[-3000:]
    assert "[launch] trainer processes failed (rank 0 exited 77" in res.stderr, res.stderr[-3000:]


def test_the_launchers_exit_code_is_the_lowest_failed_ranks_own_one():
    from trainer.run.loopback_launch import exit_code_of

    assert exit_code_of({0: 77, 1: 1}) == 77      # rank 1 crashed on rank 0's closed socket
    assert exit_code_of({0: 1, 1: 77}) == 77      # rank 0 crashed because rank 1 left with a reason
    assert exit_code_of({0: 6, 1: 77}) == 6       # two reasons: the lowest rank's
    assert exit_code_of({0: -15, 1: 1}) == 1      # a signal and a crash: a failure, no reason to act on
    assert exit_code_of({1: -9}) == 1


def test_pin_interfaces_sets_gloo_on_loopback_and_nccl_on_every_rank():
    from trainer.launch import pin_interfaces

    cpu = {"GLOO_SOCKET_IFNAME": "eth1"}
    assert pin_interfaces(CpuMode(), "http://vllm:8000", cpu) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert "NCCL_SOCKET_IFNAME" not in cpu
    colocate: dict[str, str] = {}
    pin_interfaces(ColocateMode(), "http://vllm:8000", colocate)
    assert colocate["NCCL_SOCKET_IFNAME"] == "lo"  # no peer outside the container
    # server mode: the interface holding the address vLLM reaches (here: loopback's, by the address given)
    gpu = {"VLLM_HOST_IP": "127.0.0.1"}
    pin_interfaces(GpuMode(), "http://vllm:8000", gpu)
    assert gpu["NCCL_SOCKET_IFNAME"] == "lo" and gpu["NCCL_IB_DISABLE"] == "1"
    mine = {"NCCL_SOCKET_IFNAME": "ens5"}
    pin_interfaces(ColocateMode(), "http://vllm:8000", mine)
    assert mine["NCCL_SOCKET_IFNAME"] == "ens5"  # the user's value wins
