"""#42 item 5: `make nccl-check FULL=1` and the self-check's weight iterator push through the path training uses
(trainer.gpu.push_path): TRL's own iterator on fp32 master weights, LoRA merged by TRL, cast to the served dtype.
On the CPU with a tiny Qwen3, without vLLM: TRL's VLLMGeneration is built without an engine."""

from __future__ import annotations

import copy
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from contract.config import GpuMode, RunConfig  # noqa: E402
from trainer import gpu_selfcheck as selfcheck  # noqa: E402
from trainer.gpu import push_path  # noqa: E402


def tiny_model(seed: int = 0):
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(selfcheck.qwen3_config(tiny=True, vocab_size=256)).eval()


def with_lora(model, cfg: RunConfig):
    """TRL's wrapping (get_peft_model with the run's LoraConfig), B made nonzero so the merge moves weights."""
    import torch
    from peft import get_peft_model

    from trainer.modeling import lora

    model = get_peft_model(model, lora.peft_config(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    return model


def training_iterator(model, cfg: RunConfig, served_dtype: str, monkeypatch):
    """What build_sync_trainer leaves on the trainer it builds: its own hooks on TRL's VLLMGeneration (the trainer
    class stood in by one that only holds the model and TRL's generation object)."""
    from trl.generation.vllm_generation import VLLMGeneration

    from trainer.run import grpo_trainer

    class Trainer:
        epsilon_high = 0.2  # TRL's clip, read for the off-policy figures' weight cap (build_sync_trainer)

        def __init__(self, model, args, **kwargs):
            self.model, self.args = model, args
            self._off_policy_window = SimpleNamespace(cap=None)  # the stack's GRPOTrainer subclass holds one
            gen = object.__new__(VLLMGeneration)  # TRL's, untouched: only the stack's hooks go on it
            gen.model, gen.mode = model, "server"
            from accelerate import Accelerator
            from trl.distributed import DistributedBackend

            gen.accelerator = Accelerator(cpu=True)
            gen._dist = DistributedBackend(gen.accelerator)
            self.vllm_generation = gen

        def configure_rollouts(self, *a):
            pass

        def configure_traces(self, *a):
            pass

    monkeypatch.setattr(grpo_trainer, "make_trainer_class", lambda: Trainer)
    args = SimpleNamespace(vllm_group_port=51216, bf16=True)
    trainer = grpo_trainer.build_sync_trainer(cfg.resolved(GpuMode()), model, None, None, None, [], [], args, None, served_dtype,
                                              None)
    return trainer.vllm_generation._iter_named_params


def pushed(iterate) -> list[tuple[str, str, object]]:
    return [(name, str(t.dtype).removeprefix("torch."), t.detach().clone()) for name, t in iterate()]


def same(a, b) -> None:
    import torch

    assert [(n, d) for n, d, _ in a] == [(n, d) for n, d, _ in b]
    assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(a, b))


@pytest.mark.parametrize("lora_r", [0, 4])
def test_the_checks_iterators_yield_what_training_pushes(lora_r, monkeypatch):
    import torch

    cfg = RunConfig.load([], lora_r=lora_r)
    model = tiny_model()
    if lora_r:
        model = with_lora(model, cfg)
    training = pushed(training_iterator(model, cfg, "bfloat16", monkeypatch))
    same(pushed(selfcheck.trl_weight_iterator(model)), training)  # make gpu-selfcheck's weight_iterator
    same(pushed(push_path.generation(model, "bfloat16")._iter_named_params), training)  # make nccl-check FULL=1

    # and that is the merged model's weights, under the checkpoint's names, in bf16, tied embeddings once
    reference = copy.deepcopy(model).merge_and_unload() if lora_r else model
    expected = [(n, "bfloat16", p.detach().to(torch.bfloat16)) for n, p in reference.named_parameters()]
    same(training, expected)
    assert "lm_head.weight" not in [n for n, _, _ in training]
    if lora_r:  # TRL unmerged after the push: the trainer's base weights are untouched
        assert not any(getattr(m, "merged", False) for m in model.modules())


def test_nccl_check_loads_the_model_as_training_holds_it(tmp_path):
    import torch

    tiny_model().save_pretrained(tmp_path)
    from trainer.sync_check import training_model

    full = training_model(str(tmp_path), RunConfig.load([]), "cpu")
    assert next(full.parameters()).dtype == torch.float32 and not hasattr(full, "peft_config")  # fp32 masters
    lora = training_model(str(tmp_path), RunConfig.load([], lora_r=4), "cpu")
    assert hasattr(lora, "peft_config") and {p.dtype for p in lora.parameters()} == {torch.float32}
    assert any("lora_A" in n for n, p in lora.named_parameters() if p.requires_grad)


def test_the_async_checks_stream_and_manifest_are_trls_and_agree():
    model = tiny_model()
    manifest = push_path.async_manifest(model)
    stream = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in push_path.async_stream(model)]
    assert stream == list(zip(manifest["names"], manifest["dtype_names"], manifest["shapes"]))
    assert manifest["names"] == [n for n, _ in model.named_parameters()]


def test_the_perturbation_leaves_packed_quantized_bytes_alone():
    """QLoRA's 4-bit base is packed uint8: the weight-land check scales only floating tensors (a factor would scramble
    the bytes) and restores exactly what it scaled."""
    import torch

    from trainer.gpu import weight_check

    model = torch.nn.Module()
    model.packed = torch.nn.Parameter(torch.arange(8, dtype=torch.uint8), requires_grad=False)
    model.norm = torch.nn.Parameter(torch.ones(4))
    originals = weight_check.perturb_(model)
    assert set(originals) == {"norm"} and torch.equal(model.packed, torch.arange(8, dtype=torch.uint8))
    assert not torch.equal(model.norm, torch.ones(4))
    weight_check.restore_(model, originals)
    assert torch.equal(model.norm, torch.ones(4))
