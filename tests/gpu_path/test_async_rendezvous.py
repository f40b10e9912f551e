"""ROLLOUTS=async's NCCL rendezvous follows the sync rules (#31 item 10, trainer.gpu.nccl.pin_async_rendezvous_port).

TRL's async weight transfer advertises vLLM's get_ip() and get_open_port() instead of TRL's vllm_group_port. Checked
against the sources that run: TRL's (installed here) and vLLM 0.31.0's (the twin image: the same release the GPU
trainer image is built on). The NCCL group itself needs GPUs: `make nccl-check FULL=1` with ROLLOUTS=async.
"""

from __future__ import annotations

import inspect
import subprocess

import pytest

from tests.gpu_path.conftest import VLLM_CPU_IMAGE, ensure_vllm_cpu_image
from trainer.gpu import nccl


def test_trls_async_transfer_advertises_get_ip_and_get_open_port():
    from trl.experimental.async_grpo import weight_transfer

    source = inspect.getsource(weight_transfer.WeightTransferClient.init_weight_transfer)
    assert "master_address = get_ip()" in source and "master_port = get_open_port()" in source  # PINNED, trl 1.16.0


def test_the_port_pin_keeps_a_users_vllm_port():
    env = {}
    assert nccl.pin_async_rendezvous_port(51216, env) == 51216 and env["VLLM_PORT"] == "51216"
    env = {"VLLM_PORT": "52000"}
    assert nccl.pin_async_rendezvous_port(51216, env) == 52000


@pytest.mark.docker
def test_vllm_0_31_gives_the_sync_address_and_port_once_pinned(docker):
    ensure_vllm_cpu_image()
    env = {"VLLM_HOST_IP": "10.9.8.7"}
    nccl.pin_async_rendezvous_port(51216, env)
    probe = ("from vllm.utils.network_utils import get_ip, get_open_port; import socket; "
             "print(get_ip(), get_open_port()); s = socket.socket(); s.bind(('', 51216)); s.listen(); "
             "print(get_open_port())")
    out = subprocess.run(["docker", "run", "--rm", "--network", "none", *[f"-e{k}={v}" for k, v in env.items()],
                          "--entrypoint", "python3", VLLM_CPU_IMAGE, "-c", probe],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, busy = out.stdout.strip().splitlines()[-2:]
    assert first == "10.9.8.7 51216"  # VLLM_HOST_IP as prepare_rendezvous set it, VLLM_GROUP_PORT
    assert busy == "51217"  # port taken (another run): the next free one, as vLLM's workers are told
