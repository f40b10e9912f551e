"""trainer.gpu.weight_check, the check behind `make nccl-check FULL=1` and the rehearsal's reload push: its comparison
logic, and the whole routine against an in-process stand-in for vLLM (a second copy of the model that receives the
pushed tensors; the test names say so). The routine against the real vLLM twin: test_weight_push_lands_on_twin.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest

from trainer.gpu import weight_check as wc
from trainer.gpu.weight_check import Gap, Own, Served


# ------------------------------------------------------------------ comparison logic
def test_gap_is_the_mean_and_max_absolute_difference_and_where_the_max_is():
    g = wc.gap([-1.0, -2.0, -3.0], [-1.1, -2.0, -2.4])
    assert g.mean == pytest.approx(0.7 / 3) and g.max == pytest.approx(0.6) and g.worst == 2
    with pytest.raises(ValueError, match="differ in length"):
        wc.gap([-1.0], [-1.0, -2.0])


@pytest.mark.parametrize("diffs, ok", [
    ([0.01] * 40, True),                   # typical bf16 noise
    ([0.16] * 39 + [0.81], True),          # the worst bf16 gap measured on 28 layers (bench/weight_check_tolerance.py)
    ([0.01] * 39 + [1.6], False),          # one token beyond the max tolerance
    ([0.46] * 40, False),                  # every token off by what a stale middle layer did there: a layer missed
])
def test_bf16_tolerance_allows_rounding_noise_but_not_a_systematic_or_large_deviation(diffs, ok):
    a = [-2.0] * len(diffs)
    assert wc.gap(a, [x - d for x, d in zip(a, diffs)]).matches() is ok


def test_greedy_disagreement_counts_only_beyond_a_near_tie():
    served = Served(tokens=[5, 6, 7], token_logprobs=[0, 0, 0], prompt_logprobs=[])
    own = Own(logprobs=[], argmax=[5, 9, 8], argmax_margin=[0.0, 0.2, 3.0])
    assert wc.greedy_disagreements(served, own) == [2]  # position 1 is a near tie bf16 may flip


def test_changed_means_another_greedy_token_or_prompt_logprobs_moved_by_whole_nats():
    base = Served(tokens=[1, 2], token_logprobs=[-1, -1], prompt_logprobs=[-1.0, -2.0])
    assert not wc.changed(base, Served([1, 2], [-1, -1], [-1.02, -2.01]))
    assert wc.changed(base, Served([1, 3], [-1, -1], [-1.0, -2.0]))
    assert wc.changed(base, Served([1, 2], [-1, -1], [-2.0, -3.0]))


class FakeResponse:  # a test double for requests' Response: the bodies vLLM 0.31's /reset_prefix_cache answers
    def __init__(self, status: int, body):
        self.status_code, self._body, self.text = status, body, str(body)

    def json(self):
        return self._body


@pytest.mark.parametrize("status, body, error", [
    (200, {"success": True}, None),
    (200, {"success": False}, "did not reset its prefix cache"),
    (500, {"detail": "boom"}, "HTTP 500"),
])
def test_prefix_cache_reset_requires_success_with_a_fake_session(status, body, error):
    session = SimpleNamespace(post=lambda url, timeout: FakeResponse(status, body))
    if error is None:
        wc.reset_prefix_cache(session, "http://vllm:8000")
    else:
        with pytest.raises(wc.PrefixCacheResetFailed, match=error):
            wc.reset_prefix_cache(session, "http://vllm:8000")


def test_trl_reset_prefix_cache_is_wrapped_so_success_false_raises(monkeypatch):
    import trl.generation.vllm_client as trl_vllm_client

    from trainer.gpu import trl_hooks

    monkeypatch.setattr(trl_vllm_client.VLLMClient, "reset_prefix_cache",
                        trl_vllm_client.VLLMClient.reset_prefix_cache)  # undone after the test
    trl_hooks.require_prefix_cache_reset()
    trl_hooks.require_prefix_cache_reset()  # idempotent
    client = object.__new__(trl_vllm_client.VLLMClient)  # no server: only the reset is exercised
    client.base_url = "http://vllm:8000"
    client.session = SimpleNamespace(post=lambda url, timeout: FakeResponse(200, {"success": False}))
    with pytest.raises(wc.PrefixCacheResetFailed, match="KV computed with the old weights"):
        client.reset_prefix_cache()


# ------------------------------------------------------------------ the routine against an in-process stand-in
def tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # initializer_range 0.5: peaked next-token distributions, like a trained model's (a 0.02 init is near uniform)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=128, initializer_range=0.5,
                      tie_word_embeddings=True)
    return Qwen3ForCausalLM(cfg).eval()


class StandInServer:
    """Stand-in for vLLM (a test double): its own copy of the model, greedy decoding, pushed tensors copied in; `drop`
    names tensors it ignores (as vLLM ignores a name it does not map), `reset_ok` its prefix-cache answer."""

    def __init__(self, model, drop: tuple[str, ...] = (), reset_ok: bool = True):
        self.model, self.drop, self.reset_ok = copy.deepcopy(model), drop, reset_ok
        self.pushes = 0

    def push(self, trainer_model) -> None:
        import torch

        self.pushes += 1
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in trainer_model.named_parameters():
                if name not in self.drop:
                    params[name].copy_(p)

    def reset(self) -> None:
        if not self.reset_ok:
            raise wc.PrefixCacheResetFailed("vLLM did not reset its prefix cache (stand-in)")

    def ask(self, prompt_ids) -> Served:
        import torch

        ids = list(prompt_ids)
        with torch.no_grad():
            for _ in range(8):
                ids.append(int(self.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        tokens = ids[len(prompt_ids):]
        own = wc.own_forward(self.model, prompt_ids, tokens)
        n = len(prompt_ids) - 1
        return Served(tokens=tokens, token_logprobs=own.logprobs[n:], prompt_logprobs=own.logprobs[:n])


PROMPT = [3, 17, 42, 8, 25, 11, 60, 2, 33, 19]


def run_check(model, server):
    lines = []
    figures = wc.check_weights_land(model, PROMPT, push=lambda: server.push(model), reset=server.reset,
                                    ask=lambda: server.ask(PROMPT), say=lines.append)
    return figures, lines


def test_check_passes_when_every_tensor_lands_with_an_in_process_stand_in():
    import torch

    model = tiny_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    server = StandInServer(model)
    figures, lines = run_check(model, server)
    assert server.pushes == 2  # perturbed, then the originals
    assert figures["perturbed_moved"].mean >= wc.CHANGED_MEAN_NATS
    assert figures["restored_vs_trainer"].max == 0.0
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # the trainer's weights restored
    assert any("perturbed push" in line for line in lines)


def test_a_layer_that_keeps_its_old_tensors_fails_the_check_with_an_in_process_stand_in():
    model = tiny_model()
    server = StandInServer(model, drop=("model.layers.1.mlp.down_proj.weight",))
    with pytest.raises(wc.WeightCheckFailed, match="part of the perturbed push did not land"):
        run_check(model, server)


def test_a_push_that_reaches_nothing_fails_as_unchanged_with_an_in_process_stand_in():
    model = tiny_model()
    server = StandInServer(model, drop=tuple(n for n, _ in model.named_parameters()))
    with pytest.raises(wc.WeightCheckFailed, match="did not change"):
        run_check(model, server)


def test_a_refused_prefix_cache_reset_fails_the_check_with_an_in_process_stand_in():
    model = tiny_model()
    with pytest.raises(wc.WeightCheckFailed, match="prefix-cache reset after the perturbed push failed"):
        run_check(model, StandInServer(model, reset_ok=False))


def test_a_served_model_that_is_not_the_trainers_fails_before_any_push_with_an_in_process_stand_in():
    model = tiny_model()
    server = StandInServer(model)
    with __import__("torch").no_grad():
        server.model.lm_head.weight.mul_(3.0)  # another checkpoint (tied: the embeddings too)
    with pytest.raises(wc.WeightCheckFailed, match="before any push the served model is not the trainer's"):
        run_check(model, server)


def test_perturbation_is_deterministic_and_restore_is_exact():
    import torch

    a, b = tiny_model(), tiny_model()
    originals = wc.perturb_(a)
    wc.perturb_(b)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, originals["model.embed_tokens.weight"])
    wc.restore_(a, originals)
    assert all(torch.equal(p, originals[n]) for n, p in a.named_parameters())
