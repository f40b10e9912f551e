"""ROLLOUTS=async: the off-policy correction (OFF_POLICY_CORRECTION) as a hook on TRL 1.16's
`AsyncGRPOTrainer.compute_loss`.

TRL's async loss is the PPO-clip term against the sampler's log-probs, -min(r·A, clip(r)·A) with r = π_θ/π_sampler,
unbounded for a negative advantage (contract/config/off_policy.py). `OffPolicyLoss`, a mixin placed before
AsyncGRPOTrainer, keeps everything TRL's compute_loss does (the packed tree forward, its figures: ratio, kl, entropy,
clip_ratio/*; the step's token accounting) by running it with the model call captured, then rebuilds the policy term
from the captured log-probs under the run's correction (trainer.core.off_policy.corrected_loss), normalised as TRL
normalises it: summed over the trained tokens, divided by the tokens per rank and the accumulation steps, plus the
MoE router loss where TRL adds one. With OFF_POLICY_CORRECTION=none TRL's loss is returned as it is. Every step also
logs the off_policy/* figures (trainer.core.off_policy.FIGURES).

PINNED (trainer/core/trl_privates.py): TRL's compute_loss calls its `model` argument once, as
`model(input_ids=, position_ids=, shift_labels=, fused_lm_head=True, ...)` returning `.log_probs` (and `.aux_loss`),
selects trained tokens by `token_index >= 0` and normalises as above (its source digest); `epsilon_low`,
`epsilon_high`, `aux_loss_enabled`, `router_aux_loss_coef`, `current_gradient_accumulation_steps` are read.
"""

from __future__ import annotations

from typing import Any

from contract.config.off_policy import OffPolicy
from trainer.core.off_policy import Window, corrected_loss


class OffPolicyLoss:
    """Mixin for the async trainer subclass (before AsyncGRPOTrainer); see the module docstring."""

    off_policy: OffPolicy = OffPolicy("none")  # the run's, set by the subclass's __init__
    _off_policy_window: Window | None = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        captured: list[Any] = []

        def forward(*args, **kwargs):
            outputs = model(*args, **kwargs)
            captured.append(outputs)
            return outputs

        trl_loss = super().compute_loss(forward, inputs, return_outputs, num_items_in_batch)
        (outputs,) = captured  # TRL's compute_loss forwards once (pinned)
        selected = inputs["token_index"] >= 0
        log_probs = outputs.log_probs.flatten()[inputs["token_index"][selected]]
        per_token_loss, bounded, weight = corrected_loss(
            log_probs, inputs["old_log_probs"][selected], inputs["advantages"][selected],
            inputs["segment_id"][selected], self.off_policy, self.epsilon_low, self.epsilon_high)
        if self.model.training:
            if self._off_policy_window is None:
                self._off_policy_window = Window(self.off_policy.weight_cap(True, self.epsilon_high))
            rho = (log_probs.detach() - inputs["old_log_probs"][selected]).exp()
            self._off_policy_window.add(rho, bounded, weight, self.accelerator)
        if self.off_policy.name == "none":
            return trl_loss
        gas = self.current_gradient_accumulation_steps
        tokens_per_rank = (inputs["global_n_tokens"][0] / self.accelerator.num_processes).clamp(min=1.0)
        loss = per_token_loss.sum() / tokens_per_rank.float() / gas
        if self.aux_loss_enabled:
            loss = loss + self.router_aux_loss_coef * outputs.aux_loss / gas
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training and self._off_policy_window is not None:
            logs.update(self._off_policy_window.drain())
            if "async/staleness_max" in logs:  # AfterRun's (its log runs first): the same figure under the common key
                logs["off_policy/staleness_max"] = logs["async/staleness_max"]
        super().log(logs, start_time)
