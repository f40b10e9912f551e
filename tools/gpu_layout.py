"""Which GPUs the `vllm` and `trainer` containers get, and what NCCL needs to see in them (stdlib only).

VLLM_GPU and TRAINER_GPU each name one GPU or several (`0,1`, `2-7`): vLLM splits its GPUs by tensor
or data parallelism (VLLM_PARALLEL), the trainer runs one process per GPU (trainer/launch.py).

Used by `tools/compose_file.py` (the generated compose file) and `tools/nccl_check.py` (its two containers),
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

from typing import TYPE_CHECKING

from contract.train_mode import MODE_SPECS  # stdlib only: the GPU defaults of each mode

if TYPE_CHECKING:  # the variant is handed in: this module stays standard library only
    from contract.config import TrainModeVariant

FAST_PATH_HOSTID = "grpo-stack-gpu-host"
CDI_PREFIX = "nvidia.com/gpu="
PARALLEL = ("tensor", "data")


class LayoutError(ValueError):
    """A GPU list in .env that cannot be used; the message names the variable and the fix."""


def parse_gpu_ids(value: str | None, var: str) -> list[str]:
    """`1`, `0,1`, `2-7`, `0,2-3` (or GPU UUIDs) -> host GPU ids, each once, in the order given."""
    ids: list[str] = []
    for part in [p.strip() for p in (value or "").split(",") if p.strip()]:
        lo, dash, hi = part.partition("-")
        if dash and lo.isdigit() and hi.isdigit():
            if int(hi) < int(lo):
                raise LayoutError(f"{var}={value}: range {part} runs backwards; write e.g. {hi}-{lo} (edit .env)")
            ids += [str(i) for i in range(int(lo), int(hi) + 1)]
        elif part.isdigit() or part.startswith(("GPU-", "MIG-")):
            ids.append(part)
        else:
            raise LayoutError(f"{var}={value}: {part!r} is not a GPU id; write ids or ranges like 0,1 or 2-7 (edit .env)")
    if not ids:
        raise LayoutError(f"{var} is empty; name a GPU id like 0, a list like 0,1 or a range like 2-7 (edit .env)")
    if len(set(ids)) != len(ids):
        raise LayoutError(f"{var}={value} names a GPU twice (edit .env)")
    return ids


def vllm_parallel_sizes(gpus: int, parallel: str) -> tuple[int, int]:
    """(tensor_parallel_size, data_parallel_size) for vLLM on `gpus` GPUs."""
    if parallel not in PARALLEL:
        raise LayoutError(f"VLLM_PARALLEL={parallel!r}: choose tensor (one model split over the GPUs) or data "
                          "(one model copy per GPU) (edit .env)")
    return (gpus, 1) if parallel == "tensor" else (1, gpus)


def propose_split(count: int) -> tuple[str, str] | None:
    """For a host with more than two GPUs: (VLLM_GPU, TRAINER_GPU) using all of them, half each (vLLM tensor
    parallel: the trainer refuses data parallel, trainer.gpu.server.restart_blind), or None when the two-GPU default
    already uses them all."""
    if count <= 2:
        return None
    half = count // 2
    as_range = lambda lo, hi: str(lo) if lo == hi else f"{lo}-{hi}"  # noqa: E731
    return as_range(0, half - 1), as_range(half, count - 1)


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class Placement:
    """One container's GPUs (host ids, Docker's numbering) and the settings that go with them."""
    devices: list[str]
    env: dict[str, str] = field(default_factory=dict)
    ipc: str | None = None  # None: Docker's default (private)


def _pci_order(ids: list[str], pci_index: dict[str, int] | None = None) -> list[str]:
    """Host ids in the order CUDA numbers them inside the container with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    nvidia-smi's indices are PCI bus order, so a UUID takes its GPU's index (`pci_index`, from the detected
    GPUs); a UUID not among them keeps its place after the known ones (alphabetical order means nothing)."""
    known = pci_index or {}

    def key(gpu: str) -> tuple[int, int]:
        if gpu.isdigit():
            return (0, int(gpu))
        return (0, known[gpu]) if gpu in known else (1, 0)

    return sorted(ids, key=key)  # stable: unknown UUIDs stay in the order given


def placements(vllm_gpus: list[str], trainer_gpus: list[str], fast_path: bool,
               pci_index: dict[str, int] | None = None) -> dict[str, Placement]:
    """{"vllm": ..., "trainer": ...} for TRAIN_MODE=gpu. A side with several GPUs may use NCCL's P2P/SHM
    among its own GPUs (one container is one host to NCCL); the fast path also makes both sides one host."""
    if not fast_path or set(vllm_gpus) & set(trainer_gpus):
        out = {}
        for role, own in (("vllm", vllm_gpus), ("trainer", trainer_gpus)):
            env = {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"} if len(own) > 1 else {}
            out[role] = Placement(list(own), env)
        return out
    both = _pci_order([*vllm_gpus, *trainer_gpus], pci_index)
    out = {}
    for role, own in (("vllm", vllm_gpus), ("trainer", trainer_gpus)):
        local = [str(both.index(g)) for g in own] + [str(both.index(g)) for g in both if g not in own]
        out[role] = Placement(both, {
            "NCCL_HOSTID": FAST_PATH_HOSTID,
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": ",".join(local),  # own GPUs first: each side uses cuda:0.. of its own
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


@dataclass
class GpuLayout:
    """The GPU layout of one run, resolved once from .env (tools/compose_file.py passes it to Compose)."""
    mode: "TrainModeVariant"
    vllm: list[str]
    trainer: list[str]
    tensor_parallel: int = 1
    data_parallel: int = 1
    fast_path: bool = False
    pci_index: dict[str, int] = field(default_factory=dict)  # GPU UUID -> nvidia-smi index (PCI bus order)

    @property
    def vllm_world_size(self) -> int:
        """vLLM workers that join the weight-sync group (TRL's world = these + the trainer's rank 0)."""
        return self.tensor_parallel * self.data_parallel

    def placements(self) -> dict[str, Placement]:
        if self.mode.server:
            return placements(self.vllm, self.trainer, self.fast_path, self.pci_index)
        env = {"NCCL_P2P_DISABLE": "0", "NCCL_SHM_DISABLE": "0"} if len(self.trainer) > 1 else {}
        return {"trainer": Placement(list(self.trainer), env)}

    def compose_env(self) -> dict[str, str]:
        """Variables compose.yaml interpolates: vLLM's parallel sizes, its world size, trainer processes."""
        return {"VLLM_TENSOR_PARALLEL_SIZE": str(self.tensor_parallel),
                "VLLM_DATA_PARALLEL_SIZE": str(self.data_parallel),
                "VLLM_WORLD_SIZE": str(self.vllm_world_size),
                "TRAINER_PROCESSES": str(len(self.trainer))}

    def describe(self) -> str:
        if self.mode.colocated:
            return f"trainer on GPU {','.join(self.trainer)} ({len(self.trainer)} process(es), vLLM inside each)"
        how = (f"tensor parallel {self.tensor_parallel}" if self.tensor_parallel > 1 else
               f"data parallel {self.data_parallel}" if self.data_parallel > 1 else "one GPU")
        return (f"vLLM on GPU {','.join(self.vllm)} ({how}), trainer on GPU {','.join(self.trainer)} "
                f"({len(self.trainer)} process(es))")


