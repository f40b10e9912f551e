"""Training entrypoint: `python -m trainer.train [--max-steps 3 ...]`.

config -> resume decision -> preflight -> model + dataset + env factories -> GRPOTrainer.train().
Writes OUTPUT_DIR/RUN_NAME/{checkpoint-N/, metrics.jsonl, rollouts.jsonl, tensorboard/} (+ REPORT_TO's trackers).
Exit codes: 0 done, 2 bad config, 3 preflight failed, 4 another trainer holds the run folder (trainer.run.run_lock),
5 too little disk for a checkpoint (stopped before saving), 143 stopped by SIGTERM/Ctrl-C (checkpoint saved).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

from envs.core.untrusted import log_text
from trainer.run import checkpoints
from contract.config import ConfigError, RunConfig
from trainer.run import grpo_args



def log(msg: str) -> None:
    """Once per run: on the main process when several train (trainer.run.dist)."""
    from trainer.run import dist

    if dist.is_main():
        print(f"[train] {msg}", flush=True)


# ---------------------------------------------------------------------------- resume
def prepare_run_dir(cfg: RunConfig) -> tuple[str | None, int]:
    """Apply RESUME: fresh wipes the run folder; auto picks the last complete checkpoint and dedupes metrics."""
    from trainer.run.metrics import truncate_metrics

    run_dir = Path(cfg.run_dir)
    if cfg.resume == "fresh" and run_dir.exists():
        log(f"RESUME=fresh: deleting {run_dir} and starting over")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, step, incomplete = checkpoints.last_complete(run_dir)
    for path, why in incomplete:  # cut short by a kill mid-save: unusable, and it would shadow the good one
        log(f"removing incomplete {path.name}: {why}" + (f"; resuming from {ckpt.name}" if ckpt else ""))
        shutil.rmtree(path, ignore_errors=True)
    if ckpt is None:
        dropped = truncate_metrics(run_dir, 0)
        if dropped:
            log(f"no checkpoint yet: dropped {dropped} metric records of an earlier attempt")
        log(f"starting fresh in {run_dir}")
        return None, 0
    dropped = truncate_metrics(run_dir, step)
    log(f"resuming from {ckpt} (step {step} of {cfg.max_steps}); set RESUME=fresh to start over"
        + (f"; dropped {dropped} metric records logged after that checkpoint" if dropped else ""))
    return str(ckpt), step


# ---------------------------------------------------------------------------- data
def build_dataset(cfg: RunConfig, specs: dict):
    """Rows from each env's make_dataset; multi-env rows carry an `environment` column (TRL routes on it)."""
    from datasets import Dataset

    from trainer.rollouts.envs_binding import encode_row

    multi = len(cfg.env_names) > 1
    rows = []
    for i, name in enumerate(cfg.env_names):
        spec = specs[name]
        for row in spec.make_dataset(cfg.dataset_size, cfg.seed + i):
            enc = encode_row(dict(row))
            if multi:
                enc["environment"] = name
            rows.append(enc)
    ds = Dataset.from_list(rows)
    return ds.shuffle(seed=cfg.seed) if multi else ds


