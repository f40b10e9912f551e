"""Does a weight push land in vLLM? One routine for `make nccl-check FULL=1` (NCCL) and the CPU rehearsal (reload).

vLLM keeps a layer's old tensors when a push names it wrongly or sends a dtype/shape it skips (a warning in its log,
nothing else), so "a token came back" proves nothing. `check_weights_land` compares what the server computes with
what the trainer computes itself, for one fixed prompt (greedy tokens + prompt logprobs):
  1. before any push: the served model is the trainer's (same checkpoint, same revision);
  2. weights perturbed deterministically (every tensor scaled elementwise by a seeded factor in [0.5, 1.5]) and
     pushed: the served output must change, and must match the trainer's forward of the perturbed weights (a layer
     that kept its old tensors breaks that match);
  3. the originals pushed back: the same greedy tokens as before, logprobs within tolerance of the trainer's own;
and every prefix-cache reset after a push must answer `{"success": true}` (a stale cache serves old KV).

Tolerance (bf16 served, fp32 trainer), sized from a measurement (bench/weight_check_tolerance.py, on the CPU): a
Qwen3-shaped model with 28 layers (hidden 256, 4 heads of 64, Qwen3's vocabulary), random init, the perturbation
below, bf16 vs fp32 forwards of the same weights over 4 prompts of 40 tokens + 16 greedy ones. At transformers' init
(std 0.02, near-uniform outputs) the gap is mean 0.005 / max 0.016 nats; with peakier weights (std 0.1-0.15, greedy
tokens at -5.8 to -3.7 nats) it grows to mean 0.16 / max 0.81 nats (fp32 under bf16 autocast, as training computes:
no closer). The old bounds (0.05 / 0.5) would fail a correct push there. A push whose middle layer kept its old
tensors moved the same model by mean 0.46 / max 2.7 nats. So a match is mean |diff| <= 0.25 and max <= 1.5 nats
(about 1.5x and 2x the worst bf16 gap measured), and a change is a different greedy token or prompt logprobs moved
by a mean of 0.5 nats (the perturbation moves them by whole nats). Not measured on a GPU or a trained model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

MATCH_MEAN_NATS = 0.25  # measured worst bf16 gap: mean 0.16 nats (module docstring)
MATCH_MAX_NATS = 1.5  # measured worst bf16 gap: max 0.81 nats
CHANGED_MEAN_NATS = 0.5
PROBE_TEXT = ("Weights pushed from the trainer must reach every layer of the served model: the capital of France is "
              "Paris, and one two three four five six seven eight nine ten")
PROBE_TOKENS = 16  # greedy tokens generated after the prompt
PERTURB_SEED = 1234


class WeightCheckFailed(RuntimeError):
    """A part of the weight-push check failed; the message says which part and what it means."""


class PrefixCacheResetFailed(RuntimeError):
    """vLLM answered /reset_prefix_cache without success: cached KV from the old weights would still be served."""


def reset_prefix_cache(session: Any, base_url: str, timeout_s: float = 60.0, running: bool = False) -> None:
    """POST /reset_prefix_cache and require `{"success": true}` (vLLM >= 0.26 answers it; TRL 1.16 drops the body).
    vLLM refuses while requests hold cache blocks: the next generation would then reuse KV computed with the old
    weights. `running`: also drop the KV of requests in flight (vLLM's `reset_running_requests`: it preempts them and
    recomputes their tokens so far on resume), for an async push made while requests sit paused."""
    query = {"params": {"reset_running_requests": "true"}} if running else {}
    r = session.post(f"{base_url}/reset_prefix_cache", timeout=timeout_s, **query)
    if r.status_code != 200:
        raise PrefixCacheResetFailed(f"vLLM's /reset_prefix_cache answered HTTP {r.status_code} ({r.text[:200]}): the "
                                     "prefix cache still holds KV from the old weights; see the vllm service's log")
    try:
        body = r.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("success") is False:
        raise PrefixCacheResetFailed(
            f"vLLM did not reset its prefix cache after the weight push ({r.text[:200]}): it refuses while requests "
            "still hold cache blocks, and generations would reuse KV computed with the old weights; make sure no "
            "other client generates on this server during training (one trainer per vllm service)")


@dataclass
class Served:
    """One greedy answer of the server: its tokens, their logprobs, and the prompt's logprobs (positions 1..)."""
    tokens: list[int]
    token_logprobs: list[float]
    prompt_logprobs: list[float]

    @property
    def logprobs(self) -> list[float]:
        return [*self.prompt_logprobs, *self.token_logprobs]


