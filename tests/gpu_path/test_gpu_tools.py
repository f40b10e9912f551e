"""tools/gpu_doctor.py and tools/nccl_check.py on recorded outputs: every test here is a test
double for a GPU-only step (nvidia-smi, docker --gpus, an NCCL run), since no GPU is lent here.
The two `no GPU here` tests run the real tools on this machine."""

from __future__ import annotations

import subprocess
import sys

import pytest

from contract.config import ColocateMode, GpuMode
from tests.helpers import ROOT
from tools import gpu_doctor
from tools import gpu_layout
from tools import nccl_check
from tools.images import TRAINER_GPU_BUILD, image_of

# Recorded on a 2 x A100 host (nvidia-smi 550.x), trimmed.
SMI_CSV_2 = """0, GPU-5d7c2f0e-aaaa-bbbb-cccc-000000000000, NVIDIA A100-SXM4-80GB, 81920, 4, 81398, 550.54.15
1, GPU-9e1f7a11-aaaa-bbbb-cccc-111111111111, NVIDIA A100-SXM4-80GB, 81920, 40960, 40442, 550.54.15
"""
SMI_CSV_1 = "0, GPU-12345678-aaaa-bbbb-cccc-222222222222, NVIDIA GeForce RTX 4090, 24564, 1090, 23012, 560.35.03\n"
IMAGE_ENV = ["PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/bin", "NVIDIA_REQUIRE_CUDA=cuda>=12.9",
             "CUDA_VERSION=12.9.1", "VLLM_USAGE_SOURCE=production-docker-image"]
ENV = {"VLLM_GPU": "0", "TRAINER_GPU": "1", "VLLM_GPU_MEMORY_UTILIZATION": ""}


def rows_by_name(rows):
    return {name: (ok, msg) for ok, name, msg in rows}


def test_no_gpu_here_gpu_doctor_exits_cleanly():
    out = subprocess.run([sys.executable, "-m", "tools.gpu_doctor"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "STACK_FAKE_NO_GPU": "1"})
    assert out.returncode == 0 and "no NVIDIA GPU here" in out.stdout


def test_no_gpu_here_nccl_check_exits_cleanly():
    out = subprocess.run([sys.executable, "-m", "tools.nccl_check"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "STACK_FAKE_NO_GPU": "1"})
    assert out.returncode == 0 and "no NVIDIA GPU here" in out.stdout


def test_recorded_nvidia_smi_is_parsed_test_double_for_gpu_host():
    gpus = gpu_doctor.parse_gpu_csv(SMI_CSV_2)
    assert [g.index for g in gpus] == ["0", "1"]
    assert gpus[1].free_mib == 40442 and gpus[0].name == "NVIDIA A100-SXM4-80GB"
    assert gpus[0].driver == "550.54.15"
    assert gpu_doctor.image_cuda_version(IMAGE_ENV) == "12.9.1"
    assert gpu_doctor.parse_gpu_csv("No devices were found\n") == []


def test_two_gpu_host_with_old_driver_and_busy_vllm_gpu_test_double_for_gpu_host():
    gpus = gpu_doctor.parse_gpu_csv(SMI_CSV_2)
    gpus[0].free_mib = 20000  # someone else holds GPU 0
    rows = rows_by_name(gpu_doctor.diagnose(gpus, "the nvidia runtime", ENV, GpuMode(), "vllm/vllm-openai:v0.31.0", "13.0"))
    assert rows["GPU count"][0] and rows["VLLM_GPU"][0] and rows["TRAINER_GPU"][0]
    ok, msg = rows["driver vs image"]
    assert not ok and "NVIDIA driver 550.54.15 is too old" in msg and ">= 580.65.06" in msg
    ok, msg = rows["free memory GPU 0"]
    assert not ok and "VLLM_GPU_MEMORY_UTILIZATION" in msg
    assert rows["free memory GPU 1"][0]  # the trainer's GPU: no vLLM share to fit


def test_one_gpu_host_is_told_to_use_colocate_test_double_for_gpu_host():
    gpus = gpu_doctor.parse_gpu_csv(SMI_CSV_1)
    rows = rows_by_name(gpu_doctor.diagnose(gpus, "CDI", ENV, GpuMode(), "img", None))
    ok, msg = rows["GPU count"]
    assert not ok and "TRAIN_MODE=colocate" in msg
    assert not rows["TRAINER_GPU"][0]  # GPU 1 does not exist
    colocate = rows_by_name(gpu_doctor.diagnose(gpus, "CDI", {"TRAINER_GPU": "0"}, ColocateMode(), "img", None))
    assert all(ok for ok, _ in colocate.values())
    assert "colocate" in colocate["GPU count"][1]
    # .env.example's TRAINER_GPU=1 on this one-GPU host: `make train` uses GPU 0, and the doctor agrees.
    example = rows_by_name(gpu_doctor.diagnose(gpus, "CDI", {"TRAINER_GPU": "1"}, ColocateMode(), "img", None))
    assert all(ok for ok, _ in example.values()), example
    assert "using GPU 0" in example["TRAINER_GPU"][1] or "TRAINER_GPU=0" in example["TRAINER_GPU"][1]


