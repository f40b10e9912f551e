"""ROLLOUTS=sync: TRL's GRPOTrainer with the stack's rollout loop (trainer.rollouts.rollout_loop), timers for the
step-time split, rollout traces, infra-failure masking and the weight-sync hooks of the GPU side."""

from __future__ import annotations

import time

from contract.config import RunConfig
from trainer.core.dist import log


def make_trainer_class():
    from trl import GRPOTrainer

    from trainer.rollouts import infra_failures, resample, traces, zero_variance
    from contract import stages
    from trainer.gpu.trl_hooks import check_served_weights
    from trainer.core.metrics import STATS
    from trainer.rollouts.rollout_loop import make_rollout_loop_class

    class InstrumentedGRPOTrainer(make_rollout_loop_class(GRPOTrainer)):
        """GRPOTrainer with the stack's rollout loop (concurrent tool rounds, processes in step) and timers for
        the step-time split (generation vs the rest of rollout scoring)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            from trainer.modeling import lora

            lora.keep_adapters_fp32(self.model)  # QLoRA: fp32 adapters, undoing TRL's bf16 cast (lora.py says why)
            from trainer.core.off_policy import Window

            self._off_policy_window = Window()  # the off_policy/* figures of the logging window

        last_tokens: list[int] | None = None  # tokens the model generated in each rollout of the last batch

        def _generate(self, prompts):
            """TRL's; keeps each rollout's generated-token count (TRL logs only the mean): held-out episodes report it
            (trainer.run.held_out). result[1]: completion ids, result[2]: the tool mask (1 on the model's tokens)."""
            result = super()._generate(prompts)
            completion_ids, tool_mask = result[1], result[2]
            self.last_tokens = ([sum(m) for m in tool_mask] if tool_mask is not None
                                else [len(ids) for ids in completion_ids])
            return result

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            with STATS.timer("generation"):
                result = super()._generate_single_turn(*args, **kwargs)
            stages.mark("first_generation", time.perf_counter() - start, "first batch of first turns generated")
            return result

        def configure_traces(self, run_dir, every: int, samples: int, trackers=None) -> None:
            self._trace_dir, self._trace_every, self._trace_samples = run_dir, every, samples
            self._trace_trackers = trackers  # trainer.core.trackers.Trackers: the traces as tables (trackio, W&B)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            """TRL's, then (the first step and every TRACE_EVERY steps) a sample of the batch's rollouts to
            rollouts.jsonl (trainer.rollouts.traces). Every process reaches this together for the same step, so gathering here keeps them in step."""
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            # episodes the env side ended: no reward, out of the baseline (trainer.rollouts.infra_failures)
            rewards_per_func = infra_failures.leave_out_rewards(self, rewards_per_func)
            if getattr(self, "judge_on", False):  # failed judge calls likewise (trainer.judge.leave_out)
                from trainer.judge.leave_out import leave_out_failed

                rewards_per_func = leave_out_failed(self, rewards_per_func)
            zero_variance.leave_out_of_normaliser(self, rewards_per_func)  # ZERO_STD_GROUPS=drop: flat groups too
            every = getattr(self, "_trace_every", 0)
            step = self.state.global_step + 1  # the optimizer step this batch trains
            if self.model.training and traces.traced(step, every) and step != getattr(self, "_traced_step", None):
                self._traced_step = step
                self._trace(step, prompts, completions, rewards_per_func)
            return rewards_per_func

        def _trace(self, step, prompts, completions, rewards_per_func) -> None:
            import math

            from accelerate.utils import gather_object

            weights = self.reward_weights.tolist()
            per_func = [dict(zip(self.reward_func_names, row)) for row in rewards_per_func.cpu().tolist()]
            total = [sum(w * v for w, v in zip(weights, row.values()) if not math.isnan(v)) for row in per_func]
            mine = traces.rows(step, prompts, completions, self.environments or [], per_func, total)
            every_process = gather_object(mine) if self.accelerator.num_processes > 1 else mine
            if self.accelerator.is_main_process:
                traces.append(self._trace_dir, every_process[: self._trace_samples])
                if getattr(self, "_trace_trackers", None) is not None:
                    self._trace_trackers.log_rollouts(step, every_process[: self._trace_samples])

        def _load_optimizer_and_scheduler(self, checkpoint):
            """Several CPU ranks (gloo): transformers maps the optimizer state to args.device, `cpu:<rank>`,
            which torch.load cannot restore to; plain `cpu` is the same memory."""
            if checkpoint is None or self.args.world_size == 1 or self.args.device.type != "cpu":
                return super()._load_optimizer_and_scheduler(checkpoint)
            import torch

            original = torch.load

            def load_on_cpu(*args, map_location=None, **kwargs):
                return original(*args, map_location=None if map_location is None else "cpu", **kwargs)

            torch.load = load_on_cpu
            try:
                return super()._load_optimizer_and_scheduler(checkpoint)
            finally:
                torch.load = original

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            """TRL's loss, unchanged (OFF_POLICY_CORRECTION reaches it as GRPOConfig fields), with the policy's
            per-token log-probs captured for the off_policy/* figures (trainer.core.off_policy)."""
            captured = []
            original = self._get_per_token_logps_and_entropies

            def capture(*args, **kwargs):
                result = original(*args, **kwargs)
                captured.append(result[0])
                return result

            self._get_per_token_logps_and_entropies = capture  # this call only: the instance attribute goes after
            try:
                loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            finally:
                del self._get_per_token_logps_and_entropies
            if self.model.training and captured:
                from trainer.core import off_policy

                rho, bounded, weight, staleness = off_policy.sync_token_figures(self, captured[0], inputs)
                self._off_policy_window.add(rho, bounded, weight, self.accelerator, staleness)
            return loss

        def log(self, logs, start_time=None):
            if self.model.training:
                logs.update(self._off_policy_window.drain())
            super().log(logs, start_time)

        def _generate_and_score_completions(self, inputs, *args, **kwargs):
            def one_round(batch):
                with STATS.timer("generate_and_score"):
                    output = super(InstrumentedGRPOTrainer, self)._generate_and_score_completions(batch, *args,
                                                                                                   **kwargs)
                check_served_weights()  # server mode: these came from the weights pushed last, not a restarted vLLM's
                output = infra_failures.leave_out_of_loss(self, output)  # and out of the loss
                zero_variance.log_share(self)  # frac_reward_zero_std as the async worker counts it (float64)
                return output

            output = resample.refill(self, inputs, one_round)  # ZERO_STD_GROUPS=resample: more rounds; else one
            self._log_masked_fraction(output)
            return output

        def _log_masked_fraction(self, output) -> None:
            """TRL's `*_mask` modes zero the importance-sampling ratio of what they mask but log no share of it:
            log the share of sequences (sequence_mask) or completion tokens (token_mask) masked
            (contract.sampling_health judges it). Every process reaches this together: the gather is safe."""
            ratio = output.get("importance_sampling_ratio")
            if ratio is None or not self.vllm_importance_sampling_mode.endswith("_mask"):
                return
            import torch

            from contract.sampling_health import MASKED_FRACTION

            if self.vllm_importance_sampling_mode.startswith("sequence"):  # (B, 1): one ratio per sequence
                masked, count = (ratio == 0).sum(), ratio.new_tensor(ratio.numel())
            else:
                valid = output["completion_mask"].bool()
                if output.get("tool_mask") is not None:
                    valid &= output["tool_mask"].bool()
                masked, count = ((ratio == 0) & valid).sum(), valid.sum()
            totals = self.accelerator.gather(torch.stack([masked.float(), count.float()]).unsqueeze(0)).sum(0)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode][MASKED_FRACTION].append((totals[0] / totals[1].clamp(min=1)).item())

    return InstrumentedGRPOTrainer


def build_sync_trainer(cfg: RunConfig, model, tokenizer, dataset, factories, reward_funcs, callbacks,
                        training_args, server_max_model_len, served_dtype, trackers):
    """ROLLOUTS=sync: TRL's GRPOTrainer with the stack's rollout loop, traces and weight-sync hooks."""
    from trainer.modeling import lora
    from trainer.core.metrics import STATS

    trainer = make_trainer_class()(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=factories,
        peft_config=lora.peft_config(cfg),  # None: full fine-tuning; else TRL wraps the model, saves the adapter only
        callbacks=callbacks,
    )
    trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency, server_max_model_len)
    trainer.configure_traces(cfg.run_dir, cfg.trace_every, cfg.trace_samples or cfg.num_generations, trackers)
    trainer.zero_std_groups = cfg.zero_std_groups  # trainer.rollouts.zero_variance
    trainer.zero_std_resample_max = cfg.zero_std_resample_max  # trainer.rollouts.resample
    trainer._off_policy_window.cap = cfg.off_policy().weight_cap(False, trainer.epsilon_high)  # off_policy/weight_cap
    if cfg.placement.uses_vllm:
        from trainer import gpu

        gpu.instrument_weight_sync(trainer, lambda seconds: STATS.add_time("weight_sync", seconds),
                                   timeout_s=cfg.weight_sync_timeout_s)
        from trainer.gpu import push_path

        pushed = push_path.install(trainer, cfg.qlora, served_dtype)  # the checks push through the same hooks
        if cfg.placement.colocated:  # server mode's is marked by the preflight, from /server_info
            from trainer.gpu.colocate import scheduler
            from trainer.gpu.server_checks import mark_scheduler

            mark_scheduler(scheduler(trainer.vllm_generation), "the colocated engine's scheduler_config", cfg)
        if pushed:
            autocast = ", bf16 autocast" if training_args.bf16 else ""  # off only where the trainer runs on CPU
            log(f"weights: fp32 master weights{autocast}; each push to vLLM is cast to {pushed}")
    return trainer
