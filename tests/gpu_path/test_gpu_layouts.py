"""Every GPU of one host (docs/gpu-host.md "Every GPU of a host"): the GPU lists of .env become the devices, vLLM
flags, world size and trainer processes Compose runs, resolved for 4- and 8-GPU hosts by the real
`docker compose config` (test doubles for the GPU-only part: the hosts' GPUs are recorded nvidia-smi
lines). The trainer launcher's command lines, and the one-/two-GPU defaults unchanged."""

from __future__ import annotations

import sys

import pytest

from tests.gpu_path.conftest import devices, resolved
from tests.helpers import ROOT, free_port
from contract.config import CpuMode, GpuMode, RunConfig
from trainer.launch import LaunchError, launch_argv, process_count
from tools import gpu_doctor
from tools import gpu_layout
from tools import docker_host, settings
from tools.prepare import prepare


def host_with(n: int) -> gpu_doctor.DockerGpus:
    csv = "".join(f"{i}, GPU-{i:08d}-aaaa-bbbb-cccc-dddddddddddd, NVIDIA H100 80GB HBM3, 81559, 0, 81008, 580.95.05\n"
                  for i in range(n))
    return gpu_doctor.DockerGpus("the nvidia runtime (`--gpus`)", gpu_doctor.parse_gpu_csv(csv), f"{n} GPU(s)")


def flag(service: dict, name: str) -> str:
    return next(a.split("=", 1)[1] for a in service["command"] if a.startswith(f"--{name}="))


@pytest.mark.parametrize("value,ids", [("1", ["1"]), ("0,1", ["0", "1"]), ("2-7", [str(i) for i in range(2, 8)]),
                                       ("0,2-3", ["0", "2", "3"]), ("GPU-abc", ["GPU-abc"])])
def test_gpu_lists_in_env(value, ids):
    assert gpu_layout.parse_gpu_ids(value, "TRAINER_GPU") == ids


@pytest.mark.parametrize("value,message", [("3-1", "runs backwards"), ("0,0", "names a GPU twice"),
                                           ("gpu0", "is not a GPU id"), ("", "is empty")])
def test_bad_gpu_lists_name_the_variable(value, message):
    with pytest.raises(gpu_layout.LayoutError, match=message):
        gpu_layout.parse_gpu_ids(value, "VLLM_GPU")


def test_a_gpu_on_both_sides_is_refused():
    with pytest.raises(gpu_layout.LayoutError, match="share GPU 1"):
        gpu_layout.plan({"VLLM_GPU": "0-1", "TRAINER_GPU": "1-3"}, GpuMode())


@pytest.mark.parametrize("count,split", [(1, None), (2, None), (4, ("0-1", "2-3")), (8, ("0-3", "4-7"))])
def test_auto_proposes_a_split_that_uses_every_gpu(count, split):
    assert gpu_layout.propose_split(count) == split


def test_eight_gpu_host_with_default_env_keeps_the_two_gpu_layout_and_proposes_one_test_double_for_gpu_host(tmp_path, monkeypatch, capsys):
    env_file = tmp_path / "eight.env"
    env_file.write_text((ROOT / ".env.example").read_text())
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    monkeypatch.setattr(docker_host, "detect_gpus", lambda: host_with(8))
    monkeypatch.setattr(docker_host, "check_docker", lambda: None)
    monkeypatch.setattr(docker_host, "check_compose", lambda: None)
    prepared = prepare()
    compose_vars, mode = prepared.compose_vars, prepared.mode
    out = capsys.readouterr().out
    assert mode.name == "gpu" and compose_vars["VLLM_TENSOR_PARALLEL_SIZE"] == "1" and compose_vars["TRAINER_PROCESSES"] == "1"
    assert "vLLM on GPU 0 (one GPU), trainer on GPU 1 (1 process(es))" in out
    assert "this host has 8 GPUs and the run uses 2; to use all of them set VLLM_GPU=0-3 TRAINER_GPU=4-7 " \
           "VLLM_PARALLEL=tensor" in out


