"""Entrypoint of both trainer services: `python -m trainer.launch [trainer.train flags]`.

One trainer process runs trainer.train in place. Several (one per trainer GPU, or TRAINER_PROCESSES
on the CPU profile) start through `accelerate launch`: DDP by default, FSDP or DeepSpeed ZeRO-3 with
TRAINER_SHARDING. Every process opens its own env sessions; only the main one writes metrics,
TensorBoard and checkpoints, and only it talks to the vLLM server (TRL's server mode).
"""

from __future__ import annotations

import importlib.util
import os
import sys

from contract.config import ConfigError, RunConfig, TrainModeVariant
from trainer.core import grpo_args

RENDEZVOUS_PORT = 29500  # torch.distributed among the trainer's own processes (inside its container)
# On SIGTERM the launcher (torchrun underneath) SIGKILLs its workers after TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by
# default); the workers need up to compose.yaml's stop_grace_period (90 s) to finish the step and save.
WORKER_STOP_GRACE_S = 85

SHARDING_FLAGS: dict[str, list[str]] = {
    "ddp": ["--multi_gpu"],  # torchrun underneath; on the CPU profile HF's Trainer picks gloo (use_cpu)
    # FSDP2 (`fully_shard`, in place): TRL 1.16 gathers each parameter with full_tensor(). Its FSDP1 walk misses the
    # root's own parameters (embeddings, final norm) and runs before the root's lazy init.
    "fsdp": ["--use_fsdp", "--fsdp_version", "2", "--fsdp_reshard_after_forward", "true",
             "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_state_dict_type", "FULL_STATE_DICT"],
    "zero3": ["--use_deepspeed", "--zero_stage", "3", "--zero3_init_flag", "true", "--zero3_save_16bit_model", "true"],
}


class LaunchError(RuntimeError):
    """The processes asked for cannot be started here; the message names the setting and the fix."""


def process_count(cfg: RunConfig, visible_gpus: int) -> int:
    """Trainer processes for a config with TRAIN_MODE resolved (trainer.core.grpo_args.resolve)."""
    if cfg.placement.trainer_on_cpu:
        return cfg.trainer_processes or 1
    n = cfg.trainer_processes or max(visible_gpus, 1)
    if n > visible_gpus:
        raise LaunchError(f"TRAINER_PROCESSES={n} but the trainer container sees {visible_gpus} GPU(s): one process per "
                          "GPU; name the GPUs in TRAINER_GPU (e.g. 2-7) and let `make train` set the count")
    return n


def launch_argv(n: int, mode: TrainModeVariant, sharding: str, args: list[str], port: int = RENDEZVOUS_PORT,
                rehearsal: bool = False) -> list[str]:
    """The command that runs trainer.train in `n` processes (n == 1: directly). `rehearsal`: server mode on CPU
    (TRAIN_MODE=gpu, WEIGHT_TRANSFER=reload), where ROLLOUTS=async shards 2 processes with FSDP2 over gloo."""
    if n == 1:
        return [sys.executable, "-m", "trainer.train", *args]
    if mode.trainer_on_cpu and sharding != "ddp" and not rehearsal:
        raise LaunchError(f"TRAINER_SHARDING={sharding} shards over GPUs; the CPU profile runs ddp (edit .env)")
    if sharding == "zero3" and importlib.util.find_spec("deepspeed") is None:
        raise LaunchError("TRAINER_SHARDING=zero3 needs DeepSpeed, which the trainer image does not carry; use "
                          "TRAINER_SHARDING=fsdp (PyTorch's own sharding, in the image) or ddp (edit .env)")
    # accelerate launch with torchrun's store on 127.0.0.1 only (trainer/run/loopback_launch.py says why)
    return [sys.executable, "-m", "trainer.run.loopback_launch", "--num_processes", str(n), "--num_machines", "1",
            "--main_process_port", str(port), "--rdzv_backend", "loopback", "--rdzv_conf", f"port={port}",
            "--dynamo_backend", "no", *SHARDING_FLAGS[sharding], "-m", "trainer.train", *args]


def pin_interfaces(mode: TrainModeVariant, vllm_url: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Keep the sockets the trainer processes open among themselves off envnet, on every rank (they inherit this
    environment): gloo on loopback (all ranks share this container); NCCL on the interface vLLM reaches us on in
    server mode (rank 0's weight sync needs it; prepare_rendezvous), on loopback when colocated. A value the user
    set wins for NCCL. Returns what it set."""
    environ = os.environ if environ is None else environ
    before = dict(environ)
    environ["GLOO_SOCKET_IFNAME"] = "lo"  # by default gloo listens on the hostname's address: envnet's or agentnet's
    if mode.server:
        from trainer.gpu.nccl import prepare_rendezvous
        from trainer.gpu.server import VLLMPreflightError

        try:
            prepare_rendezvous(vllm_url, environ)
        except VLLMPreflightError:
            pass  # rank 0's preflight runs it again and reports the problem with its fix
    elif mode.uses_vllm and not environ.get("NCCL_SOCKET_IFNAME"):
        environ["NCCL_SOCKET_IFNAME"] = "lo"
    return {k: v for k, v in environ.items() if before.get(k) != v}


def place_cpu_ranks(environ: dict[str, str] | None = None) -> None:
    """Every CPU rank on the device "cpu". accelerate gives each torch.device("cpu", 0), and HF's Trainer, resuming
    with several processes, loads the optimizer's state with that as map_location, which torch cannot restore
    ("cpu:0"): a resumed 2-process rehearsal stopped there."""
    environ = os.environ if environ is None else environ
    environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = RunConfig.load(argv)
    except ConfigError as exc:
        print(f"[launch] config error:\n{exc}", file=sys.stderr, flush=True)
        return 2
    cfg = grpo_args.resolve(cfg)
    chosen = cfg.placement
    if chosen.server:  # before any process starts: the container's exit code is this one, whatever the count
        from trainer.gpu.push_state import EXIT_VLLM_RESTART, restart_line, restart_reason

        reason = restart_reason(cfg.output_dir, cfg.vllm_server_url, float(cfg.vllm_server_timeout_s))
        if reason:
            print(restart_line(reason), file=sys.stderr, flush=True)
            return EXIT_VLLM_RESTART
    visible = 0
    if not chosen.trainer_on_cpu:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        n = process_count(cfg, visible)
        problem = cfg.rollouts_problem(n)
        if problem:
            raise LaunchError(problem)
        cmd = launch_argv(n, chosen.process_mode, cfg.trainer_sharding, argv,
                          rehearsal=chosen.server and chosen.trainer_on_cpu)
    except LaunchError as exc:
        print(f"[launch] {exc}", file=sys.stderr, flush=True)
        return 2
    if n == 1:
        from trainer.train import main as train

        return train(argv)
    backend = "gloo" if chosen.trainer_on_cpu else "nccl"
    print(f"[launch] {n} trainer processes ({cfg.trainer_sharding}, {backend}) through "
          "accelerate; each opens its own env sessions, rank 0 logs and checkpoints", flush=True)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(WORKER_STOP_GRACE_S))
    if chosen.trainer_on_cpu:
        place_cpu_ranks()
    pin_interfaces(chosen.process_mode, cfg.vllm_server_url)
    os.execv(cmd[0], cmd)  # the launcher becomes this container's process: signals reach every rank
    return 0  # pragma: no cover


if __name__ == "__main__":
    raise SystemExit(main())