@dataclass
class Own:
    """The trainer's forward of prompt + the served tokens: the logprob of every token after the first, and at each
    generated position the best token and its margin over the served token."""
    logprobs: list[float]
    argmax: list[int]
    argmax_margin: list[float]  # top-1 logprob minus the served token's logprob, per generated position


@dataclass
class Gap:
    mean: float
    max: float
    worst: int  # index of the largest |diff|

    def matches(self) -> bool:
        return self.mean <= MATCH_MEAN_NATS and self.max <= MATCH_MAX_NATS

    def __str__(self) -> str:
        return f"mean |diff| {self.mean:.4f}, max {self.max:.4f} nats (at position {self.worst})"


def gap(a: list[float], b: list[float]) -> Gap:
    """Mean and max absolute difference of two logprob lists of the same length."""
    if len(a) != len(b) or not a:
        raise ValueError(f"logprob lists differ in length ({len(a)} vs {len(b)}) or are empty")
    diffs = [abs(x - y) for x, y in zip(a, b)]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return Gap(sum(diffs) / len(diffs), diffs[worst], worst)


def greedy_disagreements(served: Served, own: Own) -> list[int]:
    """Generated positions where the server's greedy token is not the trainer's best token, beyond a near tie (a
    margin within MATCH_MAX_NATS, which bf16 rounding may flip)."""
    return [i for i, (tok, best, margin) in enumerate(zip(served.tokens, own.argmax, own.argmax_margin))
            if tok != best and margin > MATCH_MAX_NATS]


def changed(before: Served, after: Served) -> bool:
    """Did the served model's answer change? A different greedy token, or prompt logprobs moved by CHANGED_MEAN_NATS."""
    return before.tokens != after.tokens or gap(before.prompt_logprobs, after.prompt_logprobs).mean >= CHANGED_MEAN_NATS


def query(session: Any, base_url: str, model: str, prompt_ids: list[int], max_tokens: int = PROBE_TOKENS,
          timeout_s: float = 120.0) -> Served:
    """Greedy tokens and logprobs of `prompt_ids`, with sampling fields neutral whatever the model's
    generation_config says (the trainer's forward applies no penalty)."""
    from trainer.gpu.grpo_kwargs import NEUTRAL_SAMPLING

    payload = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 0,
               "prompt_logprobs": 0, "return_token_ids": True, "repetition_penalty": 1.0, "top_p": 1.0,
               "top_k": 0, "min_p": 0.0, "ignore_eos": True, **NEUTRAL_SAMPLING}
    r = session.post(f"{base_url}/v1/completions", json=payload, timeout=timeout_s)
    if r.status_code != 200:
        raise WeightCheckFailed(f"vLLM refused the probe request (HTTP {r.status_code}: {r.text[:300]})")
    choice = r.json()["choices"][0]
    prompt = choice.get("prompt_logprobs") or []
    prompt_lps = []
    for tok, entry in zip(prompt_ids[1:], prompt[1:]):
        item = (entry or {}).get(str(tok))
        if item is None:
            raise WeightCheckFailed(f"vLLM's prompt logprobs lack token {tok}: {str(entry)[:200]}")
        prompt_lps.append(float(item["logprob"]))
    if len(prompt_lps) != len(prompt_ids) - 1:
        raise WeightCheckFailed(f"vLLM returned {len(prompt_lps)} prompt logprobs for {len(prompt_ids)} prompt tokens")
    return Served(tokens=[int(t) for t in choice["token_ids"]],
                  token_logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                  prompt_logprobs=prompt_lps)


def own_forward(model: Any, prompt_ids: list[int], tokens: list[int], autocast: bool | None = None) -> Own:
    """The trainer's own forward of prompt + tokens (teacher-forced), on its device, as training computes it: fp32
    master weights on a GPU with bf16 run under bf16 autocast (GRPOConfig(bf16=True)); else in the model's dtype.
    `autocast` forces it on or off (the bench runs both on the CPU)."""
    import contextlib

    import torch

    param = next(model.parameters())
    device = param.device
    if autocast is None:
        autocast = device.type == "cuda" and param.dtype == torch.float32 and torch.cuda.is_bf16_supported()
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    ids = torch.tensor([[*prompt_ids, *tokens]], device=device)
    with torch.no_grad(), ctx:
        logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    picked = logprobs.gather(1, ids[0, 1:, None])[:, 0]
    gen = logprobs[len(prompt_ids) - 1:]
    top = gen.max(-1)
    return Own(logprobs=picked.tolist(), argmax=top.indices.tolist(),
               argmax_margin=(top.values - picked[len(prompt_ids) - 1:]).tolist())