def test_missing_runtime_and_same_gpu_twice_are_reported_test_double_for_gpu_host():
    gpus = gpu_doctor.parse_gpu_csv(SMI_CSV_2)
    rows = rows_by_name(gpu_doctor.diagnose(gpus, None, {"VLLM_GPU": "1", "TRAINER_GPU": "1"}, GpuMode(),
                                            "img", "12.9.1"))
    assert not rows["Docker GPU access"][0] and "nvidia-container-toolkit" in rows["Docker GPU access"][1]
    assert not rows["GPU assignment"][0]
    assert rows["driver vs image"][0]  # any 12.x runs on R525+


# ------------------------------------------------------------------ nccl_check
TRAINER_OK = """NCCLCHECK {"event": "start", "role": "trainer", "rank": 0, "master": "172.20.0.5", "port": 51216, "torch": "2.13.0+cu129", "vllm": "0.31.0", "nccl": "2.28.3", "cuda": "12.9", "gpu": "NVIDIA A100"}
a1:42:42 [0] NCCL INFO Bootstrap : Using eth0:172.20.0.5<0>
a1:42:42 [0] NCCL INFO NET/Socket : Using [0]eth0:172.20.0.5<0>
a1:42:42 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
a1:42:42 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[0] [send] via NET/Socket/0
NCCLCHECK {"event": "group", "role": "trainer", "init_s": 1.9, "disabled": false}
NCCLCHECK {"event": "done", "role": "trainer", "seconds": 0.61, "bytes": 1342177280, "gbps": 2.2, "ok": true}
"""
VLLM_OK = TRAINER_OK.replace('"trainer"', '"vllm"').replace('"rank": 0', '"rank": 1')
VLLM_REFUSED = """NCCLCHECK {"event": "start", "role": "vllm", "rank": 1, "master": "127.0.0.1", "port": 51216, "torch": "2.13.0+cu129", "vllm": "0.31.0", "nccl": "2.28.3"}
torch.distributed.DistStoreError: Failed to connect to 127.0.0.1:51216: Connection refused
"""


def test_nccl_check_plan_trainer_listens_vllm_connects_test_double_for_gpu_run():
    env = nccl_check.nccl_env({"NCCL_SOCKET_IFNAME": "ens5"})
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_P2P_DISABLE"] == "1" and env["NCCL_SOCKET_IFNAME"] == "ens5"
    layout = gpu_layout.placements(["0"], ["1"], fast_path=False)
    t = nccl_check.docker_run_argv("trainer", image_of(TRAINER_GPU_BUILD), layout["trainer"], "net", "t", env, "-",
                                   51216, 64, 3)
    v = nccl_check.docker_run_argv("vllm", "vllm/vllm-openai:v0.31.0", layout["vllm"], "net", "v", env,
                                   "172.20.0.5", 51216, 64, 3)
    assert t[t.index("--gpus") + 1] == '"device=1"' and v[v.index("--gpus") + 1] == '"device=0"'
    assert t[-6:] == ["trainer", "-", "51216", "64", "3", "2"] and v[-6:] == ["vllm", "172.20.0.5", "51216", "64", "3", "2"]
    assert "--ipc" not in t
    fast = gpu_layout.placements(["0"], ["1"], fast_path=True)["trainer"]
    fast_env = nccl_check.nccl_env({"NCCL_FAST_PATH": "1"}, fast)
    argv = nccl_check.docker_run_argv("trainer", "i", fast, "n", "t", fast_env, "-", 1, 1, 1, cdi=True)
    assert fast_env["NCCL_P2P_DISABLE"] == "0" and fast_env["NCCL_HOSTID"] == gpu_layout.FAST_PATH_HOSTID
    assert argv[argv.index("--ipc") + 1] == "host"
    assert [argv[i + 1] for i, a in enumerate(argv) if a == "--device"] == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    compile(nccl_check.SCRIPT, "nccl_check_script", "exec")  # the in-container script is valid Python


def test_nccl_check_reports_transport_and_bandwidth_test_double_for_gpu_run():
    out = nccl_check.diagnose(TRAINER_OK, VLLM_OK, timed_out=False)
    assert out.ok and out.transport == "NET/Socket" and out.gbps == 2.2 and out.init_s == 1.9
    for line, transport in (("via P2P/IPC/read", "P2P/IPC/read"), ("via SHM/direct/direct", "SHM")):
        t, v = (log.replace("via NET/Socket/0", line) for log in (TRAINER_OK, VLLM_OK))
        assert nccl_check.diagnose(t, v, False).transport == transport


