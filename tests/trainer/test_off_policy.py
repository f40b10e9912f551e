"""OFF_POLICY_CORRECTION (contract/config/off_policy.py, trainer/core/off_policy.py, trainer/async_grpo/off_policy_loss.py).

The async test runs the real loss path: the stack's AsyncGRPOTrainer subclass's compute_loss (the hook) over TRL's
own compute_loss, on the CPU profile's tiny model with TRL's fused LM head and the stack's tree attention, on a batch
packed by TRL's own collator. Stale samples with negative advantages (the sampler gave their tokens a tenth, a half
or the same probability the trained policy gives them now) go through it; the gradient each token's log-prob gets,
in units of |advantage| per trained token, is the weight the loss gave it: at most the correction's cap with one,
the full ratio (10) without. The trainer is made without TRL's __init__ (which needs a vLLM server): compute_loss
reads only the attributes set here.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from contract.config import ConfigError, RunConfig
from contract.config.off_policy import OffPolicy
from trainer.core import off_policy as core

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # importing trl.experimental is on purpose here
STALE_RATIOS = (10.0, 2.0, 1.0)  # π_θ / π_sampler of every completion token of each sample


def tiny_async_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from trainer.async_grpo import tree_attention

    tree_attention.install(backend=None)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))  # as AsyncGRPOTrainer.__init__
    model.set_attn_implementation(tree_attention.TREE_ATTENTION)
    return model.train()


def stale_batch(model) -> tuple[dict, torch.Tensor]:
    """One micro-batch as TRL's collator packs it: three samples of one group, advantage -1 each, their sampler's
    log-probs set so that every trained token's ratio is its sample's STALE_RATIOS entry."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(5, vocab, (6,), generator=g).tolist()
    row = TreeRow()
    for _ in STALE_RATIOS:
        completion = torch.randint(5, vocab, (5,), generator=g).tolist()
        row.add({"input_ids": torch.tensor(prompt + completion), "completion_mask": torch.tensor([0] * 6 + [1] * 5),
                 "old_log_probs": torch.zeros(11), "advantage": -1.0, "group_id": 0, "metrics": {}})
    inputs = DataCollatorForRollout(pad_token_id=0, num_processes=1)([[row]])
    selected = inputs["token_index"] >= 0
    mask = inputs["attention_mask"].bool()
    tree = {key: inputs[key][inputs[key] >= 0] for key in ("tree_kv_index", "tree_cu_seqlens_q", "tree_cu_seqlens_k")}
    with torch.no_grad():
        out = model(input_ids=inputs["input_ids"][mask][None], position_ids=inputs["position_ids"][mask][None],
                    shift_labels=inputs["shift_labels"][mask][None], fused_lm_head=True, **tree,
                    tree_max_seqlen_q=int(inputs["tree_max_seqlens"][0][0]),
                    tree_max_seqlen_k=int(inputs["tree_max_seqlens"][0][1]))
    log_probs = out.log_probs.flatten()[inputs["token_index"][selected]]
    ratios = torch.tensor(STALE_RATIOS)[inputs["segment_id"][selected]]
    inputs["old_log_probs"][selected] = log_probs - ratios.log()
    return inputs, ratios


def async_trainer(model, correction: OffPolicy):
    from accelerate import Accelerator

    from trainer.async_grpo.async_trainer import make_async_trainer_class

    trainer = object.__new__(make_async_trainer_class())
    trainer.accelerator, trainer.model, trainer.off_policy = Accelerator(cpu=True), model, correction
    trainer.epsilon_low = trainer.epsilon_high = 0.2
    trainer.aux_loss_enabled, trainer.current_gradient_accumulation_steps = False, 1
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    for name in ("_step_forward_tokens", "_step_trained_tokens", "_step_seq_len_weighted", "_step_samples",
                 "_step_forward_s"):
        setattr(trainer, name, 0.0)
    return trainer


