"""How `make train` sees a GPU host before any GPU minute, on recorded outputs (test doubles for GPU-only
steps: `docker info`, `docker run --gpus all ... nvidia-smi`, CDI, an old driver), and the stack Compose
resolves for them (real `docker compose config`): CDI devices, NCCL's fast path, the pinned revision.
Also the trainer image's `pip check` gate on recorded outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from contract.config import GpuMode
from tests.gpu_path.conftest import devices, resolved
from tests.helpers import ROOT
from contract import stages
from tools import gpu_doctor
from tools import gpu_layout
from tools import derive, docker_host, settings
from tools.commands import smoke
from tools.errors import StackError
from tools.prepare import prepare

sys.path.insert(0, str(ROOT / "services" / "trainer"))
import pip_check  # noqa: E402

# Recorded: `nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,memory.free,driver_version
# --format=csv,noheader,nounits` in a probe container, 2 x H100 on driver 550 (too old for CUDA 13) and 580.
SMI_550 = ("0, GPU-1b2c0c1e-1111-2222-3333-444444444444, NVIDIA H100 80GB HBM3, 81559, 0, 81008, 550.127.05\n"
           "1, GPU-9f0e7d6c-1111-2222-3333-555555555555, NVIDIA H100 80GB HBM3, 81559, 0, 81008, 550.127.05\n")
SMI_580 = SMI_550.replace("550.127.05", "580.95.05")
INFO_WITH_RUNTIME = '{"io.containerd.runc.v2":{"path":"runc"},"nvidia":{"path":"nvidia-container-runtime"},"runc":{"path":"runc"}}'
INFO_PLAIN = '{"io.containerd.runc.v2":{"path":"runc"},"runc":{"path":"runc"}}'
NO_GPUS_FLAG = 'docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].'
NO_CDI = "docker: Error response from daemon: CDI device injection failed: unresolvable CDI devices nvidia.com/gpu=all."


def recorded_host(info: str, gpus_flag: tuple[int, str], cdi: tuple[int, str]):
    """A fake runner answering docker the way a host of that setup did."""
    def runner(cmd: list[str]) -> subprocess.CompletedProcess:
        if cmd[:2] == ["docker", "info"]:
            return subprocess.CompletedProcess(cmd, 0, info, "")
        if cmd[:3] == ["docker", "image", "inspect"]:
            return subprocess.CompletedProcess(cmd, 1, "", "No such image")
        rc, out = gpus_flag if "--gpus" in cmd else cdi
        return subprocess.CompletedProcess(cmd, rc, out if rc == 0 else "", "" if rc == 0 else out)
    return runner


SETUPS = {
    "nvidia runtime listed": recorded_host(INFO_WITH_RUNTIME, (0, SMI_580), (125, NO_CDI)),
    "hook only, no runtime in docker info": recorded_host(INFO_PLAIN, (0, SMI_580), (125, NO_CDI)),
    "CDI only": recorded_host(INFO_PLAIN, (125, NO_GPUS_FLAG), (0, SMI_580)),
    "no GPU for containers": recorded_host(INFO_PLAIN, (125, NO_GPUS_FLAG), (125, NO_CDI)),
}


@pytest.mark.parametrize("setup,method,count", [
    ("nvidia runtime listed", "the nvidia runtime (`--gpus`)", 2),
    ("hook only, no runtime in docker info", "the NVIDIA container hook", 2),
    ("CDI only", "CDI", 2),
    ("no GPU for containers", None, 0),
])
def test_gpus_are_counted_as_docker_hands_them_out_test_double_for_gpu_host(setup, method, count):
    found = gpu_doctor.probe_docker_gpus(SETUPS[setup], image="probe:local")
    assert found.count == count
    assert (found.method is None) if method is None else found.method.startswith(method)
    mode, why = derive.resolve_mode({"TRAIN_MODE": "auto"}, found)
    assert mode.name == ("gpu" if count else "cpu")  # a hook-only or CDI host no longer falls back to CPU
    assert found.detail in why  # says which method answered
    if not count:
        assert "could not select device driver" in found.detail and "unresolvable CDI devices" in found.detail


def test_make_train_stops_on_a_driver_too_old_for_the_vllm_image_test_double_for_gpu_host(tmp_path, monkeypatch):
    old = gpu_doctor.probe_docker_gpus(SETUPS["hook only, no runtime in docker info"], image="probe:local")
    old.gpus = gpu_doctor.parse_gpu_csv(SMI_550)
    env_file = tmp_path / "gpu.env"
    env_file.write_text((ROOT / ".env.example").read_text())
    monkeypatch.setattr(settings, "ENV_FILE", env_file)
    monkeypatch.setattr(docker_host, "detect_gpus", lambda: old)
    monkeypatch.setattr(docker_host, "check_docker", lambda: None)
    monkeypatch.setattr(docker_host, "check_compose", lambda: None)
    with pytest.raises(StackError) as stop:
        prepare()  # what `make train` / `make up` run first
    assert "too old" in str(stop.value)  # the CLI prints it once and exits 2
    ok, line = gpu_doctor.check_driver("550.127.05", "vllm/vllm-openai:v0.31.0", "13.0")
    assert not ok and "NVIDIA driver 550.127.05 is too old for vllm/vllm-openai:v0.31.0 (CUDA 13.0)" in line
    assert "needs driver >= 580.65.06" in line
    assert gpu_doctor.check_driver("580.95.05", "vllm/vllm-openai:v0.31.0", "13.0")[0]
    assert gpu_doctor.check_driver("535.54.03", "some/vllm:cu129", "12.9.1")[0]  # any 12.x runs on R525+
    assert gpu_doctor.cuda_of_image("vllm/vllm-openai:v0.31.0", SETUPS["CDI only"]) == "13.0"  # known before a pull


def test_an_old_driver_is_counted_and_named_not_mistaken_for_no_gpu_test_double_for_gpu_host():
    """A CUDA 13 image on driver 550: with its NVIDIA_REQUIRE_CUDA checked, the container would not start
    ('requirement error: unsatisfied condition: cuda>=13.0'), so the probe skips that check."""
    recorded = recorded_host(INFO_WITH_RUNTIME, (0, SMI_550), (125, NO_CDI))

    def runner(cmd):
        if cmd[:2] == ["docker", "run"] and "NVIDIA_DISABLE_REQUIRE=1" not in cmd:
            return subprocess.CompletedProcess(cmd, 125, "", "nvidia-container-cli: requirement error: "
                                               "unsatisfied condition: cuda>=13.0, please update your driver")
        return recorded(cmd)

    found = gpu_doctor.probe_docker_gpus(runner, image="vllm/vllm-openai:v0.31.0")
    assert found.count == 2 and found.gpus[0].driver == "550.127.05"
    assert derive.resolve_mode({"TRAIN_MODE": "auto"}, found)[0].name == "gpu"  # then check_driver says what to install


def test_the_gpu_host_page_states_the_minimum_driver_of_each_known_vllm_image():
    readme = (ROOT / "docs/gpu-host.md").read_text()
    for image, cuda in gpu_doctor.KNOWN_IMAGE_CUDA.items():
        need = gpu_doctor.MIN_DRIVER_FOR_CUDA[int(cuda.split(".")[0])]
        assert f"| `{image}` | {cuda} | {need} |" in readme


# ------------------------------------------------------------------ the stack Compose resolves
def test_cdi_hosts_get_cdi_devices_in_compose_test_double_for_gpu_host(tmp_path, monkeypatch):
    cdi = gpu_doctor.probe_docker_gpus(SETUPS["CDI only"], image="probe:local")
    services = resolved(tmp_path, monkeypatch, "", cdi)
    assert devices(services["vllm"]) == [{"driver": "cdi", "device_ids": ["nvidia.com/gpu=0"], "capabilities": ["gpu"]}]
    assert devices(services["trainer"])[0]["device_ids"] == ["nvidia.com/gpu=1"]
    hook = gpu_doctor.probe_docker_gpus(SETUPS["hook only, no runtime in docker info"], image="probe:local")
    services = resolved(tmp_path, monkeypatch, "", hook)
    assert devices(services["vllm"]) == [{"driver": "nvidia", "device_ids": ["0"], "capabilities": ["gpu"]}]


def test_nccl_fast_path_makes_both_containers_one_host_to_nccl_test_double_for_gpu_host(tmp_path, monkeypatch):
    hook = gpu_doctor.probe_docker_gpus(SETUPS["hook only, no runtime in docker info"], image="probe:local")
    plain = resolved(tmp_path, monkeypatch, "", hook)
    assert "NCCL_HOSTID" not in plain["vllm"]["environment"] and plain["vllm"].get("ipc") is None
    fast = resolved(tmp_path, monkeypatch, "\nNCCL_FAST_PATH=1\nVLLM_GPU=3\nTRAINER_GPU=2\n", hook)
    vllm, trainer = fast["vllm"], fast["trainer"]
    for side in (vllm, trainer):
        assert side["ipc"] == "host"
        assert devices(side) == [{"driver": "nvidia", "device_ids": ["2", "3"], "capabilities": ["gpu"]}]
        env = side["environment"]
        assert env["NCCL_HOSTID"] == gpu_layout.FAST_PATH_HOSTID and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["NCCL_P2P_DISABLE"] == "0" and env["NCCL_SHM_DISABLE"] == "0" and env["NCCL_CUMEM_ENABLE"] == "0"
    # inside each container GPU 2 is cuda index 0 and GPU 3 index 1 (PCI order): each side's own GPU first
    assert vllm["environment"]["CUDA_VISIBLE_DEVICES"] == "1,0" and trainer["environment"]["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_the_pinned_revision_is_downloaded_and_served_test_double_for_gpu_host(tmp_path, monkeypatch):
    from tools.errors import parse_env_file

    revision = parse_env_file(ROOT / ".env.example")["MODEL_REVISION"]
    assert len(revision) == 40  # a commit, not a branch that moves
    hook = gpu_doctor.probe_docker_gpus(SETUPS["nvidia runtime listed"], image="probe:local")
    services = resolved(tmp_path, monkeypatch, "", hook)
    assert services["model-download"]["environment"]["MODEL_REVISION"] == revision
    assert f"--revision={revision}" in services["vllm"]["command"]
    assert f"--tokenizer-revision={revision}" in services["vllm"]["command"]
    assert services["trainer"]["environment"]["MODEL_REVISION"] == revision
    assert services["trainer"]["environment"]["ENABLE_THINKING"] == "false"


# ------------------------------------------------------------------ pip check gate (trainer image build)
BASE = """vllm 0.31.0 requires torchaudio, which is not installed.
"""
AFTER = BASE + """vllm 0.31.0 has requirement mcp<3.0.0,>=2.0.0, but you have mcp 1.26.0.
"""


def test_pip_check_gate_fails_only_on_new_unlisted_conflicts():
    allowed = pip_check.read_allow(ROOT / "services" / "trainer" / "pip-check-allow.txt")
    assert pip_check.new_conflicts(AFTER, BASE, allowed) == []  # mcp: allowed with its reason
    # vllm 0.31.0 pins no pillow version (requirements/common.txt: `pillow`): a pillow conflict is news, not allowed
    pillow = "vllm 0.31.0 has requirement pillow>=11.0, but you have pillow 10.4.0."
    assert pip_check.new_conflicts(AFTER + pillow + "\n", BASE, allowed) == [pillow]
    drift = AFTER + "transformers 5.17.0 has requirement tokenizers<0.23, but you have tokenizers 0.24.0.\n"
    assert pip_check.new_conflicts(drift, BASE, allowed) == [
        "transformers 5.17.0 has requirement tokenizers<0.23, but you have tokenizers 0.24.0."]
    uv = "The package `vllm` requires `mcp>=2`, but `1.26.0` is installed\n"
    assert pip_check.conflicts(uv) == {("vllm", "mcp"): uv.strip()}
    assert pip_check.new_conflicts(AFTER, BASE, set()) == sorted(AFTER.splitlines()[1:])  # nothing allowed: both


def test_pip_check_allow_list_lines_each_carry_a_reason():
    for raw in (ROOT / "services" / "trainer" / "pip-check-allow.txt").read_text().splitlines():
        if raw.strip() and not raw.lstrip().startswith("#"):
            assert ":" in raw.split("#")[0]


# ------------------------------------------------------------------ gpu-smoke verdict
def test_smoke_table_names_the_first_missing_stage_and_what_it_means():
    log = "\n".join([
        '[stage] {"stage": "model_download", "seconds": 41.0, "detail": "Qwen/Qwen3-0.6B at revision c1899de"}',
        'vllm-1 | [stage] {"stage": "vllm_healthy", "seconds": 95.2, "detail": "serves Qwen/Qwen3-0.6B"}',
        '[stage] {"stage": "rendezvous", "seconds": 2.1, "detail": "group formed"}',
        '[stage] {"stage": "first_generation", "seconds": 3.4, "detail": "first batch"}',
        '[stage] {"stage": "first_optimizer_step", "seconds": 7.9, "detail": "step 1"}',
    ])
    lines, ok = smoke.smoke_table(GpuMode(), stages.parse(log), failed_rc=75)
    assert not ok
    assert lines[0].startswith("  pass model download") and "41.0s" in lines[0]
    weight_sync = next(line for line in lines if "first weight sync" in line)
    assert weight_sync.startswith("  FAIL") and "never reached" in weight_sync and "make nccl-check FULL=1" in weight_sync
    assert lines[-1].startswith("  FAIL trainer exit") and "exit code 75" in lines[-1]
    full = log + '\n[stage] {"stage": "first_weight_sync", "seconds": 0.8}\n[stage] {"stage": "tool_calls", "value": 0.0}'
    lines, ok = smoke.smoke_table(GpuMode(), stages.parse(full), failed_rc=0)
    assert not ok and lines[-1].startswith("  FAIL tool calls per episode")  # 0 calls: reward would stay flat


def test_gpu_smoke_on_a_host_without_gpus_says_so_and_what_runs_instead(docker, tmp_path):
    # `python -m tools` asks the engine first (the `docker` fixture); DOCKER_HOST passes through so the host-only part,
    # run with no engine reachable, would catch this test there
    env = {"PATH": "/usr/bin:/bin", "STACK_FAKE_NO_GPU": "1", "STACK_ENV_FILE": str(tmp_path / "x.env"),
           **{k: v for k, v in os.environ.items() if k == "DOCKER_HOST"}}
    (tmp_path / "x.env").write_text((ROOT / ".env.example").read_text())
    r = subprocess.run([sys.executable, "-m", "tools", "smoke", "--gpu"], cwd=ROOT, env=env, capture_output=True,
                       text=True)
    assert r.returncode == 2
    assert "make gpu-smoke checks the GPU path" in r.stderr and "`make train` trains on the CPU profile" in r.stderr
