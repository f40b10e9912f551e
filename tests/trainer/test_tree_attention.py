"""trainer.async_grpo.tree_attention: TRL's async trainer's tree-packed forward, on CPU, equals the plain per-sample forward.

Differential test: a tiny random Qwen3 (fp32, grouped-query attention), samples that share a prompt and, some of
them, a first turn, packed by TRL's own `TreeRow` into one tree row; the per-token log-probs of the packed forward
through the portable tree attention (as AsyncGRPOTrainer.compute_loss feeds the model) equal those of each sample
run alone through transformers' own SDPA attention, within 1e-5. Also: the GPU call path (TRL's varlen kernel call,
with a torch stand-in for the kernel) agrees with the SDPA mask; install() keeps TRL's trainer from registering (and
fetching) its FA3 kernel; the TRL sources this follows are pinned.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

TOLERANCE = 1e-5  # fp32; the same sums in another order


def tiny_qwen3(sliding_window: int | None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                         use_sliding_window=bool(sliding_window), sliding_window=sliding_window,
                         max_window_layers=0, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


def samples() -> list[dict]:
    """Two groups: group 0 shares a 12-token prompt, two of its rollouts also a first turn; group 1 shares only a
    3-token system prefix with group 0."""
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(5, 97, (n,), generator=g).tolist()

    system, prompt0, prompt1, turn = ids(3), ids(9), ids(6), ids(5)
    rows = [
        (0, system + prompt0, turn + ids(7)),
        (0, system + prompt0, turn + ids(4)),
        (0, system + prompt0, ids(8)),
        (1, system + prompt1, ids(6)),
        (1, system + prompt1, ids(10)),
    ]
    out = []
    for group, prompt, completion in rows:
        input_ids = torch.tensor(prompt + completion)
        mask = torch.tensor([0] * len(prompt) + [1] * len(completion))
        out.append({"input_ids": input_ids, "completion_mask": mask, "old_log_probs": torch.zeros(len(input_ids)),
                    "advantage": 1.0, "group_id": group})
    return out


def per_sample_log_probs(model, batch: list[dict]) -> torch.Tensor:
    """Each sample alone, causal SDPA: log p(token | its prefix) of every completion token, in pack()'s order."""
    out = []
    with torch.no_grad():
        for sample in batch:
            ids = sample["input_ids"]
            logits = model(input_ids=ids[None]).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out += [lp[p - 1, ids[p]] for p in range(1, len(ids)) if sample["completion_mask"][p]]
    return torch.stack(out)


def packed_log_probs(model, packed: dict) -> torch.Tensor:
    """As AsyncGRPOTrainer.compute_loss calls the model (less its fused LM head: plain logits + log_softmax)."""
    with torch.no_grad():
        logits = model(
            input_ids=packed["input_ids"][None], position_ids=packed["position_ids"][None],
            tree_kv_index=packed["tree_kv_index"], tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
            tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
            tree_max_seqlen_q=int(packed["tree_max_seqlens"][0]), tree_max_seqlen_k=int(packed["tree_max_seqlens"][1]),
        ).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    index = packed["token_index"]
    return lp[index, packed["shift_labels"][index]]


@pytest.mark.parametrize("sliding_window", [None, 6], ids=["full", "sliding-6"])
def test_packed_tree_forward_equals_the_per_sample_forward(sliding_window, monkeypatch):
    from trl.experimental.async_grpo import async_grpo_trainer
    from trl.experimental.async_grpo.packing import TreeRow

    from trainer.async_grpo import tree_attention

    monkeypatch.setattr(async_grpo_trainer, "register_tree_attention", async_grpo_trainer.register_tree_attention)
    assert tree_attention.install(backend=None) == "sdpa"  # no CUDA here
    reference = tiny_qwen3(sliding_window)
    reference.set_attn_implementation("sdpa")
    tree = tiny_qwen3(sliding_window)
    tree.load_state_dict(reference.state_dict())
    tree.set_attn_implementation(tree_attention.TREE_ATTENTION)

    batch = samples()
    row = TreeRow()
    for sample in batch:
        assert row.fits(sample, budget=1000)
        row.add(sample)
    packed = row.pack()
    raw = sum(len(s["input_ids"]) for s in batch)
    assert len(packed["input_ids"]) == len(row.tokens) < raw - 20  # shared tokens forwarded once
    assert len(packed["tree_cu_seqlens_q"]) - 1 > len(batch)  # a real tree: inner segments as well as leaves

    expected = per_sample_log_probs(reference, batch)
    got = packed_log_probs(tree, packed)
    assert got.shape == expected.shape == (sum(int(s["completion_mask"].sum()) for s in batch),)
    diff = (got - expected).abs().max().item()
    assert diff <= TOLERANCE, f"packed vs per-sample log-probs differ by {diff:.2e}"
    # The differential test can fail: a plain causal mask over the packed row (siblings seeing each other) does.
    wrong = torch.ones(len(packed["input_ids"]), len(packed["input_ids"]), dtype=torch.bool).tril()
    original = tree_attention.tree_mask
    tree_attention.tree_mask = lambda *a, **k: wrong
    try:
        tree_attention._mask_cache.entry = None
        assert (packed_log_probs(tree, packed) - expected).abs().max().item() > 1e-3
    finally:
        tree_attention.tree_mask = original
        tree_attention._mask_cache.entry = None


