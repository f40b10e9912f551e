"""OFF_POLICY_CORRECTION: what the GRPO loss does with a token sampled by a policy other than the one it trains, in
both ROLLOUTS modes (docs/async.md "Stale samples and the loss" says it in full). Pydantic and stdlib only.

The ratio r = π_θ(token) / π_sampler(token): the trained policy against the one that sampled the token (vLLM's
log-prob; ROLLOUTS=async: up to MAX_STALENESS weight updates old). TRL's PPO-clip term -min(r·A, clip(r)·A) is
bounded above by (1+ε)·A for a positive advantage A, but for a negative one it weighs the token by r itself: a token the
new policy likes far more than the sampler did, in a bad episode, pushes with weight r, unbounded. The choices:

    none           TRL's terms as they are (unbounded for A < 0; a warning says so at start)
    two_sided      r capped at OFF_POLICY_DELTA for A < 0 (INTELLECT-2's two-sided clipping; TRL's GRPOConfig.delta)
    token_tis      each token weighed by its ratio to the sampler, truncated to [OFF_POLICY_IS_MIN, OFF_POLICY_IS_MAX]
                   (TRL's vllm_importance_sampling_mode=token_truncate)
    sequence_mask  each sequence weighed by its ratio to the sampler (the product over its tokens), and dropped
                   when that leaves [OFF_POLICY_IS_MIN, OFF_POLICY_IS_MAX] (TRL's default mode, sequence_mask), or,
                   with OFF_POLICY_KL_THRESHOLD, when its advantage is negative and its mean per-token KL to the
                   sampler exceeds it (DeepSeek-V3.2's off-policy sequence mask; TRL's off_policy_mask_threshold)

Empty: DEFAULTS per ROLLOUTS. Sync keeps TRL's own default (sequence_mask, IS max 3), plus δ (a no-op unless
STEPS_PER_GENERATION > GRADIENT_ACCUMULATION_STEPS; the CPU profile's loss is unchanged). Async: two_sided, TRL's
async loss with only its unbounded tail cut, chosen from `make bench-async-stress` on the vLLM CPU twin (every choice
held its cap, their rewards within the bench's noise: docs/async.md "Stale samples and the loss").

ROLLOUTS=sync maps the choice onto TRL 1.16's GRPOConfig fields (`OffPolicy.sync_grpo_kwargs`); the vLLM
importance-sampling fields act only where vLLM generates (TRAIN_MODE=gpu or colocate): the CPU profile generates with
the trainer's own policy, so there r = 1 and every choice leaves its loss as it was. ROLLOUTS=async gets the same
meanings through the stack's hook on AsyncGRPOTrainer.compute_loss (trainer.core.off_policy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

Correction = Literal["none", "two_sided", "token_tis", "sequence_mask"]
DEFAULTS = {"sync": "sequence_mask", "async": "two_sided"}
DELTA = 4.0  # INTELLECT-2's δ; TRL: "recommended to be greater than 1 + ε"
IS_MAX = 3.0  # TRL's vllm_importance_sampling_clip_max default
# The knobs each choice reads (OFF_POLICY_<KNOB>); another set to other than its default is refused, not ignored.
READS = {"none": (), "two_sided": ("delta",), "token_tis": ("delta", "is_min", "is_max"),
         "sequence_mask": ("delta", "is_min", "is_max", "kl_threshold")}
KNOB_DEFAULTS = {"delta": DELTA, "is_min": None, "is_max": IS_MAX, "kl_threshold": None}
UNBOUNDED_WARNING = ("OFF_POLICY_CORRECTION=none: the loss weighs a token with a negative advantage by its ratio to the "
                     "sampler without bound (a token the trained policy now likes far more than the sampler did, in a "
                     "bad episode, pushes with that whole ratio); set two_sided, token_tis or sequence_mask to bound it")


@dataclass(frozen=True)
class OffPolicy:
    """The correction a run uses, resolved for its ROLLOUTS (RunConfig.off_policy())."""

    name: str
    delta: float = DELTA
    is_min: float | None = None
    is_max: float = IS_MAX
    kl_threshold: float | None = None

    @property
    def bounded(self) -> bool:
        return self.name != "none"

    def weight_cap(self, is_async: bool, epsilon_high: float = 0.2) -> float | None:
        """The most a trained token's loss may weigh it, in units of |advantage| (None: unbounded). The PPO clip
        bounds a positive advantage's by 1+ε. two_sided: max(δ, 1+ε). token_tis and sequence_mask: OFF_POLICY_IS_MAX
        in async (the PPO ratio against the trained policy itself is 1); in sync TRL multiplies it by the PPO
        coefficient against the trainer's policy at generation (δ-capped; 1 unless STEPS_PER_GENERATION >
        GRADIENT_ACCUMULATION_STEPS)."""
        if self.name == "none":
            return None
        ppo = max(self.delta, 1 + epsilon_high)
        if self.name == "two_sided":
            return ppo
        return self.is_max if is_async else self.is_max * ppo

    def sync_grpo_kwargs(self) -> dict[str, Any]:
        """TRL 1.16 GRPOConfig fields (ROLLOUTS=sync). `delta` caps π_θ/π_old, the ratio to the trainer's own policy
        when the batch was generated: 1 unless STEPS_PER_GENERATION > GRADIENT_ACCUMULATION_STEPS. The vllm_* fields
        weigh by π_old/π_vLLM and act only where vLLM generates (TRL ignores them with use_vllm=False)."""
        if self.name in ("none", "two_sided"):
            return {"vllm_importance_sampling_correction": False, "off_policy_mask_threshold": None,
                    "delta": self.delta if self.name == "two_sided" else None}
        return {"vllm_importance_sampling_correction": True,
                "vllm_importance_sampling_mode": "token_truncate" if self.name == "token_tis" else "sequence_mask",
                "vllm_importance_sampling_clip_max": self.is_max, "vllm_importance_sampling_clip_min": self.is_min,
                "off_policy_mask_threshold": self.kl_threshold if self.name == "sequence_mask" else None,
                "delta": self.delta}

    def describe(self) -> str:
        """One line for the trainer's log."""
        bounds = {"none": "unbounded for negative advantages",
                  "two_sided": f"ratio to the sampler capped at {self.delta:g} for negative advantages",
                  "token_tis": f"each token weighed by its ratio to the sampler, truncated to "
                               f"[{self.is_min or 0:g}, {self.is_max:g}]",
                  "sequence_mask": f"each sequence weighed by its ratio to the sampler, dropped outside "
                                   f"[{self.is_min or 0:g}, {self.is_max:g}]"
                                   + (f" or (negative advantage) past mean KL {self.kl_threshold:g}"
                                      if self.kl_threshold is not None else "")}
        return f"off-policy correction {self.name}: {bounds[self.name]}"


