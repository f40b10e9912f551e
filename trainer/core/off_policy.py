"""The off-policy correction's loss terms and figures (OFF_POLICY_CORRECTION: contract/config/off_policy.py says what each
choice means; docs/async.md "Stale samples and the loss" in full).

  * `corrected_loss`: ROLLOUTS=async's per-token loss under the run's correction, from the trained policy's log-probs
    and the sampler's (vLLM's, up to MAX_STALENESS policy versions old). The async trainer's compute_loss hook
    (trainer.async_grpo.off_policy_loss) calls it; ROLLOUTS=sync gets the same meanings from TRL's own GRPOConfig
    fields (OffPolicy.sync_grpo_kwargs) and `sync_weight` follows TRL's loss to report them.
  * `Window` and `FIGURES`: what both trainers log every step, reduced over the logging window:

        off_policy/ratio_mean, _max, _p99   the trained tokens' ratio π_θ/π_sampler, before any correction (p99:
                                     the highest micro-batch p99 of the window)
        off_policy/clipped_share     share of trained tokens whose weight the correction changed (capped, truncated,
                                     or in a dropped sequence)
        off_policy/weight_max        the largest weight a trained token's loss term gave it, in units of |advantage|:
                                     at most off_policy/weight_cap (OffPolicy.weight_cap; absent with none)
        off_policy/kl_to_sampler     KL(sampler ‖ π_θ) per trained token (k3 estimate: r - 1 - log r)
        off_policy/staleness_max     policy updates between a trained sample's generation and the step that trained
                                     it (async: async/staleness_max; sync: 0 unless STEPS_PER_GENERATION >
                                     GRADIENT_ACCUMULATION_STEPS)
"""

from __future__ import annotations

import math

import torch

from contract.config.off_policy import OffPolicy

FIGURES = ("off_policy/ratio_mean", "off_policy/ratio_max", "off_policy/ratio_p99", "off_policy/clipped_share",
           "off_policy/weight_max", "off_policy/weight_cap", "off_policy/kl_to_sampler", "off_policy/staleness_max")


def _seq_sum(values: torch.Tensor, segment_id: torch.Tensor, sequences: int) -> torch.Tensor:
    return torch.zeros(sequences, dtype=values.dtype, device=values.device).index_add_(0, segment_id, values)