def test_four_gpu_host_tensor_parallel_vllm_and_two_ddp_trainers_test_double_for_gpu_host(tmp_path, monkeypatch):
    services = resolved(tmp_path, monkeypatch, "\nVLLM_GPU=0,1\nTRAINER_GPU=2-3\n", host_with(4))
    vllm, trainer = services["vllm"], services["trainer"]
    assert devices(vllm) == [{"driver": "nvidia", "device_ids": ["0", "1"], "capabilities": ["gpu"]}]
    assert devices(trainer) == [{"driver": "nvidia", "device_ids": ["2", "3"], "capabilities": ["gpu"]}]
    assert flag(vllm, "tensor-parallel-size") == "2" and flag(vllm, "data-parallel-size") == "1"
    assert trainer["environment"]["VLLM_WORLD_SIZE"] == "2" and trainer["environment"]["TRAINER_PROCESSES"] == "2"
    assert trainer["command"] == ["python3", "-m", "trainer.launch"]
    for side in (vllm, trainer):  # inside one container NCCL may use P2P/SHM between its own GPUs
        assert side["environment"]["NCCL_P2P_DISABLE"] == "0" and side["environment"]["NCCL_SHM_DISABLE"] == "0"


def test_eight_gpu_host_data_parallel_vllm_and_four_fsdp_trainers_test_double_for_gpu_host(tmp_path, monkeypatch):
    lines = "\nVLLM_GPU=0-3\nTRAINER_GPU=4-7\nVLLM_PARALLEL=data\nTRAINER_SHARDING=fsdp\n"
    services = resolved(tmp_path, monkeypatch, lines, host_with(8))
    vllm, trainer = services["vllm"], services["trainer"]
    assert devices(vllm)[0]["device_ids"] == ["0", "1", "2", "3"]
    assert devices(trainer)[0]["device_ids"] == ["4", "5", "6", "7"]
    assert flag(vllm, "tensor-parallel-size") == "1" and flag(vllm, "data-parallel-size") == "4"
    env = trainer["environment"]
    assert env["VLLM_WORLD_SIZE"] == "4" and env["TRAINER_PROCESSES"] == "4" and env["TRAINER_SHARDING"] == "fsdp"


def test_two_and_one_gpu_defaults_are_unchanged_test_double_for_gpu_host(tmp_path, monkeypatch):
    two = resolved(tmp_path, monkeypatch, "", host_with(2))
    assert devices(two["vllm"])[0]["device_ids"] == ["0"] and devices(two["trainer"])[0]["device_ids"] == ["1"]
    assert flag(two["vllm"], "tensor-parallel-size") == "1" and flag(two["vllm"], "data-parallel-size") == "1"
    assert "NCCL_HOSTID" not in two["trainer"]["environment"] and two["trainer"]["environment"]["TRAINER_PROCESSES"] == "1"
    one = resolved(tmp_path, monkeypatch, "\nTRAINER_GPU=0\n", host_with(1), mode="colocate")
    assert "vllm" not in one and devices(one["trainer"])[0]["device_ids"] == ["0"]


def test_launcher_runs_one_process_in_place_and_several_through_accelerate():
    cfg = RunConfig.load(["--train-mode", "cpu"])
    assert launch_argv(1, CpuMode(), "ddp", ["--max-steps", "2"])[1:] == ["-m", "trainer.train", "--max-steps", "2"]
    argv = launch_argv(2, CpuMode(), "ddp", ["--max-steps", "2"])
    assert argv[1:3] == ["-m", "trainer.run.loopback_launch"] and "--multi_gpu" in argv
    assert argv[argv.index("--num_processes") + 1] == "2" and argv[-4:] == ["-m", "trainer.train", "--max-steps", "2"]
    fsdp = launch_argv(4, GpuMode(), "fsdp", [])
    assert "--use_fsdp" in fsdp and fsdp[fsdp.index("--fsdp_version") + 1] == "2"
    with pytest.raises(LaunchError, match="the CPU profile runs ddp"):
        launch_argv(2, CpuMode(), "fsdp", [])
    assert process_count(cfg.resolved(CpuMode()), 0) == 1
    assert process_count(RunConfig.load(["--trainer-processes", "2"]).resolved(CpuMode()), 0) == 2
    assert process_count(RunConfig.load([]).resolved(GpuMode()), 4) == 4  # GPU: one per visible trainer GPU
    with pytest.raises(LaunchError, match="sees 2 GPU"):
        process_count(RunConfig.load(["--trainer-processes", "4"]).resolved(GpuMode()), 2)