# ---------------------------------------------------------------------------- trainer
def make_trainer_class():
    from trl import GRPOTrainer

    from trainer.rollouts import infra_failures
    from contract import stages
    from trainer.run.metrics import STATS
    from trainer.rollouts.rollout_loop import make_rollout_loop_class

    class InstrumentedGRPOTrainer(make_rollout_loop_class(GRPOTrainer)):
        """GRPOTrainer with the stack's rollout loop (concurrent tool rounds, processes in step) and timers for
        the step-time split (generation vs the rest of rollout scoring)."""

        def _generate_single_turn(self, *args, **kwargs):
            start = time.perf_counter()
            with STATS.timer("generation"):
                result = super()._generate_single_turn(*args, **kwargs)
            stages.mark("first_generation", time.perf_counter() - start, "first batch of first turns generated")
            return result

        def configure_traces(self, run_dir, every: int, samples: int, trackers=None) -> None:
            self._trace_dir, self._trace_every, self._trace_samples = run_dir, every, samples
            self._trace_trackers = trackers  # trainer.run.trackers.Trackers: the traces as tables (trackio, W&B)

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            """TRL's, then (every TRACE_EVERY steps) a sample of the batch's rollouts to rollouts.jsonl (trainer.rollouts.traces).
            Every process reaches this together for the same step, so gathering here keeps them in step."""
            rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            # episodes the env side ended: no reward, out of the baseline (trainer.rollouts.infra_failures)
            rewards_per_func = infra_failures.leave_out_rewards(self, rewards_per_func)
            every = getattr(self, "_trace_every", 0)
            step = self.state.global_step + 1  # the optimizer step this batch trains
            if self.model.training and every and step % every == 0 and step != getattr(self, "_traced_step", None):
                self._traced_step = step
                self._trace(step, prompts, completions, rewards_per_func)
            return rewards_per_func

        def _trace(self, step, prompts, completions, rewards_per_func) -> None:
            import math

            from accelerate.utils import gather_object

            from trainer.rollouts import traces

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

        def _generate_and_score_completions(self, *args, **kwargs):
            with STATS.timer("generate_and_score"):
                output = super()._generate_and_score_completions(*args, **kwargs)
            output = infra_failures.leave_out_of_loss(self, output)  # and out of the loss
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


def make_control_callback():
    from transformers import TrainerCallback

    class RunControl(TrainerCallback):
        """Save at the last step (not only every SAVE_STEPS) and on SIGTERM (docker stop), then stop."""

        def __init__(self) -> None:
            self.stop_requested = False
            self.disk_short: str | None = None  # why a save could not start (trainer.run.checkpoints.check_free_space)

        def request_stop(self, signum, frame) -> None:
            if self.stop_requested and signum == signal.SIGINT:
                raise KeyboardInterrupt  # second Ctrl-C: stop now, resume from the last saved checkpoint
            self.stop_requested = True
            log(f"{signal.Signals(signum).name}: saving a checkpoint after this step, then stopping "
                "(run again to resume" + ("; Ctrl-C again to stop without saving)" if signum == signal.SIGINT else ")"))

        def on_step_end(self, args, state, control, **kwargs):
            from trainer.run import dist

            if state.global_step >= state.max_steps:
                control.should_save = True
            # Each process gets the signal on its own, maybe a step apart: all stop after the same step, or the
            # ones still training would wait in a collective for the others until the launcher kills them.
            if dist.any_rank(self.stop_requested, args.device):
                control.should_save = True
                control.should_training_stop = True
            if control.should_save:  # the same on every process (by step, or agreed above)
                short = self._check_disk(args, kwargs.get("model")) if state.is_world_process_zero else None
                if dist.any_rank(short is not None, args.device):
                    self.disk_short = short or "rank 0 found too little disk for the checkpoint"
                    control.should_save = False  # a half-written checkpoint would cost more than this step
                    control.should_training_stop = True
            return control

        @staticmethod
        def _check_disk(args, model) -> str | None:
            run_dir = Path(args.output_dir)
            # what a checkpoint holds: every weight, or the adapter alone (LoRA: the frozen base is not saved)
            params = (sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
                      if model is not None else 0)
            try:
                checkpoints.check_free_space(run_dir, checkpoints.save_estimate(run_dir, params, args.save_only_model))
            except checkpoints.CheckpointError as exc:
                return str(exc)
            return None

        def on_save(self, args, state, control, **kwargs):
            # The weights are saved owner-only (a temp file renamed); like the rest of the run folder they are for
            # readers under other uids too: `make export` runs as the host user, `vllm serve` as its own.
            from trainer.run import dist

            dist.any_rank(False, args.device)  # a barrier: every process has written its files (rng_state_<rank>)
            if state.is_world_process_zero:
                folder = Path(args.output_dir) / f"{checkpoints.PREFIX}{state.global_step}"
                for path in folder.rglob("*"):
                    path.chmod(path.stat().st_mode | 0o444)
                checkpoints.seal(folder, state.global_step)  # complete only now: synced, then marked

    return RunControl()


