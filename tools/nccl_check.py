"""`make nccl-check`: prove the NCCL weight-sync path on a GPU host before a long run.

Starts the trainer image on TRAINER_GPU and the vLLM image on VLLM_GPU, on the stack's compose
network with the stack's NCCL settings, and runs one short broadcast between them the way TRL's
weight sync does (trl 1.16.0 -> vLLM 0.31.0 `nccl_common.stateless_init_process_group`): the
trainer is rank 0 and LISTENS on its own address at VLLM_GROUP_PORT, the vLLM side connects as
rank 1, then rank 0 broadcasts bf16 buffers. Prints the transport NCCL chose, the bandwidth, and,
on failure or timeout, a diagnosis naming the fix. Standard library only (host venv).

    python tools/nccl_check.py [--mib 256] [--iters 5] [--timeout 180]
    python tools/nccl_check.py --full     # what training does, against the running vllm service

The two containers get the GPUs, IPC and NCCL settings training gives vllm and trainer
(tools/gpu_layout.py: one GPU each, or NCCL_FAST_PATH=1's shared layout), so the transport printed
is the one training will use. `--full` runs trainer.sync_check in the trainer service: TRL's own
rendezvous, a push of the model's weights, a generation.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tools import gpu_layout
from tools.gpu_doctor import DEFAULT_VLLM_IMAGE, NO_GPU, probe
from tools.images import TRAINER_GPU_BUILD, image_of
from tools.settings import load, load_env

ROOT = Path(__file__).resolve().parent.parent

NCCL_KEYS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_FAST_PATH",
             "NCCL_HOSTID")
NCCL_DEFAULTS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1",
                 "NCCL_SOCKET_IFNAME": "eth0"}

# Runs inside both containers (python3 -c SCRIPT ROLE MASTER PORT MIB ITERS WORLD). One JSON line per event.
# The trainer side is rank 0 on its first GPU; the vLLM side runs one rank per vLLM GPU (1..WORLD-1), as
# its workers do in the weight sync (TRL: world = vLLM workers + the trainer).
SCRIPT = r"""
import json, os, socket, sys, time
role, master, port, mib, iters, world = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
def say(**kw):
    print("NCCLCHECK " + json.dumps(kw), flush=True)
def member(rank, device, master):
    import torch, vllm
    from vllm.distributed.weight_transfer.nccl_common import stateless_init_process_group
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    say(event="start", role=role, rank=rank, master=master, port=port, torch=torch.__version__, vllm=vllm.__version__,
        nccl=nccl, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(device) if torch.cuda.is_available() else None)
    torch.cuda.set_device(device)
    t0 = time.time()
    comm = stateless_init_process_group(master, port, rank, world, torch.device("cuda", device))
    say(event="group", role=role, rank=rank, init_s=round(time.time() - t0, 2), disabled=bool(comm.disabled))
    n = mib * 1024 * 1024 // 2
    buf = (torch.ones if rank == 0 else torch.zeros)(n, dtype=torch.bfloat16, device="cuda")
    comm.broadcast(buf[:1024], src=0)
    torch.cuda.synchronize()
    t1 = time.time()
    for _ in range(iters):
        comm.broadcast(buf, src=0)
    torch.cuda.synchronize()
    dt = time.time() - t1
    say(event="done", role=role, rank=rank, seconds=round(dt, 4), bytes=n * 2 * iters,
        gbps=round(n * 2 * iters / dt / 1e9, 3), ok=bool(buf[-1].item() == 1.0))
if role == "trainer":
    member(0, 0, os.environ.get("VLLM_HOST_IP") or socket.gethostbyname(socket.gethostname()))
