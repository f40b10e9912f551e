"""NCCL settings of the trainer process and the address it listens on for the rendezvous.

How server mode meets NCCL (trl 1.16.0 `VLLMClient.init_communicator`, vLLM 0.31.0
`weight_transfer/nccl_common.py`): the trainer is rank 0 and LISTENS (a TCPStore) on
`VLLM_HOST_IP` at `vllm_group_port`; the vLLM workers connect to it. Inside a container the address
must be the trainer's own address on the network it shares with `vllm`.
"""

from __future__ import annotations

import os
import socket

from trainer.gpu.server import VLLMPreflightError

# Socket transport over the compose bridge network. NCCL tells hosts apart by hostname + boot id, so
# two containers with their own hostnames are two hosts to it and it uses sockets anyway; these make
# that explicit (InfiniBand is not in a bridge network).
NCCL_BRIDGE_DEFAULTS: dict[str, str] = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
    "NCCL_DEBUG": "WARN",
}
# Opt-in fast path (docs/gpu-host.md "Faster NCCL path"): the compose file gives both containers one
# NCCL_HOSTID, `ipc: host` and both GPUs (tools/gpu_layout.py); in-process, P2P/SHM are allowed and
# cuMem is off as vLLM sets it. `make nccl-check` prints the transport NCCL actually picked.
NCCL_FAST_PATH_ENV: dict[str, str] = {
    "NCCL_P2P_DISABLE": "0",
    "NCCL_SHM_DISABLE": "0",
    "NCCL_CUMEM_ENABLE": "0",
}
FAST_PATH_SWITCH = "NCCL_FAST_PATH"  # "1" in the trainer's and vllm's environment turns it on


def nccl_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The NCCL settings this process should run with: the user's values win, bridge-network
    defaults fill the gaps, and NCCL_FAST_PATH=1 swaps in the shared-memory/P2P opt-in."""
    environ = os.environ if environ is None else environ
    wanted = dict(NCCL_BRIDGE_DEFAULTS)
    if environ.get(FAST_PATH_SWITCH, "").strip() in ("1", "true", "yes"):
        wanted.update(NCCL_FAST_PATH_ENV)
        return {k: v for k, v in wanted.items() if not environ.get(k) or k in NCCL_FAST_PATH_ENV}
    return {k: v for k, v in wanted.items() if not environ.get(k)}


def apply_nccl_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Write nccl_env()'s values into the environment (before NCCL initialises); returns them."""
    environ = os.environ if environ is None else environ
    changes = nccl_env(environ)
    environ.update(changes)
    return changes


def _is_usable_ip(ip: str | None) -> bool:
    return bool(ip) and not ip.startswith("127.") and ip not in ("0.0.0.0", "::", "::1")


def resolve_host_ip(peer_host: str | None = None, hostname: str | None = None) -> str:
    """This container's address as the vLLM side sees it.

    1. The source address the kernel picks to reach `peer_host` (the vllm service): right even
       when the trainer sits on several networks. 2. The container's hostname, resolved (Docker
       writes it into /etc/hosts). Loopback answers are rejected: the workers could not connect.
    """
    if peer_host:
        try:
            peer_ip = socket.getaddrinfo(peer_host, None, socket.AF_INET)[0][4][0]
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((peer_ip, 9))  # UDP connect sends nothing; it only picks the route
                ip = s.getsockname()[0]
            if _is_usable_ip(ip):
                return ip
        except OSError:
            pass
    name = hostname or socket.gethostname()
    try:
        for info in socket.getaddrinfo(name, None, socket.AF_INET):
            ip = info[4][0]
            if _is_usable_ip(ip):
                return ip
    except OSError:
        pass
    raise VLLMPreflightError(
        f"cannot find this container's own network address (hostname {name!r} resolves to nothing "
        f"usable{', and no route to ' + peer_host if peer_host else ''}); the vLLM workers must connect "
        "to it for the NCCL rendezvous. Fix: run the trainer on the same compose network as vllm, or "
        "set VLLM_HOST_IP to the trainer's address on that network"
    )


def interface_of(ip: str) -> str | None:
    """The network interface that holds IPv4 address `ip` (Linux SIOCGIFADDR), or None."""
    import fcntl
    import struct

    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on this one
                continue
        if socket.inet_ntoa(packed[20:24]) == ip:
            return name
    return None


def prepare_rendezvous(vllm_url: str, environ: dict[str, str] | None = None) -> str:
    """Where this trainer listens for the NCCL rendezvous, set once for TRL and NCCL to read; returns the address.

    VLLM_HOST_IP: the user's, else the address vLLM reaches this container at (Compose passes the variable
    empty when .env leaves it out, and an empty value counts as unset). NCCL_SOCKET_IFNAME: the user's, else
    the interface carrying that address; a fixed eth0 can be another network's (ENV_FLEET=swarm puts the
    trainer on the fleet's overlay as well). Then the other NCCL defaults (nccl_env)."""
    from urllib.parse import urlparse

    environ = os.environ if environ is None else environ
    host_ip = environ.get("VLLM_HOST_IP") or resolve_host_ip(urlparse(vllm_url).hostname)
    environ["VLLM_HOST_IP"] = host_ip
    if not environ.get("NCCL_SOCKET_IFNAME"):
        ifname = interface_of(host_ip)
        if ifname:
            environ["NCCL_SOCKET_IFNAME"] = ifname
    apply_nccl_env(environ)
    return host_ip


def check_group_port(host_ip: str, port: int) -> str | None:
    """None when rank 0 can listen on (host_ip, port), else the problem with its fix."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host_ip, port))
        except OSError as exc:
            return (f"cannot listen on {host_ip}:{port} for the NCCL rendezvous ({exc.strerror}); "
                    "VLLM_HOST_IP must be an address of this container, and VLLM_GROUP_PORT a free port "
                    "(another run still going? change VLLM_GROUP_PORT in .env)")
    return None


def pin_async_rendezvous_port(port: int, environ: dict[str, str] | None = None) -> int:
    """ROLLOUTS=async: make TRL's async weight transfer listen at VLLM_GROUP_PORT as the sync client does.

    TRL 1.16's async `WeightTransferClient.init_weight_transfer` (trl/experimental/async_grpo/weight_transfer.py)
    advertises `vllm.utils.network_utils.get_ip()` and `get_open_port()`, not TRL's `vllm_group_port`: get_ip() is
    VLLM_HOST_IP (prepare_rendezvous sets it: the address vLLM reaches this container at), get_open_port() is a random
    free port unless VLLM_PORT is set, then the first free one from VLLM_PORT up (vLLM 0.31.0 network_utils). So the
    rendezvous rules hold in both modes once VLLM_PORT is VLLM_GROUP_PORT: same address, same port (or the next free
    one; rank 0's TCPStore listens on every interface of the private network either way). A VLLM_PORT the user set
    wins. Returns the port the transfer will start from."""
    environ = os.environ if environ is None else environ
    if not environ.get("VLLM_PORT"):
        environ["VLLM_PORT"] = str(port)
    return int(environ["VLLM_PORT"])