def published_dtype(cfg: RunConfig, mode: str) -> str | None:
    """The dtype the base model is published in (its config.json), for run.json: checkpoints hold the fp32 master
    weights, `make export` writes them back in this dtype."""
    from transformers import AutoConfig

    try:
        dtype = AutoConfig.from_pretrained(cfg.model_path(mode), **cfg.model_load_kwargs(mode)).dtype
    except (OSError, ValueError):  # no readable config: the export then keeps the checkpoint's dtype
        return None
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def load_model_and_tokenizer(cfg: RunConfig, mode: str):
    import torch
    from transformers import AutoModelForCausalLM

    name = cfg.model_path(mode)
    tokenizer = load_tokenizer(cfg, mode)
    # fp32 master weights in every layout; GRPOConfig(bf16=True) runs the forward and backward under bf16 autocast.
    # bf16 weights would not train: at lr 1e-5 an AdamW step rounds back to the same bf16 value for any |w| above
    # ~0.004 (norm weights, most matrix entries). Pushes to vLLM are cast to its dtype (gpu.push_in_served_dtype).
    # QLoRA: the frozen base in 4 bits (bf16 for what stays unquantized); TRL keeps the adapters trainable.
    from trainer.run import lora

    dtype = torch.bfloat16 if cfg.qlora else torch.float32
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **cfg.model_load_kwargs(mode),
                                                 **lora.quantization_kwargs(cfg))
    return model, tokenizer