def test_preflight_refuses_a_vllm_server_started_with_another_layout():
    from trainer.gpu.server import ServerReport, world_size_mismatch

    report = ServerReport(url="http://vllm:8000", world_size=1)
    assert world_size_mismatch(report, 1) == []
    problem = world_size_mismatch(report, 4)[0]
    assert "runs 1 worker(s) (/get_world_size) but this run expects 4 (VLLM_GPU and VLLM_PARALLEL" in problem
    assert "`make down && make up`" in problem


def test_zero3_without_deepspeed_in_the_image_says_what_to_use_instead(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LaunchError, match="use TRAINER_SHARDING=fsdp"):
        launch_argv(4, GpuMode(), "zero3", [])


def test_gpus_named_by_uuid_are_ordered_by_their_pci_index_not_alphabetically():
    vllm, trainer = "GPU-f0000000-0000-0000-0000-000000000000", "GPU-a0000000-0000-0000-0000-000000000000"
    layout = gpu_layout.placements([vllm], [trainer], fast_path=True, pci_index={vllm: 0, trainer: 1})
    assert layout["trainer"].devices == [vllm, trainer]  # PCI order: CUDA_VISIBLE_DEVICES indexes into it
    assert layout["trainer"].env["CUDA_VISIBLE_DEVICES"] == "1,0" and layout["vllm"].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    unknown = gpu_layout.placements([vllm], [trainer], fast_path=True)["vllm"].devices
    assert unknown == [vllm, trainer]  # unknown UUIDs keep the order given


def test_the_launcher_gives_its_workers_composes_stop_grace_period_to_save(monkeypatch):
    """torchrun SIGKILLs its workers TORCH_ELASTIC_SHUTDOWN_TIMEOUT (30 s by default) after a SIGTERM; Compose
    waits stop_grace_period. The launcher must wait almost as long, or a stop loses the checkpoint."""
    import os

    import yaml

    from trainer import launch

    grace = yaml.safe_load((ROOT / "compose.yaml").read_text())["x-trainer-common"]["stop_grace_period"]
    assert grace.endswith("s") and 30 < launch.WORKER_STOP_GRACE_S < int(grace[:-1])
    execs = []
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    monkeypatch.setattr(launch.os, "execv", lambda path, argv: execs.append(argv))
    launch.main(["--train-mode", "cpu", "--trainer-processes", "2", "--max-steps", "1"])
    assert execs and os.environ["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(launch.WORKER_STOP_GRACE_S)


def test_fsdp_is_fsdp2_and_every_parameter_reaches_the_weight_sync_full_size(tiny_model_dir):
    """TRAINER_SHARDING=fsdp is FSDP2: TRL 1.16's FSDP1 walk ran before the root unit's lazy init, missed the
    parameters the root owns (embeddings, final norm) and kept views of re-sharded tensors. On 2 CPU processes
    (gloo): the model sharded as FSDP2 shards it, TRL's own sync sends every parameter once, at its full shape
    (test double for the NCCL broadcast: a recording client)."""
    import json
    import subprocess

    from trainer.launch import SHARDING_FLAGS

    flags = SHARDING_FLAGS["fsdp"]
    assert flags[flags.index("--fsdp_version") + 1] == "2"
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(ROOT / "tests" / "gpu_path" / "fsdp2_weight_sync.py"), str(tiny_model_dir)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["sharded"] > 0  # the parameters really were split between the two processes
    assert dict(result["sent"]) == result["full"] and len(result["sent"]) == len(result["full"])
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= set(dict(result["sent"]))  # the root's own
    assert dict(result["metadata"]) == result["full"]
