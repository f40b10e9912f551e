"""contract.memory: the trainer's GPU memory for a model and layout, and the preflight's verdict on it."""

from __future__ import annotations

import pytest

from contract import memory
from contract.config import GpuMode, RunConfig
from trainer.core import grpo_args

GIB = memory.GIB
# Qwen3-0.6B's config.json (the shape numbers; the hub model has ~0.596B parameters with its tied embeddings)
QWEN3_06B = {"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
             "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
             "tie_word_embeddings": True, "attention_bias": False}


def test_qwen3_06b_parameter_count_is_within_1_percent_of_0_596b_and_exactly_transformers_own():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    n = memory.ModelShape.from_config(QWEN3_06B).params()
    assert abs(n - 0.596e9) / 0.596e9 < 0.01
    with torch.device("meta"):  # the real module tree, no memory: tied weights counted once by parameters()
        model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in QWEN3_06B.items() if k != "model_type"}))
    assert n == sum(p.numel() for p in model.parameters())


def test_untied_gqa_and_a_multimodal_text_config_are_read():
    untied = memory.ModelShape.from_config({**QWEN3_06B, "tie_word_embeddings": False})
    assert untied.params() - memory.ModelShape.from_config(QWEN3_06B).params() == 151936 * 1024
    nested = memory.ModelShape.from_config({"text_config": QWEN3_06B, "tie_word_embeddings": True})
    assert nested.params() == memory.ModelShape.from_config(QWEN3_06B).params()
    with pytest.raises(memory.ShapeError, match="hidden_size"):
        memory.ModelShape.from_config({"vocab_size": 10})


def test_the_breakdown_is_18_bytes_per_parameter_plus_activations_and_push_buffers_and_names_every_part():
    shape = memory.ModelShape.from_config(QWEN3_06B)
    est = memory.estimate(shape, batch=8, prompt_tokens=512, completion_tokens=256)
    p = shape.params()
    assert (est.weights, est.gradients, est.optimizer, est.autocast) == (4 * p, 4 * p, 8 * p, 2 * p)
    assert est.push == 2 * GIB + 2 * shape.largest_tensor()  # vLLM's two packed buffers + the cast copy
    assert memory.estimate(shape, packed_push=False).push == 2 * shape.largest_tensor()  # colocate: no buffers
    t, c = 8 * (512 + 256), 8 * 256
    assert est.activations == t * (2 * 1024 * 28 + 34 * 1024) + c * 4 * 151936  # the docstring's formula
    off = memory.estimate(shape, batch=8, prompt_tokens=512, completion_tokens=256, gradient_checkpointing=False)
    assert off.activations > est.activations
    line = est.breakdown()
    print(f"\nQwen3-0.6B, defaults: {line}")
    for part in ("weights", "gradients", "AdamW", "autocast cache", "activations", "gradient checkpointing on",
                 "push", "per trainer GPU"):
        assert part in line
    assert 13 * GIB < est.total < 17 * GIB
    sharded = memory.estimate(shape, processes=4, sharding="fsdp")
    assert sharded.weights == pytest.approx(est.weights / 4, abs=1) and sharded.shards == 4
    assert memory.estimate(shape, processes=4, sharding="ddp").weights == est.weights  # ddp: a full copy each
    with pytest.raises(memory.ShapeError, match="dora"):
        memory.estimate(shape, method="dora")


def test_verdicts_fit_on_a_24_gib_gpu_and_say_what_to_change_on_smaller_ones():
    shape = memory.ModelShape.from_config(QWEN3_06B)
    est = memory.estimate(shape)
    assert memory.verdict(est, 24 * GIB) is None
    assert memory.verdict(est, 80 * GIB, colocate=True, vllm_share=0.3) is None
    small = memory.verdict(est, 12 * GIB)
    assert small and "\n" not in small
    assert "2 trainer GPUs with TRAINER_SHARDING=fsdp" in small and "a smaller model (MODEL_NAME)" in small
    colocated = memory.verdict(est, 16 * GIB, colocate=True, vllm_share=0.3)
    assert "VLLM_GPU_MEMORY_UTILIZATION=0.3" in colocated and "lower VLLM_GPU_MEMORY_UTILIZATION" in colocated
    assert "TRAINER_SHARDING" not in colocated  # colocate is one GPU
    long = memory.estimate(shape, batch=32, completion_tokens=4096)
    assert "MAX_COMPLETION_LENGTH" in memory.verdict(long, 24 * GIB)
    # the fix it names is enough: two fsdp GPUs of 12 GiB hold what one could not
    assert memory.verdict(memory.estimate(shape, processes=2, sharding="fsdp"), 12 * GIB) is None


def test_gradient_checkpointing_assumed_is_what_the_project_hands_trl():
    cfg = RunConfig.load([], train_mode="cpu")
    assert grpo_args.grpo_config(cfg).gradient_checkpointing is memory.GRADIENT_CHECKPOINTING