def load_tokenizer(cfg: RunConfig, mode: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model_path(mode), **cfg.model_load_kwargs(mode))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def generation_config_of(cfg: RunConfig, mode: str):
    """What stop_token_ids reads off a model (its generation config), without loading the weights (async: TRL
    loads the model itself)."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    try:
        config = GenerationConfig.from_pretrained(cfg.model_path(mode), **cfg.model_load_kwargs(mode))
    except OSError:  # no generation_config.json: the tokenizer's eos and pad only
        config = None
    return SimpleNamespace(generation_config=config)


def _build_sync_trainer(cfg: RunConfig, mode: str, model, tokenizer, dataset, factories, reward_funcs, callbacks,
                        training_args, server_max_model_len, served_dtype, trackers):
    """ROLLOUTS=sync: TRL's GRPOTrainer with the stack's rollout loop, traces and weight-sync hooks."""
    from trainer.run import lora
    from trainer.run.metrics import STATS

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
    if mode != "cpu":
        from trainer import gpu

        gpu.instrument_weight_sync(trainer, lambda seconds: STATS.add_time("weight_sync", seconds),
                                   timeout_s=cfg.weight_sync_timeout_s)
        if cfg.qlora:  # a 4-bit base must not be re-quantized by a merge at every push (trainer.run.lora)
            lora.push_without_merging(trainer)
        pushed = gpu.push_in_served_dtype(trainer, served_dtype)
        if pushed:
            autocast = ", bf16 autocast" if training_args.bf16 else ""  # off only where the trainer runs on CPU
            log(f"weights: fp32 master weights{autocast}; each push to vLLM is cast to {pushed}")
    return trainer


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        cfg = RunConfig.load(argv)
    except ConfigError as exc:
        print(f"[train] config error:\n{exc}", file=sys.stderr, flush=True)
        return 2
    from trainer.run import trackers

    trackers.prepare_env(cfg.trackers, cfg.output_dir)
    mode = grpo_args.resolved_train_mode(cfg)
    model_name = cfg.resolved_model_name(mode)
    if mode == "cpu":
        log(f"TRAIN_MODE=cpu: CPU profile with the tiny local model {model_name} (transformers generation, "
            "no vLLM); this proves the loop, not a useful policy. Use a GPU host for real training.")
    else:
        from trainer import gpu  # light at import; vllm itself loads later

        log(f"{gpu.describe_mode(cfg)}; model {model_name}")
    log(f"envs {', '.join(cfg.env_names)}; run dir {cfg.run_dir}")
    from contract import lora_rules

    problem = lora_rules.adapter_problem(cfg, mode)  # the rules that need TRAIN_MODE=auto resolved
    if problem:
        print(f"[train] config error:\n{problem}", file=sys.stderr, flush=True)
        return 2
    log(f"training: {lora_rules.describe(cfg)}, learning rate {cfg.resolved_learning_rate(mode):g}")

    from trainer.run import dist, preflight

    dist.init(cfg.trainer_on_cpu(mode))
    problem = cfg.rollouts_problem(mode, dist.world_size())
    if problem:
        print(f"[train] config error:\n{problem}", file=sys.stderr, flush=True)
        return 2
    verdict = None  # (exit code to stop with, or None to train; checkpoint; step): decided once, by rank 0
    if dist.is_main():
        from trainer.run import run_lock

        try:  # before RESUME=fresh deletes anything; held until this process exits
            run_lock.acquire(cfg.output_dir, cfg.resolved_run_name)
        except run_lock.RunLocked as exc:
            print(f"[train] {exc}", file=sys.stderr, flush=True)
            verdict = (4, None, 0)
    if dist.is_main() and verdict is None:
        resume_ckpt, resume_step = prepare_run_dir(cfg)
        verdict = (None, resume_ckpt, resume_step)
        if resume_step >= cfg.max_steps:
            log(f"already finished: step {resume_step} >= MAX_STEPS={cfg.max_steps}; nothing to do "
                "(raise MAX_STEPS to train further, or RESUME=fresh to start over)")
            verdict = (0, resume_ckpt, resume_step)
        else:
            try:
                report = preflight.run_all(cfg, mode, num_processes=dist.world_size())
            except preflight.PreflightError as exc:
                print(f"[preflight] FAILED:\n{exc}", file=sys.stderr, flush=True)
                verdict = (3, resume_ckpt, resume_step)
            else:
                from trainer.run import run_info

                # base model, envs, settings: for the model card of `make export`
                run_info.write(cfg, mode, published_dtype(cfg, mode))
    stop, resume_ckpt, resume_step = dist.from_main(verdict)
    if stop is not None:
        return stop
    if not dist.is_main():  # rank 0 checked servers, capacity for every process and the template
        report = preflight.resolve_envs(cfg)
    server_max_model_len = dist.from_main(report.server_max_model_len if dist.is_main() else None)
    served_dtype = dist.from_main(report.served_dtype if dist.is_main() else None)
    served_model = dist.from_main(report.served_model if dist.is_main() else None)

    import torch  # noqa: F401  (heavy imports only after the cheap checks passed)

    from trainer.rollouts.envs_binding import build_factories
    from trainer.run.metrics import STATS, MetricsCallback
    from trainer.run.trackers import RunInfo, Trackers

    if cfg.rollouts == "async":
        model, tokenizer = None, load_tokenizer(cfg, mode)  # TRL's async trainer loads the model itself
    else:
        vllm_kwargs: dict = {}
        if mode != "cpu":
            from trainer import gpu

            vllm_kwargs = gpu.grpo_vllm_kwargs(cfg)
        training_args = grpo_args.grpo_config(cfg, mode, **vllm_kwargs)
        model, tokenizer = load_model_and_tokenizer(cfg, mode)
    dataset = build_dataset(cfg, report.specs)
    factories = build_factories(cfg, report.specs, STATS)
    trackers = Trackers(cfg.trackers, RunInfo(cfg.run_dir, cfg.resolved_run_name, cfg.output_dir,
                                              config=cfg.model_dump(mode="json"), resume_step=resume_step,
                                              wandb_mode=cfg.wandb_mode, mlflow_tracking_uri=cfg.mlflow_tracking_uri))
    control = make_control_callback()
    signal.signal(signal.SIGTERM, control.request_stop)  # docker stop / compose down
    signal.signal(signal.SIGINT, control.request_stop)  # Ctrl-C in `make train`

    import transformers
    from transformers.trainer_callback import PrinterCallback

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in docker logs
    from trainer.rollouts.rewards import stop_token_ids, unfinished_penalty

    stop_ids = stop_token_ids(model if model is not None else generation_config_of(cfg, mode), tokenizer)
    reward_funcs = ([unfinished_penalty(cfg.unfinished_penalty, stop_ids)]
                    if cfg.unfinished_penalty else None)  # the env's own reward comes from its tool class
    callbacks = [MetricsCallback(cfg.run_dir, STATS, resume_step=resume_step, mode=mode, trackers=trackers,
                                 rollouts=cfg.rollouts), control]
    if cfg.rollouts == "async":
        from trainer.run import async_trainer

        trainer = async_trainer.build_trainer(cfg, mode, tokenizer=tokenizer, dataset=dataset, factories=factories,
                                              reward_funcs=reward_funcs, callbacks=callbacks,
                                              served_dtype=served_dtype, served_model=served_model)
        trainer.configure_traces(cfg.run_dir, cfg.trace_every, cfg.trace_samples or cfg.num_generations, trackers)
    else:
        trainer = _build_sync_trainer(cfg, mode, model, tokenizer, dataset, factories, reward_funcs, callbacks,
                                      training_args, server_max_model_len, served_dtype, trackers)
    trainer.remove_callback(PrinterCallback)  # MetricsCallback prints one readable line per step instead

    from trainer.rollouts.infra_failures import EnvDown

    try:
        trainer.train(resume_from_checkpoint=resume_ckpt)
    except EnvDown as exc:  # a dead env, not a blip (trainer.rollouts.infra_failures): one line, resume once it is back
        print(f"[train] stopped: {exc}", file=sys.stderr, flush=True)
        return 6
    if mode == "gpu":  # no push in flight: the next run needs no vLLM restart (trainer.gpu.push_state)
        from trainer.gpu import push_state

        push_state.clean_finish()
    step = trainer.state.global_step
    if control.disk_short:
        log(f"stopped at step {step} without saving it: {control.disk_short}")
        return 5
    bound = factories if isinstance(factories, dict) else {cfg.env_names[0]: factories}
    who = f"rank {dist.rank()}: " if dist.world_size() > 1 else ""  # every process opens its own sessions
    for name, cls in bound.items() if cfg.rollouts == "sync" else ():  # async: the sessions were the worker's
        if cls.replica_set is not None:  # TRL's pool: one instance (= one env session) per rollout slot
            print(f"[train] {who}env {name}: {log_text(cls.replica_set.describe())}", flush=True)
    if control.stop_requested:
        log(f"stopped at step {step}; checkpoint saved in {cfg.run_dir}; run again to resume")
        return 143
    if dist.is_main():
        _print_summary(cfg, step)
    return 0


def _print_summary(cfg: RunConfig, step: int) -> None:
    from trainer.run.metrics import read_metrics

    rows = read_metrics(cfg.run_dir)
    tail = rows[-5:]

    def mean(key):
        vals = [r[key] for r in tail if isinstance(r.get(key), (int, float))]
        return sum(vals) / len(vals) if vals else float("nan")

    calls = [r["tools/call_frequency"] for r in rows if isinstance(r.get("tools/call_frequency"), (int, float))]
    if calls:
        from contract import stages

        per_episode = sum(calls) / len(calls)
        stages.mark("tool_calls", None, f"{per_episode:.2f} tool calls per episode over {len(calls)} steps",
                    value=round(per_episode, 3))
    ckpts = sorted(p.name for p in Path(cfg.run_dir).glob(f"{checkpoints.PREFIX}*"))
    log(f"done: step {step}/{cfg.max_steps}; last {len(tail)} steps: reward {mean('reward'):.3f}, "
        f"tool calls/episode {mean('tools/call_frequency'):.2f}, tool failures {mean('tools/failure_frequency'):.2f}")
    log(f"checkpoints: {', '.join(ckpts) or 'none'}; metrics: {cfg.run_dir}/metrics.jsonl; "
        f"plot: make report RUN={cfg.resolved_run_name}")


if __name__ == "__main__":
    raise SystemExit(main())
