"""Which GPUs the `vllm` and `trainer` containers get, and what NCCL needs to see in them (stdlib only).

Used by `tools/stack.py` (the generated compose file) and `tools/nccl_check.py` (its two containers),
so the check runs exactly the layout training will.

NCCL tells hosts apart by hostname and boot id (`getHostHash`; NCCL_HOSTID replaces both). Two
containers with their own hostnames are two "hosts" to it, so it uses sockets whatever
NCCL_P2P_DISABLE / NCCL_SHM_DISABLE say. NCCL_FAST_PATH=1 makes both containers one host to NCCL:
the same NCCL_HOSTID, the host's IPC namespace (shared /dev/shm for SHM, CUDA IPC handles for P2P),
both GPUs visible in both (P2P needs to see the peer GPU; CUDA_VISIBLE_DEVICES puts each side's own
GPU first), and NCCL's cuMem allocator off on both sides as vLLM sets it (its handles do not cross
containers). Read from NCCL's and vLLM's sources; `make nccl-check` prints the transport chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FAST_PATH_HOSTID = "grpo-stack-gpu-host"
CDI_PREFIX = "nvidia.com/gpu="


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Placement:
    """One container's GPUs (host ids, Docker's numbering) and the settings that go with them."""
    devices: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ipc: str | None = None  # None: Docker's default (private)


def _pci_order(ids: list[str]) -> list[str]:
    """Host ids in the order CUDA numbers them inside the container with CUDA_DEVICE_ORDER=PCI_BUS_ID
    (nvidia-smi's indices are PCI bus order too)."""
    return sorted(ids, key=lambda i: (0, int(i)) if i.isdigit() else (1, i))


def placements(vllm_gpu: str, trainer_gpu: str, fast_path: bool) -> dict[str, Placement]:
    """{"vllm": ..., "trainer": ...} for TRAIN_MODE=gpu."""
    if not fast_path or vllm_gpu == trainer_gpu:
        return {"vllm": Placement([vllm_gpu]), "trainer": Placement([trainer_gpu])}
    both = _pci_order([vllm_gpu, trainer_gpu])
    out = {}
    for role, own in (("vllm", vllm_gpu), ("trainer", trainer_gpu)):
        local = [str(both.index(own)), str(both.index(next(g for g in both if g != own)))]
        out[role] = Placement(both, {
            "NCCL_HOSTID": FAST_PATH_HOSTID,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(local),  # own GPU first: both sides use cuda:0
            "NCCL_P2P_DISABLE": "0",
            "NCCL_SHM_DISABLE": "0",
            "NCCL_CUMEM_ENABLE": "0",
        }, ipc="host")
    return out


def compose_device(devices: list[str], cdi: bool) -> dict:
    """A compose `deploy.resources.reservations.devices` entry for these host GPUs."""
    if cdi:
        return {"driver": "cdi", "device_ids": [CDI_PREFIX + d for d in devices], "capabilities": ["gpu"]}
    return {"driver": "nvidia", "device_ids": list(devices), "capabilities": ["gpu"]}


def docker_run_gpu_flags(devices: list[str], cdi: bool) -> list[str]:
    """The same GPUs as `docker run` flags."""
    if cdi:
        return [flag for d in devices for flag in ("--device", CDI_PREFIX + d)]
    return ["--gpus", f'"device={",".join(devices)}"']