def test_preflight_prints_the_breakdown_and_fails_with_one_line_when_it_cannot_fit(capsys):
    from trainer.run import preflight

    cfg = RunConfig.load([], train_mode="colocate", max_completion_length=256)
    errors, line = preflight.check_memory(cfg, 1, 300, gpu_bytes=80 * GIB, config=QWEN3_06B)
    assert errors == [] and line.startswith("trainer memory: 0.60B params") and "trainer GPU 80.0 GiB" in line
    errors, line = preflight.check_memory(cfg, 1, 300, gpu_bytes=12 * GIB, config=QWEN3_06B)
    assert len(errors) == 1 and "lower VLLM_GPU_MEMORY_UTILIZATION" in errors[0] and line
    cfg = RunConfig.load([], train_mode="gpu", trainer_sharding="fsdp")
    assert preflight.check_memory(cfg, 2, 300, gpu_bytes=12 * GIB, config=QWEN3_06B)[0] == []
    assert preflight.check_memory(cfg, 1, 300, gpu_bytes=12 * GIB, config=QWEN3_06B)[0]
    # LORA_R: the preflight sizes LoRA and stops no run full fine-tuning could not do on 12 GiB colocated
    lora = RunConfig.load([], train_mode="colocate", max_completion_length=256, lora_r=16)
    errors, line = preflight.check_memory(lora, 1, 300, gpu_bytes=12 * GIB, config=QWEN3_06B)
    assert errors == [] and "(lora r=16, 10.1M trainable)" in line
    assert "by method: full 12.8 GiB does not fit; LoRA r=16 5.2 GiB fits; QLoRA r=16 3.5 GiB fits" in line
    rehearsal = RunConfig.load([], train_mode="gpu", weight_transfer="reload")  # trainer on CPU: nothing to size
    assert preflight.check_memory(rehearsal, 1, 300, gpu_bytes=8 * GIB, config=QWEN3_06B) == ([], "")


def test_lora_adapter_count_equals_peft_and_its_memory_is_the_frozen_base_plus_adapter_states():
    """The adapters' parameter count is peft's own for `all-linear` on the real module tree (meta device: no
    memory); LoRA keeps the fp32 base and 16 B per adapter parameter, QLoRA an NF4 base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    small = {**QWEN3_06B, "num_hidden_layers": 2}  # the count is per layer: two layers say the same as 28
    shape = memory.ModelShape.from_config(small)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in small.items() if k != "model_type"}))
    peft_model = get_peft_model(model, LoraConfig(r=16, target_modules="all-linear"))
    assert shape.lora_params(16) == sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    linear = sum(m.weight.numel() for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lora_" not in n and not n.endswith("lm_head"))
    assert shape.linear_params() == linear

    full, lora, qlora = (memory.estimate(shape, method=m, lora_r=16) for m in memory.METHODS)
    adapters = shape.lora_params(16)
    assert lora.weights == 4 * shape.params() + 4 * adapters
    assert (lora.gradients, lora.optimizer) == (4 * adapters, 8 * adapters)
    assert qlora.weights < lora.weights / 2 and qlora.optimizer == lora.optimizer
    assert full.activations == lora.activations == qlora.activations  # backward still runs through every layer
    assert full.total > lora.total > qlora.total
    assert "lora r=16" in lora.breakdown() and "trainable" in lora.breakdown()


def test_what_fits_names_the_cheaper_method_and_the_readme_table_is_the_modules():
    from pathlib import Path

    config = memory.qwen3_config("Qwen3-8B")
    _, problem = memory.check(config, 80 * GIB, mode=GpuMode(), processes=1, sharding="ddp", batch=8, prompt_tokens=512,
                              completion_tokens=256, vllm_share=0.9)
    assert problem and "LORA_R=16" in problem  # full fine-tuning of 8B does not fit 80 GB: the line names LoRA
    est, problem = memory.check(config, 80 * GIB, mode=GpuMode(), processes=1, sharding="ddp", batch=8,
                                prompt_tokens=512, completion_tokens=256, vllm_share=0.9, method=memory.LORA, lora_r=16)
    assert problem is None, est.breakdown()
    _, problem = memory.check(memory.qwen3_config("Qwen3-14B"), 48 * GIB, mode=GpuMode(), processes=1, sharding="ddp",
                              batch=8, prompt_tokens=512, completion_tokens=256, vllm_share=0.9, method=memory.LORA)
    assert problem and "QLORA=true" in problem
    line = memory.compare(config, 80 * GIB, mode=GpuMode(), processes=1, sharding="ddp", batch=8, prompt_tokens=512,
                          completion_tokens=256, vllm_share=0.9)
    assert "full" in line and "does not fit" in line and "LoRA r=16" in line and "QLoRA r=16" in line
    page = (Path(__file__).resolve().parents[2] / "docs/gpu-host.md").read_text()
    assert memory.fits_table() in page, "docs/gpu-host.md's 'What fits' table is stale: paste contract.memory.fits_table()"
