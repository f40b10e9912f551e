"""fp32 master weights on the GPU path (issue #29 item 1): a step at lr 1e-5 moves them, bf16 weights stay frozen;
every weight push goes out in the dtype vLLM serves. Runs on CPU (bf16 autocast works there in torch 2.13)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.gpu_path import master_weights
from tests.helpers import ROOT, free_port


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory) -> Path:
    return master_weights.make_model_dir(tmp_path_factory.mktemp("master-weights") / "tiny-qwen3-bf16")


FSDP2_DTYPES = ("bf16", "fp32")


@pytest.fixture(scope="module")
def fsdp2_runs(bf16_checkpoint, tmp_path_factory) -> dict[str, dict]:
    """master_weights.py's FSDP2 runs (bf16, fp32) and fsdp2_lora.py's, in one 2-process launch (gloo): each makes
    its model and Accelerator afresh; the processes' start-up, most of the cost, is paid once."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                          str(free_port()), str(ROOT / "tests" / "gpu_path" / "master_weights.py"),
                          str(bf16_checkpoint), ",".join(FSDP2_DTYPES), str(tmp_path_factory.mktemp("fsdp2-lora"))],
                         cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TRL_EXPERIMENTAL_SILENCE": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(FSDP2_DTYPES) + 1, out.stdout[-2000:]
    return {**dict(zip(FSDP2_DTYPES, lines)), "lora": lines[-1]}


def test_one_adamw_step_at_lr_1e_5_moves_fp32_master_weights_but_not_bf16_weights(bf16_checkpoint):
    """The model as trainer.train's load_model_and_tokenizer builds it for TRAIN_MODE=gpu (a bf16 checkpoint on
    disk), the optimizer HF's Trainer builds from the project's GRPOConfig, one step under bf16 autocast."""
    fp32 = master_weights.single_process(bf16_checkpoint, "fp32")
    bf16 = master_weights.single_process(bf16_checkpoint, "bf16")
    print(f"\nfraction changed by one step at lr {fp32['lr']}: fp32 master weights {fp32['changed']}; "
          f"bf16 weights {bf16['changed']}")
    assert fp32["lr"] == 1e-5 and fp32["optimizer"] == "AdamW"
    assert fp32["param_dtypes"] == ["torch.float32"] and bf16["param_dtypes"] == ["torch.bfloat16"]
    assert fp32["changed"]["norm"] == 1.0 and fp32["changed"]["matrix"] > 0.9
    assert bf16["changed"]["norm"] == 0.0 and bf16["changed"]["matrix"] < 0.5


def test_fsdp2_through_accelerates_own_prepare_upcasts_trains_and_pushes_bf16_on_cpu_with_fsdp_forced(fsdp2_runs):
    """TRAINER_SHARDING=fsdp on 2 CPU processes (gloo): accelerate's `prepare(model, optimizer)` with its FSDP2 plugin
    and bf16 mixed precision. On CPU accelerate does not pick FSDP by itself (it keeps FSDP for GPU-type backends),
    so the test sets the distributed type before `prepare`; the preparation is accelerate's own. A bf16-loaded model
    comes out of it in fp32 (accelerate's upcast: why fsdp trained before the fix), a step moves every norm weight,
    and TRL's sync (client recorded: test double for the NCCL broadcast) sends full-size tensors in bf16."""
    results = {dtype: fsdp2_runs[dtype] for dtype in FSDP2_DTYPES}
    for result in results.values():
        assert result["is_fsdp2_at_prepare"] and result["fsdp_module"] and result["sharded"] > 0
        assert result["prepared"] == ["torch.float32"]
        assert result["changed"]["norm"] == 1.0 and result["changed"]["matrix"] > 0.9
        assert result["pushed"] == "bfloat16"
        assert {name: shape for name, _, shape in result["sent"]} == result["full"]
        assert {dtype for _, dtype, _ in result["sent"]} == {"bfloat16"}
        assert [list(m) for m in result["metadata"]] == [list(s) for s in result["sent"]]
    print(f"\nFSDP2 (accelerate chose {results['bf16']['accelerate_chose']} on CPU; forced FSDP): loaded "
          f"{results['bf16']['loaded']} -> prepared {results['bf16']['prepared']}; changed "
          f"{results['bf16']['changed']}; pushed {results['bf16']['pushed']}")
    assert results["bf16"]["loaded"] == ["torch.bfloat16"] and results["fp32"]["loaded"] == ["torch.float32"]


def _tiny_fp32_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                        tie_word_embeddings=True))