else:
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=member, args=(1 + i, i, master)) for i in range(world - 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    sys.exit(max(p.exitcode or 0 for p in procs))
"""


# ------------------------------------------------------------------ pure logic (unit-tested)
def nccl_env(dotenv: dict[str, str], placement: gpu_layout.Placement | None = None) -> dict[str, str]:
    """The stack's NCCL settings (.env), bridge-network defaults for the gaps, the container's layout on
    top (NCCL_FAST_PATH=1: one host id, P2P/SHM on); INFO so NCCL logs its transport choice."""
    out = {k: dotenv[k] for k in NCCL_KEYS if dotenv.get(k)}
    for k, v in NCCL_DEFAULTS.items():
        out.setdefault(k, v)
    out.update(placement.env if placement else {})
    out["NCCL_DEBUG"] = "INFO"
    return out


def docker_run_argv(role: str, image: str, placement: gpu_layout.Placement, network: str, name: str,
                    dotenv: dict[str, str], master: str, port: int, mib: int, iters: int, shm: str = "2g",
                    cdi: bool = False, world: int = 2) -> list[str]:
    """`docker run` for one side, with training's GPUs and IPC for it. Both images' entrypoints are
    replaced by python3 -c SCRIPT."""
    argv = ["docker", "run", "-d", "--name", name, "--label", "grpo-nccl-check=1", "--network", network,
            *gpu_layout.docker_run_gpu_flags(placement.devices, cdi), "--shm-size", shm, "--entrypoint", "python3"]
    if placement.ipc:
        argv += ["--ipc", placement.ipc]
    for k, v in sorted(dotenv.items()):
        argv += ["-e", f"{k}={v}"]
    return [*argv, "--", image, "-c", SCRIPT, role, master, str(port), str(mib), str(iters), str(world)]


def parse_events(log: str) -> list[dict]:
    events = []
    for line in log.splitlines():
        if "NCCLCHECK " in line:
            try:
                events.append(json.loads(line.split("NCCLCHECK ", 1)[1]))
            except json.JSONDecodeError:
                pass
    return events


def parse_transport(log: str) -> str | None:
    """What NCCL_DEBUG=INFO says the channel goes through, e.g. 'NET/Socket', 'P2P/IPC', 'SHM'."""
    found = re.findall(r"\bvia (NET/[A-Za-z]+|P2P/[A-Za-z/]+|SHM(?:/[A-Za-z]+)*|P2P)", log)
    if not found:
        return None
    top = max(set(found), key=found.count)
    return top.split("/direct")[0]


TRANSPORT_NOTES = {
    "NET/Socket": "TCP sockets over the bridge network (the safe default; expect ~1-3 GB/s)",
    "NET/IB": "InfiniBand/RoCE",
    "P2P": "CUDA peer-to-peer between the two GPUs (fast path: NVLink/PCIe)",
    "SHM": "shared host memory (fast path: `ipc: host`)",
}

# (pattern in either side's log, diagnosis with fix); first match wins.
FAILURES: list[tuple[str, str]] = [
    (r"could not select device driver|unknown or invalid runtime name: nvidia",
     "Docker cannot hand out GPUs: install nvidia-container-toolkit and restart Docker (`make doctor`)"),
    (r"invalid device ordinal|no CUDA-capable device|device=\S+ .*not found|unknown device",
     "a GPU id does not exist: check VLLM_GPU / TRAINER_GPU in .env against `nvidia-smi -L`"),
    (r"CUDA driver version is insufficient|forward compatibility was attempted",
     "the NVIDIA driver is older than the images' CUDA: upgrade the driver or choose an older VLLM_IMAGE"),
    (r"NCCL_SOCKET_IFNAME|no socket interface found|Bootstrap : no socket interface",
     "NCCL found no usable network interface: NCCL_SOCKET_IFNAME must name an interface inside BOTH containers "
     "(eth0 on a single compose network; check `docker compose exec trainer ip -o addr`)"),
    (r"Address already in use|EADDRINUSE",
     "VLLM_GROUP_PORT is taken in the trainer container: pick another port in .env"),
    (r"Connection refused|ECONNREFUSED|Connection timed out|timed out|TCPStore|No route to host",
     "the vLLM side could not reach the trainer's rendezvous (address:port): both containers must share the "
     "compose network, VLLM_HOST_IP must be the trainer's address there (never 127.0.0.1), and no firewall "
     "may block VLLM_GROUP_PORT between containers"),
    (r"No space left on device|Cannot allocate memory|shm",
     "shared memory too small: raise VLLM_SHM_SIZE / TRAINER_SHM_SIZE in .env (or use `ipc: host`)"),
    (r"CUDA out of memory|OutOfMemoryError",
     "a GPU is full: free it (`nvidia-smi`) or lower --mib"),
    (r"unhandled system error|remote process exited|NCCL error",
     "NCCL failed between the containers: rerun with the INFO log above; with NCCL_FAST_PATH=1 go back to the "
     "socket defaults (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1)"),
]


@dataclass
class Outcome:
    ok: bool
    transport: str | None = None
    gbps: float | None = None
    init_s: float | None = None
    diagnosis: list[str] = field(default_factory=list)


def diagnose(trainer_log: str, vllm_log: str, timed_out: bool, timeout_s: float = 0, world: int = 2) -> Outcome:
    events = {(e.get("role"), e.get("event")): e for e in parse_events(trainer_log) + parse_events(vllm_log)}
    vllm_done = [e for e in parse_events(vllm_log) if e.get("event") == "done"]  # one per vLLM rank
    both = trainer_log + "\n" + vllm_log
    out = Outcome(ok=False, transport=parse_transport(both))
    starts = [events.get((r, "start")) for r in ("trainer", "vllm")]
    if all(starts):
        a, b = starts
        for key in ("vllm", "torch", "nccl"):
            if a.get(key) != b.get(key):
                out.diagnosis.append(f"version skew: trainer {key} {a.get(key)} vs vllm image {key} {b.get(key)}; "
                                     "build the trainer image FROM the same VLLM_IMAGE (`make build`)")
    done = [events.get((r, "done")) for r in ("trainer", "vllm")]
    group = [events.get((r, "group")) for r in ("trainer", "vllm")]
    if any(g and g.get("disabled") for g in group):
        out.diagnosis.append("vLLM's NCCL wrapper is disabled (libnccl not found in the image): the weight sync "
                             "would silently send nothing; rebuild the images from VLLM_IMAGE")
    if all(done) and len(vllm_done) >= world - 1:
        out.gbps = done[0].get("gbps")
        out.init_s = (group[0] or {}).get("init_s")
        missed = [str(e.get("rank", "?")) for e in vllm_done if not e.get("ok")]
        if missed:
            out.diagnosis.append(f"the broadcast finished but vLLM rank(s) {', '.join(missed)} did not receive the data")
        out.ok = not out.diagnosis
        return out
    for pattern, text in FAILURES:
        if re.search(pattern, both, flags=re.I):
            out.diagnosis.append(text)
            break
    if timed_out:
        stage = "rendezvous" if not any(group) else "broadcast"
        out.diagnosis.append(
            f"no result after {timeout_s:.0f}s, stuck in the {stage}: this is the silent hang users hit in training. "
            + ("The vLLM side never joined: check that it can reach the trainer's address:port (same network, "
               "VLLM_HOST_IP, firewall) and NCCL_SOCKET_IFNAME." if stage == "rendezvous" else
               "The group formed but data does not flow: NCCL_SOCKET_IFNAME, or the fast path settings.")
        )
    if not out.diagnosis:
        out.diagnosis.append("a side exited without a result; read its log above")
    return out


# ------------------------------------------------------------------ running it
def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def container_ip(name: str, network: str) -> str:
    fmt = "{{json .NetworkSettings.Networks}}"
    nets = json.loads(run(["docker", "inspect", "-f", fmt, name]).stdout or "{}")
    return (nets.get(network) or {}).get("IPAddress") or ""


def logs(name: str) -> str:
    r = run(["docker", "logs", name])
    return r.stdout + r.stderr


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make nccl-check", description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="buffer size per broadcast (MiB)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before declaring a hang")
    args = p.parse_args(argv)  # --full (TRL's rendezvous + weight push in the trainer service): `python -m tools
    # nccl-check --full`, which runs the sync-check command instead of this one
    found = probe()
    if found is None:
        print(f"nccl-check: {NO_GPU}. This check needs a host with 2 NVIDIA GPUs and the NVIDIA container "
              "runtime; nothing to do on this machine (the CPU profile needs no NCCL).")
        return 0
    dotenv = load_env()
    vllm_image = dotenv.get("VLLM_IMAGE") or DEFAULT_VLLM_IMAGE
    port = int(dotenv.get("VLLM_GROUP_PORT") or 51216)
    try:
        plan = gpu_layout.plan(dotenv, "gpu")
    except gpu_layout.LayoutError as exc:
        print(f"nccl-check: {exc}")
        return 2
    world = 1 + plan.vllm_world_size  # the weight sync's group: the trainer's rank 0 + every vLLM worker
    trainer_image = image_of(TRAINER_GPU_BUILD)
    for image in (vllm_image, trainer_image):
        if run(["docker", "image", "inspect", "--", image]).returncode != 0:
            print(f"nccl-check: image {image} is missing: run `make build` (and pull {vllm_image}) first")
            return 2
    network, temp_net = f"{load().project}_agentnet", False  # the stack's vLLM network, when it is up
    if run(["docker", "network", "inspect", network]).returncode != 0:
        network, temp_net = f"grpo-nccl-check-{uuid.uuid4().hex[:6]}", True
        run(["docker", "network", "create", network], check=True)
    layout = plan.placements()
    tenv, venv = nccl_env(dotenv, layout["trainer"]), nccl_env(dotenv, layout["vllm"])
    tag = uuid.uuid4().hex[:6]
    trainer, vllm = f"grpo-nccl-trainer-{tag}", f"grpo-nccl-vllm-{tag}"
    print(f"nccl-check: trainer image on GPU {plan.trainer[0]} (rank 0, listens :{port}), {vllm_image} on GPU "
          f"{','.join(plan.vllm)} (ranks 1-{world - 1}, connect); world {world}; network {network}; "
          f"{args.iters} x {args.mib} MiB bf16")
    print("  NCCL: " + " ".join(f"{k}={v}" for k, v in sorted(tenv.items())))
    timed_out = False
    try:
        r = run(docker_run_argv("trainer", trainer_image, layout["trainer"], network, trainer, tenv, "-", port,
                                args.mib, args.iters, cdi=found.cdi, world=world))
        if r.returncode != 0:
            print(diagnose(r.stderr, "", False).diagnosis[0] + f"\n  docker said: {r.stderr.strip()[:400]}")
            return 1
        ip = ""
        for _ in range(30):
            ip = container_ip(trainer, network)
            if ip:
                break
            time.sleep(1)
        r = run(docker_run_argv("vllm", vllm_image, layout["vllm"], network, vllm, venv, ip, port, args.mib,
                                args.iters, cdi=found.cdi, world=world))
        if r.returncode != 0:
            print(diagnose(r.stderr, "", False).diagnosis[0] + f"\n  docker said: {r.stderr.strip()[:400]}")
            return 1
        start = time.monotonic()
        while True:
            states = [run(["docker", "inspect", "-f", "{{.State.Running}}", n]).stdout.strip() for n in (trainer, vllm)]
            if all(s != "true" for s in states):
                break
            if time.monotonic() - start > args.timeout:
                timed_out = True
                break
            time.sleep(1)
        tlog, vlog = logs(trainer), logs(vllm)
    finally:
        run(["docker", "rm", "-f", trainer, vllm])
        if temp_net:
            run(["docker", "network", "rm", network])
    out = diagnose(tlog, vlog, timed_out, args.timeout, world=world)
    transport = out.transport or "unknown (no NCCL INFO line seen)"
    note = TRANSPORT_NOTES.get((out.transport or "").split("/")[0] if out.transport and
                               out.transport.startswith(("P2P", "SHM")) else out.transport or "", "")
    print(f"  transport: {transport}{' - ' + note if note else ''}")
    if out.ok:
        print(f"  rendezvous: {out.init_s}s   bandwidth: {out.gbps} GB/s  -> OK: the weight sync path works")
        if out.transport == "NET/Socket":
            print("  (faster: the NCCL_FAST_PATH opt-in in docs/gpu-host.md 'Faster NCCL path'; rerun this check after enabling it)")
        return 0
    print("  FAILED:")
    for line in out.diagnosis:
        print(f"   - {line}")
    tail = [l for l in (tlog + vlog).splitlines() if "NCCL" in l or "Error" in l or "error" in l][-15:]
    if tail:
        print("  last NCCL/error lines:\n    " + "\n    ".join(tail))
    return 1


if __name__ == "__main__":
    sys.exit(main())