def colocate_trainer_gpu(trainer_gpu: str | None, gpu_count: int) -> tuple[str, str | None]:
    """TRAINER_GPU for colocate, and a note when it was changed: .env.example's TRAINER_GPU=1 is for the two-GPU
    split, and on a one-GPU host it means that GPU, device 0 (`make train` and `make doctor` agree on it)."""
    value = trainer_gpu or MODE_SPECS["colocate"].trainer_gpu_default
    if gpu_count == 1 and value != "0":
        return "0", f"colocate: TRAINER_GPU={value} does not exist here; using GPU 0"
    return value, None


def plan(dotenv: dict[str, str], mode: "TrainModeVariant", pci_index: dict[str, int] | None = None) -> GpuLayout:
    """VLLM_GPU, TRAINER_GPU, VLLM_PARALLEL and NCCL_FAST_PATH from .env, checked, for a GPU mode.
    `pci_index`: the detected GPUs' UUID -> index, to order GPUs named by UUID."""
    trainer = parse_gpu_ids(dotenv.get("TRAINER_GPU") or mode.spec.trainer_gpu_default, "TRAINER_GPU")
    if mode.colocated:
        return GpuLayout(mode, [], trainer)
    vllm = parse_gpu_ids(dotenv.get("VLLM_GPU") or mode.spec.vllm_gpu_default, "VLLM_GPU")
    shared = sorted(set(vllm) & set(trainer))
    if shared:
        raise LayoutError(f"VLLM_GPU={dotenv.get('VLLM_GPU')} and TRAINER_GPU={dotenv.get('TRAINER_GPU')} share GPU "
                          f"{','.join(shared)}: give each side its own GPUs, or use TRAIN_MODE=colocate (edit .env)")
    tp, dp = vllm_parallel_sizes(len(vllm), (dotenv.get("VLLM_PARALLEL") or "tensor").strip().lower())
    return GpuLayout(mode, vllm, trainer, tp, dp, truthy(dotenv.get("NCCL_FAST_PATH")), dict(pci_index or {}))
