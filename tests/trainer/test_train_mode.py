"""The one TRAIN_MODE rule (contract/train_mode.py), used by the host (tools/derive.py, gpu_doctor) and the
trainer (contract.config): same inputs, same mode, wherever it is resolved."""

from __future__ import annotations

import pytest

from contract.train_mode import TrainModeError, resolve_train_mode


@pytest.mark.parametrize("requested,gpus,vllm_service,mode", [
    ("auto", 0, False, "cpu"),
    ("auto", 0, True, "cpu"),        # a vllm name that resolves is no GPU
    ("auto", 1, False, "colocate"),
    ("auto", 1, True, "gpu"),        # inside the trainer container of a 2-GPU host: its own GPU + the service
    ("auto", 2, False, "gpu"),
    ("auto", 8, False, "gpu"),
    ("cpu", 8, False, "cpu"),
    ("server", 2, False, "gpu"),
    ("gpu", 1, True, "gpu"),
    ("colocate", 1, False, "colocate"),
    (None, 0, False, "cpu"),
])
def test_one_rule_for_every_caller(requested, gpus, vllm_service, mode):
    assert resolve_train_mode(requested, gpus, vllm_service=vllm_service)[0] == mode


@pytest.mark.parametrize("requested,gpus,message", [
    ("gpu", 1, "TRAIN_MODE=gpu needs 2 NVIDIA GPU(s), found 1"),
    ("colocate", 0, "TRAIN_MODE=colocate needs 1 NVIDIA GPU(s), found 0"),
    ("fast", 2, "TRAIN_MODE: unknown value 'fast'; choose from auto, cpu, gpu, colocate"),
])
def test_a_mode_that_cannot_run_here_says_what_was_found(requested, gpus, message):
    with pytest.raises(TrainModeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_train_mode(requested, gpus)


def test_the_reason_names_how_the_gpus_were_counted():
    mode, why = resolve_train_mode("auto", 0, found="Docker hands out no GPU (--gpus all: could not select device driver)")
    assert mode == "cpu" and "could not select device driver" in why