def perturb_(model: Any, seed: int = PERTURB_SEED) -> dict[str, Any]:
    """Scale every parameter elementwise by a seeded factor in [0.5, 1.5], in place; returns CPU copies of the
    originals for restore_(). Deterministic; keeps signs and magnitudes, so the model stays numerically sane (no
    overflow) while every tensor, norms included, moves."""
    import torch

    originals = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            if not p.is_floating_point():  # QLoRA's packed 4-bit bytes: a factor would scramble them, not scale
                continue
            originals[name] = p.detach().to("cpu", copy=True)
            gen = torch.Generator().manual_seed(seed + i)
            factor = 0.5 + torch.rand(p.shape, generator=gen, dtype=torch.float32)
            p.mul_(factor.to(device=p.device, dtype=p.dtype))
    return originals


def restore_(model: Any, originals: dict[str, Any]) -> None:
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in originals:
                p.copy_(originals[name].to(p.device))


def check_weights_land(model: Any, prompt_ids: list[int], push: Callable[[], None], reset: Callable[[], None],
                       ask: Callable[[], Served], say: Callable[[str], None] = print) -> dict[str, Any]:
    """The check (see the module docstring). `push()` sends the model's current weights to vLLM the way training does
    (NCCL or reload), `reset()` resets vLLM's prefix cache and raises unless it succeeded, `ask()` is `query(...)`
    for `prompt_ids`. Raises WeightCheckFailed naming the part that failed; returns the figures."""
    base = ask()
    own_base = own_forward(model, prompt_ids, base.tokens)
    g0 = gap(base.logprobs, own_base.logprobs)
    say(f"before any push: served vs trainer {g0}")
    if not g0.matches() or greedy_disagreements(base, own_base):
        raise WeightCheckFailed(
            f"before any push the served model is not the trainer's ({g0}; greedy tokens {base.tokens} vs the "
            f"trainer's {own_base.argmax}): vLLM serves another model, revision or dtype than the trainer loads "
            "(MODEL_NAME / MODEL_REVISION)")

    originals = perturb_(model)
    try:
        push()
        _reset(reset, "perturbed")
        pert = ask()
        own_pert = own_forward(model, prompt_ids, pert.tokens)
    finally:
        restore_(model, originals)
    moved = gap(base.prompt_logprobs, pert.prompt_logprobs)
    say(f"perturbed push: served output moved by {moved}; greedy tokens {'changed' if base.tokens != pert.tokens else 'same'}")
    if not changed(base, pert):
        raise WeightCheckFailed(
            f"perturbed weights were pushed but the served output did not change ({moved}): nothing reached the "
            "served model (vLLM keeps a layer's old tensors when a name, dtype or shape does not match, with only a "
            "warning in its log), or the prefix cache served old KV")
    g1 = gap(pert.logprobs, own_pert.logprobs)
    say(f"perturbed push: served vs trainer's perturbed forward {g1}")
    if not g1.matches() or greedy_disagreements(pert, own_pert):
        raise WeightCheckFailed(
            f"part of the perturbed push did not land: the served model differs from the trainer's perturbed weights "
            f"({g1}): some layer kept its old tensors (a parameter name vLLM does not map, or a dtype/shape it "
            "skipped: look for 'not loaded'/'skip' warnings in the vllm service's log)")

    push()
    _reset(reset, "restored")
    back = ask()
    own_back = own_forward(model, prompt_ids, back.tokens)
    g2 = gap(back.logprobs, own_back.logprobs)
    say(f"originals pushed back: served vs trainer {g2}; greedy tokens {'identical' if back.tokens == base.tokens else 'DIFFERENT'}")
    if back.tokens != base.tokens:
        raise WeightCheckFailed(
            f"the original weights were pushed back but the greedy tokens differ from the served model's before any "
            f"push ({back.tokens} vs {base.tokens}): the push changes weights on the way (a dtype cast or a shape/layout "
            "mismatch) or does not replace all of them")
    if not g2.matches():
        raise WeightCheckFailed(
            f"the original weights were pushed back but the served logprobs are not the trainer's ({g2}): the push "
            "changes weights on the way (a dtype cast or a shape/layout mismatch)")
    return {"before_push": g0, "perturbed_moved": moved, "perturbed_vs_trainer": g1, "restored_vs_trainer": g2,
            "tokens": base.tokens}


def _reset(reset: Callable[[], None], which: str) -> None:
    try:
        reset()
    except PrefixCacheResetFailed as exc:
        raise WeightCheckFailed(f"prefix-cache reset after the {which} push failed: {exc}") from None
