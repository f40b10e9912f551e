"""Importance-sampling health: do vLLM's log-probs still match the trainer's? (standard library only)

With vLLM, TRL weighs each sequence by exp(trainer logp - vLLM logp) and, in its default `sequence_mask` mode, zeroes
the sequences whose ratio leaves [clip_min, clip_max]. A garbled weight sync or numeric drift then shows up only as
a reward that never moves. TRL logs `sampling/importance_sampling_ratio/{min,mean,max}` (the mean counts masked
sequences as 0); the trainer adds `sampling/importance_sampling_masked_fraction` (trainer.train). Both ROLLOUTS modes
log the off_policy/* figures (trainer.core.off_policy; OFF_POLICY_CORRECTION): in vLLM modes the smoke judges both
modes on them alike. Healthy: mean ratio in RATIO_BOUNDS, at most MAX_MASKED of the sequences masked and of the
trained tokens clipped or masked, and no token's loss weight over the correction's cap.

`make gpu-smoke` judges steps 2-3 (after the first weight sync) through the `importance_sampling` stage line; a
later step out of bounds is one warning in the training log.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
# ROLLOUTS=async (TRL's AsyncGRPOTrainer): the mean of exp(trainer logp - vLLM logp) over the trained tokens, the
# ratio its clipped loss weighs; it holds the sampling mismatch and the policy's moves since the sample was generated.
ASYNC_RATIO = "ratio"
MASKED_FRACTION = "sampling/importance_sampling_masked_fraction"
# Both ROLLOUTS modes (trainer.core.off_policy): the trained tokens' ratio π_θ/π_sampler before any correction, the
# share of them OFF_POLICY_CORRECTION clipped or masked, and the largest loss weight against the correction's cap.
OFF_POLICY_RATIO = "off_policy/ratio_mean"
CLIPPED_SHARE = "off_policy/clipped_share"
WEIGHT_MAX, WEIGHT_CAP = "off_policy/weight_max", "off_policy/weight_cap"
RATIO_BOUNDS = (0.8, 1.25)
MAX_MASKED = 0.10
JUDGED_STEPS = (2, 3)  # the steps after the first weight sync: what `make gpu-smoke` judges


def _number(row: dict[str, Any], key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, (int, float)) and not math.isnan(value) else None


def has_figures(row: dict[str, Any], ratio_key: str = RATIO_MEAN) -> bool:
    """Whether TRL logged the ratio for this step (vLLM generation with its importance-sampling correction)."""
    return _number(row, ratio_key) is not None


def problems(row: dict[str, Any], ratio_key: str = RATIO_MEAN) -> list[str]:
    """What is out of bounds in one metric row (empty: healthy, or no figures)."""
    found = []
    mean, masked = _number(row, ratio_key), _number(row, MASKED_FRACTION)
    low, high = RATIO_BOUNDS
    if mean is not None and not low <= mean <= high:
        found.append(f"mean importance-sampling ratio {mean:.3f} outside [{low}, {high}]")
    if masked is not None and masked > MAX_MASKED:
        found.append(f"{masked:.0%} of sequences masked (> {MAX_MASKED:.0%})")
    clipped, weight, cap = _number(row, CLIPPED_SHARE), _number(row, WEIGHT_MAX), _number(row, WEIGHT_CAP)
    if clipped is not None and clipped > MAX_MASKED:
        found.append(f"{clipped:.0%} of trained tokens clipped or masked by the off-policy correction "
                     f"(> {MAX_MASKED:.0%})")
    if weight is not None and cap is not None and weight > cap * (1 + 1e-3):
        found.append(f"a token's loss weight {weight:.3g} over the off-policy correction's cap {cap:.3g}")
    return found


def describe(row: dict[str, Any], ratio_key: str = RATIO_MEAN) -> str:
    mean, masked = _number(row, ratio_key), _number(row, MASKED_FRACTION)
    parts = [f"ratio mean {mean:.3f}" if mean is not None else "no ratio"]
    for key, label in (("sampling/importance_sampling_ratio/min", "min"),
                       ("sampling/importance_sampling_ratio/max", "max")):
        value = _number(row, key)
        if value is not None:
            parts.append(f"{label} {value:.3f}")
    if masked is not None:
        parts.append(f"masked {masked:.0%}")
    for key, label, fmt in (("off_policy/ratio_max", "ratio max", "{:.3g}"), ("off_policy/ratio_p99", "p99", "{:.3g}"),
                            (CLIPPED_SHARE, "clipped", "{:.1%}"), (WEIGHT_MAX, "weight max", "{:.3g}"),
                            (WEIGHT_CAP, "cap", "{:.3g}"), ("off_policy/kl_to_sampler", "KL to sampler", "{:.2g}"),
                            ("off_policy/staleness_max", "lag max", "{:.0f}")):
        value = _number(row, key)
        if value is not None:
            parts.append(f"{label} {fmt.format(value)}")
    return ", ".join(parts)


def verdict(rows: Iterable[dict[str, Any]], steps: tuple[int, ...] = JUDGED_STEPS,
            ratio_key: str = RATIO_MEAN) -> tuple[bool | None, str]:
    """The smoke's judgement over the metric rows of `steps`: (True, figures) in bounds, (False, what is wrong),
    or (None, why) when those steps carry no importance-sampling figures (no vLLM: the CPU profile)."""
    picked = [r for r in rows if r.get("step") in steps and has_figures(r, ratio_key)]
    if not picked:
        return None, f"no importance-sampling figures at steps {'-'.join(map(str, steps))}"
    figures = "; ".join(f"step {r['step']}: {describe(r, ratio_key)}" for r in picked)
    bad = [f"step {r['step']}: {p}" for r in picked for p in problems(r, ratio_key)]
    if bad:
        return False, "; ".join(bad) + f" ({figures})"
    return True, figures


class Watch:
    """Fed every metric row as training logs it: marks the smoke's stage once steps 2-3 are in, and warns once when
    any step leaves the bounds."""

    def __init__(self, mark: Callable[..., Any], warn: Callable[[str], Any], ratio_key: str = RATIO_MEAN) -> None:
        self.mark, self.warn, self.ratio_key = mark, warn, ratio_key
        self.rows: list[dict[str, Any]] = []
        self.judged = False
        self.warned = False

    def observe(self, row: dict[str, Any]) -> None:
        if not has_figures(row, self.ratio_key):
            return
        step = row.get("step") or 0
        if step in JUDGED_STEPS:
            self.rows.append(row)
        if not self.judged and step >= max(JUDGED_STEPS):
            self.judged = True
            ok, detail = verdict(self.rows, ratio_key=self.ratio_key)
            self.mark("importance_sampling", None, detail, ok=ok)
        found = problems(row, self.ratio_key)
        if found and not self.warned:
            self.warned = True
            self.warn(f"WARNING step {step}: {'; '.join(found)} ({describe(row, self.ratio_key)}). vLLM's log-probs "
                      "no longer match "
                      "the trainer's: a garbled weight sync or numeric drift; masked sequences do not train (`make "
                      "nccl-check FULL=1` checks the sync). Warned once per run.")


# ROLLOUTS=async: how off-policy the trained samples were (trainer.core.async_metrics writes these keys).
MAX_DROPPED_SHARE = 0.5  # more dropped as stale than trained: generation runs too far ahead (MAX_STALENESS too low)


def staleness_verdict(rows: Iterable[dict[str, Any]], steps: tuple[int, ...] = JUDGED_STEPS) -> tuple[bool, str]:
    """The smoke's staleness stage over the async metric rows of `steps`: samples trained, each within MAX_STALENESS
    (TRL drops the rest), and at most MAX_DROPPED_SHARE of what the trainer took dropped as stale."""
    picked = [r for r in rows if r.get("step") in steps]
    lags = [k for r in picked for k in r if k.startswith("async/samples_at_lag/")]
    trained = sum(_number(r, k) or 0.0 for r in picked for k in r if k.startswith("async/samples_at_lag/"))
    dropped = sum(_number(r, "async/dropped_stale") or 0.0 for r in picked)
    if not lags or not trained:
        return False, f"no trained sample's lag logged at steps {'-'.join(map(str, steps))}"
    worst = max(_number(r, "async/staleness_max") or 0.0 for r in picked)
    share = dropped / (dropped + trained)
    paused = [v for v in (_number(r, "async/vllm_paused_s") for r in picked) if v is not None]
    detail = (f"steps {'-'.join(map(str, steps))}: {trained:.0f} samples trained, lag max {worst:.0f}, "
              f"{dropped:.0f} dropped as stale ({share:.0%})"
              + (f"; vLLM paused {sum(paused) / len(paused):.2f}s per sync" if paused else ""))
    if share > MAX_DROPPED_SHARE:
        return False, detail + f" > {MAX_DROPPED_SHARE:.0%}: raise MAX_STALENESS or lower the rollout concurrency"
    return True, detail


class StalenessWatch:
    """Marks the smoke's `staleness` stage once the async rows of steps 2-3 are in."""

    def __init__(self, mark: Callable[..., Any]) -> None:
        self.mark = mark
        self.rows: list[dict[str, Any]] = []
        self.judged = False

    def observe(self, row: dict[str, Any]) -> None:
        step = row.get("step") or 0
        if step in JUDGED_STEPS:
            self.rows.append(row)
        if not self.judged and step >= max(JUDGED_STEPS):
            self.judged = True
            ok, detail = staleness_verdict(self.rows)
            self.mark("staleness", None, detail, ok=ok)