def test_tree_mask_is_the_bottom_right_causal_rule_of_a_path():
    """Root segment [0, 1] with two children [2] and [3, 4]: each child sees the root and its own prefix only."""
    from trainer.async_grpo.tree_attention import tree_mask

    kv_index = torch.tensor([0, 1, 0, 1, 2, 0, 1, 3, 4])
    mask = tree_mask(kv_index, torch.tensor([0, 2, 3, 5]), torch.tensor([0, 2, 5, 9]), 5)
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ]
    windowed = tree_mask(kv_index, torch.tensor([0, 2, 3, 5]), torch.tensor([0, 2, 5, 9]), 5, sliding_window=2)
    assert windowed[4].int().tolist() == [0, 0, 0, 1, 1]  # depth 3 sees depths 2..3 only


def varlen_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                    causal=False, window_size=(-1, -1), softcap=0.0):
    """Test double for FlashAttention's flash_attn_varlen_func (no kernel on CPU), written from its contract, per
    segment over the gathered K/V: causal aligned bottom-right, window_size=(left, right), logit softcap."""
    out = []
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True):
        qs, ks, vs = q[q0:q1].transpose(0, 1), k[k0:k1].transpose(0, 1), v[k0:k1].transpose(0, 1)
        groups = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
        i = torch.arange(q1 - q0)[:, None] + (k1 - k0) - (q1 - q0)  # bottom-right: the last query sees every key
        j = torch.arange(k1 - k0)[None, :]
        allowed = (j <= i) if causal else torch.ones_like(j <= i)
        if window_size[0] >= 0:
            allowed = allowed & (i - j <= window_size[0])
        scores = qs @ ks.transpose(-1, -2) * softmax_scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        out.append((torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ vs).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("sliding_window,softcap", [(None, None), (3, None), (None, 5.0)],
                         ids=["full", "sliding-3", "softcap-5"])
def test_the_varlen_kernel_call_and_the_sdpa_mask_agree__kernel_stand_in(sliding_window, softcap):
    """The fa2/fa3 call path (TRL's gather + varlen call, run here with a torch stand-in for the kernel) and the
    SDPA path give the same attention output on a packed tree row."""
    from types import SimpleNamespace

    from trl.experimental.async_grpo.packing import TreeRow

    from trainer.async_grpo.tree_attention import _varlen_tree_attention, sdpa_tree_attention

    row = TreeRow()
    for sample in samples():
        row.add(sample)
    packed = row.pack()
    n = len(packed["input_ids"])
    g = torch.Generator().manual_seed(2)
    query, key, value = (torch.randn(1, heads, n, 16, generator=g) for heads in (4, 2, 2))
    module = torch.nn.Module()
    module.config, module.proj = SimpleNamespace(), torch.nn.Linear(2, 2)  # get_target_dtype: fp32 stays fp32
    tree = {k: packed[k] for k in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    via_kernel = _varlen_tree_attention(varlen_stand_in, module, query, key, value, **tree, tree_max_seqlen_q=max_q,
                                        tree_max_seqlen_k=max_k, scaling=0.25, sliding_window=sliding_window,
                                        softcap=softcap)
    via_sdpa = sdpa_tree_attention(query, key, value, **tree, scaling=0.25, sliding_window=sliding_window,
                                   softcap=softcap)
    assert via_kernel.shape == via_sdpa.shape == (1, n, 4, 16)
    assert (via_kernel - via_sdpa).abs().max().item() <= TOLERANCE


def test_install_keeps_trls_trainer_off_the_hub_kernel(monkeypatch):
    """AsyncGRPOTrainer.__init__ calls `register_tree_attention()`; after install() that registers ours, and TRL's
    kernel loader (which would fetch from the Hub) is never reached by a forward."""
    from transformers import AttentionInterface
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    from trainer.async_grpo import tree_attention

    def no_hub():
        raise AssertionError("trl's _flash_attn (Hub kernel fetch) was called")

    monkeypatch.setattr(packing, "_flash_attn", no_hub)
    monkeypatch.setattr(async_grpo_trainer, "register_tree_attention", packing.register_tree_attention)
    tree_attention.install()
    async_grpo_trainer.register_tree_attention()  # what the trainer's __init__ does
    assert AttentionInterface._global_mapping[packing.TREE_ATTENTION] is tree_attention.tree_attention
    with pytest.raises(ValueError, match="tree attention backend 'fa4': use fa3, fa2 or sdpa"):
        tree_attention.install("fa4")
    with pytest.raises(RuntimeError, match=r"^tree attention backend 'fa2' does not load here \(ModuleNotFoundError"):
        tree_attention.install("fa2")  # no flash_attn on this host


def test_choose_backend_without_cuda_says_why():
    from trainer.async_grpo.tree_attention import choose_backend

    assert choose_backend() == ("sdpa", "no CUDA device")


# ---------------------------------------------------------------------------------------------- the pin
# The TRL sources tree_attention.py follows are pinned in trainer/core/trl_privates.py (tests/trainer/test_trl_privates.py).


def test_trls_trainer_registers_through_the_name_install_replaces():
    from trl.experimental.async_grpo.async_grpo_trainer import AsyncGRPOTrainer

    source = inspect.getsource(AsyncGRPOTrainer.__init__)
    assert re.search(r"^\s+register_tree_attention\(\)$", source, re.M), "AsyncGRPOTrainer registers differently"
    assert "attn_implementation=TREE_ATTENTION" in source


# ---------------------------------------------------------------------------------------------- FA3 (#42 item 12)
def load_bake_fa3():
    import importlib.util

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("bake_fa3", ROOT / "services" / "trainer" / "bake_fa3.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("builds, rc", [(["torch213-cxx11-cu130-x86_64-linux", "torch212-cxx11-cu128-x86_64-linux"], 0),
                                        (["torch212-cxx11-cu128-x86_64-linux"], 1), ([], 1)])
def test_bake_fa3_fails_the_image_build_without_a_build_for_its_torch_and_cuda(builds, rc, tmp_path, monkeypatch,
                                                                              capsys):
    """BAKE_FA3=1: the image build fails, in one line naming the variant and the fix, when the Hub has no FA3 build
    for the image's torch/CUDA (what `kernels` downloaded is in the cache; a stand-in `kernels` fetches nothing)."""
    import sys
    from types import SimpleNamespace

    bake = load_bake_fa3()
    snapshot = tmp_path / "kernels--kernels-community--flash-attn3" / "snapshots" / "abc" / "build"
    for build in builds:
        (snapshot / build).mkdir(parents=True)
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path))
    monkeypatch.setattr(bake, "build_variant", lambda: "torch213-cxx11-cu130-x86_64-linux")

    def get_kernel(repo, version):  # a build host without a driver: downloaded, not loadable
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setitem(sys.modules, "kernels", SimpleNamespace(get_kernel=get_kernel))
    assert bake.main() == rc
    err = capsys.readouterr().err.splitlines()
    if rc:
        assert len(err) == 2 and "has no build for this image's torch/CUDA (torch213-cxx11-cu130-x86_64-linux" in err[1]
        assert "build with BAKE_FA3=0" in err[1]