def problem(chosen: str, knobs: dict[str, Any]) -> str | None:
    """One line when a knob the chosen correction does not read is set to other than its default (else None)."""
    for knob, value in knobs.items():
        if knob not in READS[chosen] and value != KNOB_DEFAULTS[knob]:
            readers = [name for name, reads in READS.items() if knob in reads]
            return (f"OFF_POLICY_{knob.upper()}={value} is read by OFF_POLICY_CORRECTION={' or '.join(readers)}, not "
                    f"{chosen} (this run's): set OFF_POLICY_CORRECTION, or leave OFF_POLICY_{knob.upper()} empty "
                    "(edit .env)")
    return None


class OffPolicySettings(BaseModel):
    """RunConfig's OFF_POLICY_* fields (a base of contract.config.RunConfig)."""

    off_policy_correction: Correction | None = Field(
        None, description="What the loss does with a token sampled by an older or other policy than the one trained, "
        "both ROLLOUTS (docs/async.md \"Stale samples and the loss\"): none (TRL's terms, unbounded for negative "
        "advantages: warned), two_sided (the ratio to the sampler capped at OFF_POLICY_DELTA for negative advantages), "
        "token_tis (each token weighed by that ratio truncated to [OFF_POLICY_IS_MIN, OFF_POLICY_IS_MAX]), "
        "sequence_mask (each sequence weighed by it, dropped outside those bounds or past OFF_POLICY_KL_THRESHOLD). "
        "Empty: sequence_mask with ROLLOUTS=sync (TRL's default), two_sided with async. The CPU profile has no other "
        "sampler: its loss is the same under every choice.")
    off_policy_delta: float = Field(
        DELTA, gt=1.2, le=100, description="two_sided (and, in sync, token_tis and sequence_mask): the cap on the "
        "ratio for negative advantages (TRL's GRPOConfig.delta; above 1 + the clip's 0.2).")
    off_policy_is_max: float = Field(
        IS_MAX, gt=1, le=1000, description="token_tis: the ratio's truncation; sequence_mask: a sequence whose ratio "
        "exceeds it is dropped (TRL's vllm_importance_sampling_clip_max).")
    off_policy_is_min: float | None = Field(
        None, ge=0, lt=1, description="token_tis: the ratio's floor; sequence_mask: a sequence whose ratio is below "
        "it is dropped (TRL's vllm_importance_sampling_clip_min). Empty: none.")
    off_policy_kl_threshold: float | None = Field(
        None, gt=0, le=100, description="sequence_mask: also drop a sequence whose advantage is negative and whose "
        "mean per-token KL to the sampler exceeds this (DeepSeek-V3.2's off-policy mask, e.g. 0.5; TRL's "
        "off_policy_mask_threshold). Empty: off.")

    def off_policy(self) -> OffPolicy:
        """The correction this run uses: OFF_POLICY_CORRECTION, else its ROLLOUTS' default."""
        name = self.off_policy_correction or DEFAULTS[str(getattr(self, "rollouts", "sync"))]
        return OffPolicy(name, self.off_policy_delta, self.off_policy_is_min, self.off_policy_is_max,
                         self.off_policy_kl_threshold)

    @model_validator(mode="after")
    def _check_off_policy(self) -> "OffPolicySettings":
        knobs = {knob: getattr(self, f"off_policy_{knob}") for knob in KNOB_DEFAULTS}
        found = problem(self.off_policy().name, knobs)
        if found:
            raise ValueError(found)
        return self