def token_weights(tiny_model_dir, correction: OffPolicy) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(each trained token's gradient weight in units of |advantage|, its ratio, the step's off_policy/* figures)."""
    torch.manual_seed(0)
    model = tiny_async_model(tiny_model_dir)
    inputs, ratios = stale_batch(model)
    trainer = async_trainer(model, correction)
    seen = []

    def model_call(**kwargs):  # the real model; its per-token log-probs kept to read their gradient
        out = model(**kwargs)
        out.log_probs.retain_grad()
        seen.append(out)
        return out

    loss = trainer.compute_loss(model_call, inputs)
    loss.backward()
    selected = inputs["token_index"] >= 0
    grad = seen[0].log_probs.grad.flatten()[inputs["token_index"][selected]]
    trained = float(inputs["global_n_tokens"][0])
    weights = grad.abs() * trained / inputs["advantages"][selected].abs()
    return weights, ratios, trainer._off_policy_window.drain()


@pytest.mark.parametrize("name", ["two_sided", "token_tis", "sequence_mask"])
def test_stale_negative_advantages_weigh_at_most_the_cap_through_the_async_loss(tiny_model_dir, name):
    correction = OffPolicy(name)
    cap = correction.weight_cap(is_async=True)
    weights, ratios, figures = token_weights(tiny_model_dir, correction)
    assert weights.max().item() <= cap + 1e-4, (name, weights.tolist())
    assert figures["off_policy/weight_cap"] == cap and figures["off_policy/weight_max"] <= cap + 1e-4
    assert figures["off_policy/ratio_max"] == pytest.approx(10.0, rel=1e-3)  # the ratio itself, before correction
    assert 0 < figures["off_policy/clipped_share"] < 1
    kl = sum(r - 1 - math.log(r) for r in ratios.tolist()) / len(ratios)
    assert figures["off_policy/kl_to_sampler"] == pytest.approx(kl, rel=1e-3)
    if name == "token_tis":  # truncated, not dropped: each token keeps min(ratio, cap)
        assert weights.tolist() == pytest.approx(ratios.clamp(max=cap).tolist(), rel=1e-3)
    if name == "sequence_mask":  # 10^5 and 2^5 leave [0, 3]: only the fresh sample trains, with weight 1
        assert weights.tolist() == pytest.approx([1.0 if r == 1 else 0.0 for r in ratios.tolist()], abs=1e-4)


def test_without_the_correction_a_stale_negative_token_pushes_with_its_whole_ratio(tiny_model_dir):
    weights, ratios, figures = token_weights(tiny_model_dir, OffPolicy("none"))
    assert weights.max().item() == pytest.approx(10.0, rel=1e-3)  # over every cap: the bound fails without it
    assert weights.max().item() > max(OffPolicy(n).weight_cap(is_async=True) for n in ("two_sided", "token_tis", "sequence_mask"))
    assert figures["off_policy/clipped_share"] == 0.0 and figures["off_policy/weight_max"] == pytest.approx(10, rel=1e-3)


def test_corrected_loss_keeps_trl_s_term_where_nothing_is_out_of_bounds():
    """two_sided equals TRL's PPO-clip for ratios within δ and for positive advantages (their gradient too)."""
    log_probs = torch.tensor([0.1, -0.3, 0.9, 2.0], requires_grad=True)
    old, adv, seg = torch.zeros(4), torch.tensor([-1.0, -1.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    loss, bounded, _ = core.corrected_loss(log_probs, old, adv, seg, OffPolicy("two_sided"))
    trl, _, _ = core.corrected_loss(log_probs, old, adv, seg, OffPolicy("none"))
    assert torch.allclose(loss, trl) and not bounded.any()
    (g1,) = torch.autograd.grad(loss.sum(), log_probs)
    (g2,) = torch.autograd.grad(trl.sum(), log_probs)
    assert torch.allclose(g1, g2)


def test_sequence_mask_drops_a_negative_sequence_past_the_kl_threshold():
    log_probs = torch.tensor([0.0, 0.0, 0.0, 0.0], requires_grad=True)
    old = torch.tensor([0.8, 0.8, 0.0, 0.0])  # sequence 0: the sampler liked its tokens more (KL 0.8 per token)
    adv, seg = torch.tensor([-1.0, -1.0, -1.0, -1.0]), torch.tensor([0, 0, 1, 1])
    _, bounded, weight = core.corrected_loss(log_probs, old, adv, seg, OffPolicy("sequence_mask", kl_threshold=0.5))
    assert bounded.tolist() == [True, True, False, False] and weight.tolist() == [0.0, 0.0, 1.0, 1.0]
    _, bounded, _ = core.corrected_loss(log_probs, old, -adv, seg, OffPolicy("sequence_mask", kl_threshold=0.5))
    assert not bounded.any()  # a positive advantage is kept whatever its KL (DeepSeek-V3.2's rule)


# ---------------------------------------------------------------------------------------------- settings
def test_each_mode_has_its_default_and_sync_keeps_trl_s(monkeypatch):
    for key in ("ROLLOUTS", "TRAIN_MODE", "OFF_POLICY_CORRECTION"):
        monkeypatch.delenv(key, raising=False)
    sync = RunConfig.load([]).off_policy()
    assert sync.name == "sequence_mask"
    kwargs = sync.sync_grpo_kwargs()
    assert kwargs == {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "sequence_mask",
                      "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None,
                      "off_policy_mask_threshold": None, "delta": 4.0}
    from trl import GRPOConfig

    trl_default = GRPOConfig(output_dir="/tmp/x", use_cpu=True)
    for field in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                  "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "off_policy_mask_threshold"):
        assert getattr(trl_default, field) == kwargs[field], field  # only delta is new (a no-op when ratio = 1)
    assert RunConfig.load(["--rollouts", "async", "--train-mode", "gpu"]).off_policy().name == "two_sided"


@pytest.mark.parametrize("name", ["none", "two_sided", "token_tis", "sequence_mask"])
def test_every_choice_is_a_valid_grpo_config(name):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir="/tmp/x", use_cpu=True, **OffPolicy(name, kl_threshold=None).sync_grpo_kwargs())
    assert args.vllm_importance_sampling_correction == (name in ("token_tis", "sequence_mask"))
    assert (args.delta is None) == (name == "none")


def test_a_knob_the_choice_does_not_read_is_refused():
    with pytest.raises(ConfigError, match="OFF_POLICY_KL_THRESHOLD=0.5 is read by OFF_POLICY_CORRECTION=sequence_mask"):
        RunConfig.load(["--off-policy-correction", "two_sided", "--off-policy-kl-threshold", "0.5"])
    with pytest.raises(ConfigError, match="OFF_POLICY_DELTA=2.0 is read by OFF_POLICY_CORRECTION=two_sided or "
                                          "token_tis or sequence_mask, not none"):
        RunConfig.load(["--off-policy-correction", "none", "--off-policy-delta", "2"])
    assert RunConfig.load(["--off-policy-kl-threshold", "0.5"]).off_policy().kl_threshold == 0.5  # sync's default reads it


def test_sync_figures_on_the_cpu_profile_are_those_of_an_on_policy_batch():
    """No vLLM and steps aligned: TRL compares the policy with itself; ratio 1, nothing bounded, weight 1."""
    trainer = SimpleNamespace(args=SimpleNamespace(delta=4.0, steps_per_generation=1, gradient_accumulation_steps=1),
                              epsilon_low=0.2, epsilon_high=0.2, off_policy_mask_threshold=None, num_iterations=1,
                              _step=0)
    logp = torch.log(torch.rand(2, 3) + 0.1)
    inputs = {"completion_mask": torch.tensor([[1, 1, 0], [1, 1, 1]]), "advantages": torch.tensor([-1.0, 1.0])}
    rho, bounded, weight, staleness = core.sync_token_figures(trainer, logp, inputs)
    assert rho.tolist() == [1.0] * 5 and not bounded.any() and weight.tolist() == [1.0] * 5 and staleness == 0


# ---------------------------------------------------------------------------------------------- the smoke's judgement
def off_policy_row(step, weight=2.0, clipped=0.01, **extra):
    return {"kind": "step", "step": step, "off_policy/ratio_mean": 1.01, "off_policy/ratio_max": 6.0,
            "off_policy/ratio_p99": 1.5, "off_policy/clipped_share": clipped, "off_policy/weight_max": weight,
            "off_policy/weight_cap": 4.0, "off_policy/kl_to_sampler": 0.01, **extra}


@pytest.mark.parametrize("rollouts", ["sync", "async"])
def test_gpu_smoke_judges_both_modes_on_the_off_policy_figures(rollouts):
    from contract import sampling_health as sh
    from contract.config import CpuMode, GpuMode, rollouts_variant
    from trainer.core.metrics import MetricsCallback

    callback = MetricsCallback("/tmp/unused", mode=GpuMode(), rollouts=rollouts_variant(rollouts))
    assert callback.sampling.ratio_key == sh.OFF_POLICY_RATIO  # the same key, whichever trainer logged it
    ok, detail = sh.verdict([off_policy_row(2), off_policy_row(3)], ratio_key=sh.OFF_POLICY_RATIO)
    assert ok is True and "ratio max 6, p99 1.5, clipped 1.0%, weight max 2, cap 4, KL to sampler 0.01" in detail
    ok, detail = sh.verdict([off_policy_row(2, weight=5.0), off_policy_row(3)], ratio_key=sh.OFF_POLICY_RATIO)
    assert ok is False and "step 2: a token's loss weight 5 over the off-policy correction's cap 4" in detail
    ok, detail = sh.verdict([off_policy_row(2), off_policy_row(3, clipped=0.2)], ratio_key=sh.OFF_POLICY_RATIO)
    assert ok is False and "step 3: 20% of trained tokens clipped or masked by the off-policy correction" in detail
    assert MetricsCallback("/tmp/unused", mode=CpuMode()).sampling.ratio_key == sh.RATIO_MEAN  # CPU: never judged


def test_sync_figures_with_vllm_count_the_sequences_trl_masks():
    """vLLM generated (stand-in batch: TRL's own fields): sequence 0's ratio to vLLM is e^2 > 3, so TRL's sequence_mask
    zeroes it; the figures count its tokens as masked, weigh them 0, and take the ratio against vLLM's log-probs."""
    trainer = SimpleNamespace(args=SimpleNamespace(delta=4.0, steps_per_generation=2, gradient_accumulation_steps=1),
                              epsilon_low=0.2, epsilon_high=0.2, off_policy_mask_threshold=None, num_iterations=1,
                              _step=1, vllm_importance_sampling_mode="sequence_mask",
                              vllm_importance_sampling_clip_min=None, vllm_importance_sampling_clip_max=3.0)
    logp = torch.zeros(2, 2)
    sampling = torch.tensor([[-1.0, -1.0], [0.0, 0.0]])
    inputs = {"completion_mask": torch.ones(2, 2), "advantages": torch.tensor([-1.0, 1.0]),
              "old_per_token_logps": torch.zeros(2, 2), "sampling_per_token_logps": sampling,
              "importance_sampling_ratio": torch.tensor([[0.0], [1.0]])}
    rho, bounded, weight, staleness = core.sync_token_figures(trainer, logp, inputs)
    assert rho.tolist() == pytest.approx([math.e, math.e, 1.0, 1.0])
    assert bounded.tolist() == [True, True, False, False] and weight.tolist() == [0.0, 0.0, 1.0, 1.0]
    assert staleness == 1  # the second micro-step of a 2-step generation batch: one update behind


def test_trackers_show_the_figures_among_the_rollout_cards_after_reward():
    from trainer.core.trackers import view

    shown = view({"kind": "step", "step": 1, "off_policy/ratio_max": 6.0, "off_policy/clipped_share": 0.01, "kl": 0.1})
    assert shown["rollout/off_policy/ratio_max"] == 6.0 and shown["rollout/off_policy/clipped_share"] == 0.01
    assert shown["trl/kl"] == 0.1 and not any(key.startswith("trl/off_policy") for key in shown)