@pytest.mark.parametrize("vllm_log,timed_out,expect", [
    (VLLM_REFUSED, False, "VLLM_HOST_IP"),
    ("NCCL WARN Bootstrap : no socket interface found", False, "NCCL_SOCKET_IFNAME"),
    ("docker: Error response from daemon: could not select device driver \"\" with capabilities: [[gpu]].",
     False, "nvidia-container-toolkit"),
    ("RuntimeError: CUDA error: invalid device ordinal", False, "VLLM_GPU / TRAINER_GPU"),
    ("CUDA driver version is insufficient for CUDA runtime version", False, "upgrade the driver"),
    ("", True, "stuck in the rendezvous"),
])
def test_nccl_check_diagnoses_each_failure_test_double_for_gpu_run(vllm_log, timed_out, expect):
    trainer_log = TRAINER_OK.split("NCCLCHECK {\"event\": \"group\"")[0] if timed_out else ""
    out = nccl_check.diagnose(trainer_log, vllm_log, timed_out=timed_out, timeout_s=180)
    assert not out.ok
    assert any(expect in d for d in out.diagnosis), out.diagnosis


def test_nccl_check_world_of_four_waits_for_every_vllm_rank_test_double_for_gpu_run():
    """VLLM_GPU=0-2 (tensor parallel 3): the sync's world is the trainer + 3 workers; all must receive."""
    ranks = [VLLM_OK.replace('"rank": 1', f'"rank": {r}').replace('"event": "done", "role": "vllm"',
                                                                   f'"event": "done", "role": "vllm", "rank": {r}')
             for r in (1, 2, 3)]
    assert nccl_check.diagnose(TRAINER_OK, "".join(ranks), timed_out=False, world=4).ok
    assert not nccl_check.diagnose(TRAINER_OK, "".join(ranks[:2]), timed_out=True, timeout_s=9, world=4).ok
    lost = ranks[2].replace('"ok": true', '"ok": false')
    out = nccl_check.diagnose(TRAINER_OK, ranks[0] + ranks[1] + lost, timed_out=False, world=4)
    assert not out.ok and "vLLM rank(s) 3 did not receive" in out.diagnosis[0]
    argv = nccl_check.docker_run_argv("vllm", "img", gpu_layout.placements(["0", "1", "2"], ["3"], False)["vllm"],
                                      "n", "v", {}, "10.0.0.2", 51216, 8, 1, world=4)
    assert argv[argv.index("--gpus") + 1] == '"device=0,1,2"' and argv[-1] == "4"


def test_nccl_check_flags_version_skew_between_images_test_double_for_gpu_run():
    skewed = VLLM_OK.replace('"vllm": "0.31.0"', '"vllm": "0.30.0"')
    out = nccl_check.diagnose(TRAINER_OK, skewed, timed_out=False)
    assert not out.ok and "version skew" in out.diagnosis[0]


def test_nccl_check_catches_a_silently_disabled_nccl_test_double_for_gpu_run():
    disabled = TRAINER_OK.replace('"disabled": false', '"disabled": true')
    out = nccl_check.diagnose(disabled, VLLM_OK, timed_out=False)
    assert not out.ok and "libnccl" in out.diagnosis[0]


def test_vllms_gpu_keeps_room_for_a_weight_push_outside_its_share_test_double_for_gpu_host():
    """#42 item 7: at VLLM_GPU_MEMORY_UTILIZATION=0.9 a 24 GB card keeps 2.4 GiB outside vLLM's share, short of a push's
    two 1 GiB receive buffers and NCCL's own: one FAIL line with the share that fits; 48 and 80 GB cards pass."""
    from contract import memory

    card24 = gpu_doctor.parse_gpu_csv(SMI_CSV_1.replace("0, GPU-1", "1, GPU-1") + SMI_CSV_1)  # two RTX 4090s
    rows = rows_by_name(gpu_doctor.diagnose(card24, "CDI", {"VLLM_GPU": "0", "TRAINER_GPU": "1"}, GpuMode(), "img", None))
    ok, msg = rows["weight-push room GPU 0"]
    assert not ok and "set VLLM_GPU_MEMORY_UTILIZATION=0.89 or lower (edit .env)" in msg
    assert "weight-push room GPU 1" not in rows  # the trainer's GPU
    assert rows_by_name(gpu_doctor.diagnose(card24, "CDI", {"VLLM_GPU": "0", "TRAINER_GPU": "1",
                                                            "VLLM_GPU_MEMORY_UTILIZATION": "0.89"},
                                            GpuMode(), "img", None))["weight-push room GPU 0"][0]
    assert rows_by_name(gpu_doctor.diagnose(gpu_doctor.parse_gpu_csv(SMI_CSV_2), "CDI", ENV, GpuMode(), "img",
                                            None))["weight-push room GPU 0"][0]
    colocate = rows_by_name(gpu_doctor.diagnose(card24[:1], "CDI", {"TRAINER_GPU": "0"}, ColocateMode(), "img", None))
    assert not any(name.startswith("weight-push room") for name in colocate)  # in-process load, no receive buffers
    for mib, ok in memory.CARDS_MIB.items():
        assert (memory.vllm_push_room(ok * 1024 ** 2, 0.9) is None) == (mib != "24 GB")
    assert "give vLLM a bigger GPU" in memory.vllm_push_room(4 * memory.GIB, 0.9)