def corrected_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                   segment_id: torch.Tensor, correction: OffPolicy, epsilon_low: float = 0.2,
                   epsilon_high: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, bounded, weight) over flat trained tokens: `log_probs` the trained policy's (with grad),
    `old_log_probs` the sampler's, `segment_id` each token's sequence. `bounded`: the tokens whose weight the correction
    changed; `weight`: each token's loss weight in units of |advantage| (the value multiplying it).

    none / two_sided: TRL's PPO-clip term against the sampler, -min(c1·A, clip(r)·A), c1 = r (two_sided: min(r, δ)).
    token_tis / sequence_mask: the proximal policy is the trained one (detached; one pass per sample, as TRL's
    async trainer makes), so the PPO ratio is 1 with gradient ∇log π_θ and the ratio to the sampler becomes a
    detached weight, as TRL's sync loss applies vllm_importance_sampling_ratio: -w·A·∇log π_θ."""
    log_ratio = log_probs - old_log_probs
    rho = torch.exp(log_ratio.detach())
    name = correction.name
    if name in ("none", "two_sided"):
        coef_1 = torch.exp(log_ratio)
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        bounded = torch.zeros_like(rho, dtype=torch.bool)
        if name == "two_sided":
            bounded = (rho > correction.delta) & (advantages < 0)
            coef_1 = torch.clamp(coef_1, max=correction.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        weight = torch.where(advantages < 0, torch.max(coef_1, coef_2), torch.min(coef_1, coef_2)).detach()
        return per_token_loss, bounded, weight
    low = correction.is_min if correction.is_min is not None else 0.0
    if name == "token_tis":
        weight = torch.clamp(rho, min=low, max=correction.is_max)
        bounded = (rho > correction.is_max) | (rho < low)
    elif name == "sequence_mask":
        sequences = int(segment_id.max()) + 1 if segment_id.numel() else 0
        seq_ratio = torch.exp(_seq_sum(log_ratio.detach(), segment_id, sequences))[segment_id]
        keep = (seq_ratio <= correction.is_max) & (seq_ratio >= low)
        if correction.kl_threshold is not None:  # mean per-token KL(sampler ‖ π_θ) of the sequence
            tokens = _seq_sum(torch.ones_like(rho), segment_id, sequences).clamp(min=1)
            seq_kl = (_seq_sum(-log_ratio.detach(), segment_id, sequences) / tokens)[segment_id]
            keep &= (advantages >= 0) | (seq_kl <= correction.kl_threshold)
        weight = torch.where(keep, seq_ratio, torch.zeros_like(seq_ratio))
        bounded = ~keep
    else:
        raise ValueError(f"unknown off-policy correction {name!r}")
    per_token_loss = -weight * advantages * torch.exp(log_probs - log_probs.detach())
    return per_token_loss, bounded, weight


def sync_weight(per_token_logps: torch.Tensor, inputs: dict, delta: float | None, epsilon_low: float,
                epsilon_high: float) -> torch.Tensor:
    """Each token's loss weight (units of |advantage|) in TRL 1.16's sync `_compute_loss` for loss_type grpo/bnpo/
    dr_grpo/dapo: min/max of the PPO coefficients against π_old (δ-capped), times vLLM's importance-sampling ratio and
    the off-policy sequence mask where TRL applies them (the mask is folded in by the caller)."""
    old = inputs.get("old_per_token_logps")
    coef_1 = torch.exp(per_token_logps - (per_token_logps if old is None else old))
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    if delta is not None:
        coef_1 = torch.clamp(coef_1, max=delta)
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    weight = torch.where(advantages < 0, torch.max(coef_1, coef_2), torch.min(coef_1, coef_2))
    ratio = inputs.get("importance_sampling_ratio")
    return weight * ratio if ratio is not None else weight


class Window:
    """One logging window's figures, per micro-batch, across processes (`reduce_sum` and `gather` are the
    accelerator's: every process calls `add` together)."""

    def __init__(self, cap: float | None = None) -> None:
        self.cap = cap  # the correction's bound on weight_max (OffPolicy.weight_cap), logged beside it
        self.clear()

    def clear(self) -> None:
        self.maxes: list[float] = []
        self.p99s: list[float] = []
        self.weights: list[float] = []
        self.staleness: list[float] = []
        self.bounded = self.kl = self.count = self.ratio_sum = 0.0

    @torch.no_grad()
    def add(self, rho: torch.Tensor, bounded: torch.Tensor, weight: torch.Tensor, accelerator,
            staleness: float | None = None) -> None:
        """`rho`, `bounded`, `weight`: this process's trained tokens, flat (NaN ratios, tokens vLLM could not score,
        are left out)."""
        rho, bounded, weight = rho.float().flatten(), bounded.flatten(), weight.float().flatten()
        keep = ~torch.isnan(rho)
        rho, bounded, weight = rho[keep], bounded[keep], weight[keep]
        empty = rho.numel() == 0
        local = torch.stack([
            rho.max() if not empty else rho.new_tensor(0.0),
            torch.quantile(rho, 0.99) if 0 < rho.numel() <= 2**24 else (rho.max() if not empty else rho.new_tensor(0.0)),
            weight.max() if not empty else rho.new_tensor(0.0),
        ])
        sums = torch.stack([bounded.float().sum(), (rho - 1 - torch.log(rho.clamp(min=1e-30))).sum(),
                            rho.new_tensor(float(rho.numel())), rho.sum()])
        highest = accelerator.gather(local.unsqueeze(0)).reshape(-1, 3).max(0).values.tolist()
        totals = accelerator.reduce(sums, reduction="sum").tolist()
        self.maxes.append(highest[0])
        self.p99s.append(highest[1])
        self.weights.append(highest[2])
        self.bounded += totals[0]
        self.kl += totals[1]
        self.count += totals[2]
        self.ratio_sum += totals[3]
        if staleness is not None:
            self.staleness.append(float(staleness))

    def drain(self) -> dict[str, float]:
        """The window's figures ({} when nothing was trained), and a fresh window."""
        if not self.count:
            self.clear()
            return {}
        out = {"off_policy/ratio_mean": self.ratio_sum / self.count, "off_policy/ratio_max": max(self.maxes), "off_policy/ratio_p99": max(self.p99s),
               "off_policy/clipped_share": self.bounded / self.count, "off_policy/weight_max": max(self.weights),
               "off_policy/kl_to_sampler": self.kl / self.count}
        if self.cap is not None:
            out["off_policy/weight_cap"] = self.cap
        if self.staleness:
            out["off_policy/staleness_max"] = max(self.staleness)
        self.clear()
        return {k: v for k, v in out.items() if not math.isnan(v)}


@torch.no_grad()
def sync_token_figures(trainer, per_token_logps: torch.Tensor, inputs: dict):
    """(rho, bounded, weight, staleness) of one sync micro-batch's trained tokens, flat, as TRL 1.16's
    `_compute_loss` treats them under the trainer's settings (the GRPOConfig fields OffPolicy.sync_grpo_kwargs set).
    The sampler: vLLM (its log-probs), else the trainer at generation (`old_per_token_logps`), else the policy being
    trained (ratio 1: the CPU profile with STEPS_PER_GENERATION = GRADIENT_ACCUMULATION_STEPS)."""
    logp = per_token_logps.detach()
    mask = inputs["completion_mask"].bool()
    if inputs.get("tool_mask") is not None:
        mask &= inputs["tool_mask"].bool()
    old = inputs.get("old_per_token_logps")
    old = logp if old is None else old
    sampler = inputs.get("sampling_per_token_logps")
    sampler = old if sampler is None else sampler
    advantages = inputs["advantages"]
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    delta = trainer.args.delta
    weight = sync_weight(logp, inputs, delta, trainer.epsilon_low, trainer.epsilon_high)
    bounded = (torch.exp(logp - old) > delta) & (advantages < 0) if delta is not None else torch.zeros_like(mask)
    is_ratio = inputs.get("importance_sampling_ratio")
    if is_ratio is not None:  # TRL's vLLM weight: zero where masked, truncated where clipped
        raw = torch.exp(torch.nan_to_num((old - sampler) * mask, nan=0.0))
        if trainer.vllm_importance_sampling_mode.startswith("sequence"):
            raw = raw.prod(dim=-1, keepdim=True)
        low = trainer.vllm_importance_sampling_clip_min
        high = trainer.vllm_importance_sampling_clip_max
        bounded = bounded | ((raw > high) if high is not None else False) | ((raw < low) if low is not None else False)
    if trainer.off_policy_mask_threshold is not None:
        kept = trainer.get_off_policy_mask(advantages=advantages, per_token_logps=logp,
                                           sampling_per_token_logps=sampler, mask=mask.to(logp.dtype),
                                           off_policy_threshold=trainer.off_policy_mask_threshold)
        weight = weight * kept
        bounded = bounded | (kept == 0)
    bounded = bounded.expand_as(mask)
    weight = weight.expand_as(mask)
    generate_every = trainer.args.steps_per_generation * trainer.num_iterations
    staleness = (trainer._step % generate_every) // max(1, trainer.args.gradient_accumulation_steps)
    return torch.exp(logp - sampler)[mask], bounded[mask], weight[mask], float(staleness)