def _generation(model, mode: str, **extra):
    """TRL 1.16's own VLLMGeneration without a vLLM behind it: what sync_weights reads, set by hand."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration

    gen = object.__new__(VLLMGeneration)
    gen.__dict__.update(model=model, mode=mode, enable_sleep_mode=False, _weight_metadata=None,
                        _dist=SimpleNamespace(is_fsdp=False, fsdp_version=None, gather_params=_no_gather),
                        accelerator=SimpleNamespace(is_main_process=True, device=torch.device("cpu")), **extra)
    return gen


class _no_gather:  # noqa: N801 - DistributedBackend.gather_params without DeepSpeed: a no-op context
    def __init__(self, params):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_server_mode_push_sends_fp32_master_weights_as_bf16_names_unchanged_recording_client_test_double():
    import torch

    from trainer.gpu.trl_hooks import push_in_served_dtype

    model = _tiny_fp32_model()
    gen = _generation(model, "server", vllm_client=master_weights.RecordingClient())
    assert push_in_served_dtype(SimpleNamespace(vllm_generation=gen), "bfloat16") == "bfloat16"
    gen.sync_weights()
    params = dict(model.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.float32}  # the master weights stay fp32
    assert [name for name, _, _ in gen.vllm_client.sent] == list(params)
    assert {dtype for _, dtype, _ in gen.vllm_client.sent} == {"bfloat16"}
    assert gen._weight_metadata == [(n, "bfloat16", list(p.shape)) for n, p in params.items()]  # what vLLM allocates
    # the wire: 2 bytes a parameter
    assert sum(p.numel() * 2 for p in params.values()) == sum(
        torch.Size(shape).numel() * torch.tensor([], dtype=torch.bfloat16).element_size()
        for _, _, shape in gen.vllm_client.sent)
    # wrapping twice does not cast twice or stack wrappers
    push_in_served_dtype(SimpleNamespace(vllm_generation=gen), "bfloat16")
    assert gen._iter_named_params.__wrapped__.__self__ is gen


def test_colocate_push_casts_to_the_colocated_engines_dtype_fake_llm_test_double():
    """Colocate: TRL's `LLM(model=...)` passes no dtype, so vLLM picks it ("auto": an fp32 config is served in bf16);
    the push reads it from the engine and casts `load_weights`' tensors to it."""
    import torch

    from trainer.gpu.trl_hooks import push_in_served_dtype

    loaded: list = []

    class Model:
        def load_weights(self, weights):
            loaded.extend((name, t.dtype, t.clone()) for name, t in weights)

    runner = SimpleNamespace(model=Model())
    llm = SimpleNamespace(llm_engine=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                                                     model_executor=SimpleNamespace(
                                                         driver_worker=SimpleNamespace(model_runner=runner))),
                          reset_prefix_cache=lambda: None)
    model = _tiny_fp32_model()
    gen = _generation(model, "colocate", llm=llm)
    assert push_in_served_dtype(SimpleNamespace(vllm_generation=gen), None) == "bfloat16"
    gen.sync_weights()
    params = dict(model.named_parameters())
    assert [name for name, _, _ in loaded] == list(params)
    assert {dtype for _, dtype, _ in loaded} == {torch.bfloat16}
    assert all(torch.equal(t, params[name].detach().to(torch.bfloat16)) for name, _, t in loaded)


def test_served_dtype_comes_from_server_info_and_a_missing_one_leaves_the_push_alone():
    from trainer.gpu.server import dtype_name
    from trainer.gpu.trl_hooks import push_in_served_dtype

    assert dtype_name("torch.bfloat16") == "bfloat16"  # vLLM's /server_info: str(torch.dtype)
    assert dtype_name("bfloat16") == "bfloat16" and dtype_name(None) is None
    gen = _generation(_tiny_fp32_model(), "server", vllm_client=master_weights.RecordingClient())
    assert push_in_served_dtype(SimpleNamespace(vllm_generation=gen), None) is None
    assert push_in_served_dtype(SimpleNamespace(vllm_generation=None), "bfloat16") is None  # CPU profile: no vLLM
    with pytest.raises(ValueError, match="torch does not know"):
        push_in_served_dtype(SimpleNamespace(vllm_generation=gen), "bf17")


def test_lora_under_fsdp2_trl_merges_the_sharded_adapter_into_the_push_and_gathers_it_for_the_adapter_sync(
        fsdp2_runs):
    """#32, LORA_R with TRAINER_SHARDING=fsdp (2 CPU processes, FSDP2 forced as above; TRL 1.16's merge path carries
    a `TODO: does this work with FSDP?`). ROLLOUTS=sync: TRL's sync_weights merges the sharded adapter and pushes
    exactly base + alpha/r * B @ A for every targeted layer under the served model's names (no lora_A/B), then
    unmerges (the trained weights back to float rounding). ROLLOUTS=async: TRL's save_lora_adapter, on every rank,
    writes the gathered adapter, equal to the trained one."""
    r = fsdp2_runs["lora"]
    assert r["fsdp_module"] and r["sharded"] > 0
    assert r["lora_b_moved"] > 0 and r["delta_max"] > 1e-3  # the step moved the adapter: a merge that changes weights
    assert r["sent"] == r["base_names"] and r["targets"] == 14  # every linear layer of the 2 decoder layers
    assert r["merged_max_abs_error"] < 1e-6, r["merged_max_abs_error"]
    assert r["after_sync_max_abs_change"] < 1e-6, r["after_sync_max_abs_change"]  # unmerged: the merge did not stay
    assert r["adapter_config"] and r["written"] == r["lora_tensors"] == 28
    assert r["written_max_abs_error"] == 0.0
    print(f"\nLoRA under FSDP2: merged push off by {r['merged_max_abs_error']:.1e} (largest delta "
          f"{r['delta_max']:.1e}), weights after unmerge off by {r['after_sync_max_abs_change']:.1e}; adapter sync "
          f"wrote {r['written']} tensors, off by {r['written_max_abs_error']}")