def test_bake_fa3_names_the_variant_kernels_loads_and_refuses_a_torch_without_cuda(monkeypatch, capsys):
    bake = load_bake_fa3()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch, "__version__", "2.13.0+cu130")
    assert re.fullmatch(r"torch213-cxx(11|98)-cu130-\w+-linux", bake.build_variant())
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("KERNELS_CACHE", "/nonexistent")
    assert bake.main() == 1 and "has no CUDA" in capsys.readouterr().err


def test_a_hopper_gpu_whose_fa3_does_not_load_falls_back_to_sdpa_in_one_line(tmp_path, monkeypatch, capsys):
    import importlib.util

    from trainer.async_grpo import tree_attention

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(tree_attention, "fa3_cached", lambda: str(tmp_path))

    def no_build():
        raise FileNotFoundError("no build variant torch213-cxx11-cu130-x86_64-linux")

    monkeypatch.setattr(tree_attention, "_fa3", no_build)
    # `kernels` installed, `flash_attn` not: only while choosing (transformers' own imports read find_spec too)
    importlib.util.find_spec = lambda name, *a: (object() if name == "kernels" else None if name == "flash_attn"
                                                 else real_find_spec(name, *a))
    try:
        backend, why = tree_attention.choose_backend()
    finally:
        importlib.util.find_spec = real_find_spec
    assert backend == "sdpa" and "did not load: FileNotFoundError: no build variant" in why
    monkeypatch.setattr(tree_attention, "choose_backend", lambda: (backend, why))
    assert tree_attention.install() == "sdpa"
    said = capsys.readouterr()
    assert sum("tree_fa3 runs on sdpa: " in line for line in (said.out + said.err).splitlines()) == 1


def test_the_sync_trainer_says_which_attention_runs():
    from trainer.modeling.model import attention_line

    model = tiny_qwen3(None)
    assert attention_line(model) == f"attention: {model.config._attn_implementation} (transformers' " \
                                    "attn_implementation for Qwen3ForCausalLM)"
    assert model.config._attn_implementation in ("sdpa", "eager")
