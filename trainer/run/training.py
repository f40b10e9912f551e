"""A training run, start to end (`python -m trainer.train`, trainer/train.py).

config -> resume decision -> preflight -> model + dataset + env factories -> GRPOTrainer.train().
Writes OUTPUT_DIR/RUN_NAME/{checkpoint-N/, metrics.jsonl, rollouts.jsonl, tensorboard/} (+ REPORT_TO's trackers; with
EVAL_EVERY checkpoint-best/ and eval/<env>/... in metrics.jsonl: trainer.run.evaluation).
Exit codes: 0 done, 2 bad config, 3 preflight failed, 4 another trainer holds the run folder (trainer.run.run_lock),
5 too little disk for a checkpoint (stopped before saving), 6 an env is down (trainer.rollouts.infra_failures),
78 the judge is down (trainer.judge.costs: EXIT_JUDGE_DOWN),
143 stopped by SIGTERM/Ctrl-C (checkpoint saved).
"""

from __future__ import annotations

import os
import sys

from contract.config import off_policy
from contract.config import ConfigError, RunConfig
from trainer.core import grpo_args, hang_dump
from trainer.run.control import make_control_callback, stop_on_signals
from trainer.run.dataset import build_dataset
from trainer.core.dist import log
from trainer.run.grpo_trainer import build_sync_trainer
from trainer.modeling.model import (attention_line, generation_config_of, load_model_and_tokenizer, load_tokenizer,
                                published_dtype)
from trainer.run.resume import prepare_run_dir
from trainer.run.summary import print_env_sessions, print_summary


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    hang_dump.install()
    try:
        cfg = RunConfig.load(argv)
    except ConfigError as exc:
        print(f"[train] config error:\n{exc}", file=sys.stderr, flush=True)
        return 2
    from trainer.core import trackers

    trackers.prepare_env(cfg.trackers, cfg.output_dir)
    cfg = grpo_args.resolve(cfg)  # TRAIN_MODE=auto resolved once, here: the code below asks cfg.placement
    chosen = cfg.placement
    model_name = cfg.model_id
    if not chosen.uses_vllm:
        log(f"TRAIN_MODE=cpu: CPU profile with the tiny local model {model_name} (transformers generation, "
            "no vLLM); this proves the loop, not a useful policy. Use a GPU host for real training.")
    else:
        from trainer import gpu  # light at import; vllm itself loads later

        log(f"{gpu.describe_mode(cfg)}; model {model_name}")
    log(f"envs {', '.join(cfg.env_names)}; run dir {cfg.run_dir}")
    problem = cfg.lora_problem()  # the rules that need TRAIN_MODE=auto resolved
    if problem:
        print(f"[train] config error:\n{problem}", file=sys.stderr, flush=True)
        return 2
    log(f"training: {cfg.training_description()}, learning rate {cfg.effective_learning_rate:g}")
    correction = cfg.off_policy()  # OFF_POLICY_CORRECTION (contract/config/off_policy.py)
    log(correction.describe() + ("" if chosen.uses_vllm or cfg.rollouts.is_async else
                                 " (CPU profile: the trainer samples with its own policy; the ratio is 1 unless "
                                 "STEPS_PER_GENERATION > GRADIENT_ACCUMULATION_STEPS)"))
    if not correction.bounded:
        log(f"WARNING {off_policy.UNBOUNDED_WARNING}")

    from trainer.core import dist
    from trainer.run import preflight

    dist.init(chosen.trainer_on_cpu)
    problem = cfg.rollouts_problem(dist.world_size())
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
                report = preflight.run_all(cfg, num_processes=dist.world_size())
            except preflight.PreflightError as exc:
                print(f"[preflight] FAILED:\n{exc}", file=sys.stderr, flush=True)
                verdict = (3, resume_ckpt, resume_step)
            else:
                from trainer.run import run_info

                # base model, envs, settings: for the model card of `make export`
                run_info.write(cfg, published_dtype(cfg))
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
    from trainer.core.metrics import STATS, MetricsCallback
    from trainer.core.trackers import RunInfo, Trackers

    if cfg.rollouts.is_async:
        model, tokenizer = None, load_tokenizer(cfg)  # TRL's async trainer loads the model itself
    else:
        vllm_kwargs: dict = {}
        if chosen.uses_vllm:
            from trainer import gpu

            vllm_kwargs = gpu.grpo_vllm_kwargs(cfg)
        training_args = grpo_args.grpo_config(cfg, **vllm_kwargs)
        model, tokenizer = load_model_and_tokenizer(cfg)
        log(attention_line(model))
    dataset = build_dataset(cfg, report.specs)
    factories = build_factories(cfg, report.specs, STATS)
    trackers = Trackers(cfg.trackers, RunInfo(cfg.run_dir, cfg.resolved_run_name, cfg.output_dir,
                                              config=cfg.model_dump(mode="json"), resume_step=resume_step,
                                              wandb_mode=cfg.wandb_mode, mlflow_tracking_uri=cfg.mlflow_tracking_uri))
    control = make_control_callback()
    stop_on_signals(control)

    import transformers
    from transformers.trainer_callback import PrinterCallback

    transformers.utils.logging.disable_progress_bar()  # no "Writing model shards" bars in docker logs
    from trainer.rollouts.rewards import stop_token_ids, unfinished_penalty

    stop_ids = stop_token_ids(model if model is not None else generation_config_of(cfg), tokenizer)
    reward_funcs = ([unfinished_penalty(cfg.unfinished_penalty, stop_ids)]
                    if cfg.unfinished_penalty else [])  # the env's own reward comes from its tool class
    judge_setup = None
    if cfg.judge_on:  # the judge's score beside the env's (trainer.judge): its own column, weighed (leave_out)
        from trainer.judge.reward import judge_reward
        from trainer.judge.setup import from_config

        judge_setup = from_config(cfg, dist.from_main(report.judge_model if dist.is_main() else None))
        reward_funcs.append(judge_reward(judge_setup))
        log(judge_setup.describe(cfg.judge_weight, cfg.env_reward_weight))
    from trl.trainer.utils import get_callable_name

    passed_names = [get_callable_name(f) for f in reward_funcs]  # TRL's column names of the functions passed in
    evaluation = None  # EVAL_EVERY: held-out episodes every N steps, checkpoint-best
    if cfg.rollouts.eval_every:
        from trainer.run.evaluation import AsyncEvalCallback, EvalCallback
        from trainer.run.held_out import held_out

        kind = AsyncEvalCallback if cfg.rollouts.is_async else EvalCallback
        evaluation = kind(cfg, held_out(cfg, report.specs, cfg.rollouts.eval_episodes), STATS)
    # the evaluation after the step's timer (MetricsCallback) and before the control's disk check of the save it asks
    from trainer.judge.costs import COSTS

    COSTS.drain()  # the steps' judge figures are this run's: not preflight's test call, nor an earlier run in this process
    callbacks = [MetricsCallback(cfg.run_dir, STATS, resume_step=resume_step, mode=chosen, trackers=trackers,
                                 rollouts=cfg.rollouts, figures=COSTS.drain if cfg.judge_on else None),
                 *([evaluation] if evaluation else []), control]
    if cfg.rollouts.is_async:
        from trainer.async_grpo import async_trainer

        trainer = async_trainer.build_trainer(cfg, tokenizer=tokenizer, dataset=dataset, factories=factories,
                                              reward_funcs=reward_funcs or None, callbacks=callbacks,
                                              served_dtype=served_dtype, served_model=served_model,
                                              server_max_model_len=server_max_model_len)
        trainer.configure_traces(cfg.run_dir, cfg.trace_every, cfg.trace_samples or cfg.num_generations, trackers)
        if judge_setup is not None:  # TRL's worker sums its columns unweighted: the stack's loop weighs them again
            trainer.configure_weights(passed_names, cfg.judge_weight, cfg.env_reward_weight)
        if evaluation is not None:
            evaluation.bind(trainer)
    else:
        trainer = build_sync_trainer(cfg, model, tokenizer, dataset, factories, reward_funcs or None, callbacks,
                                     training_args, server_max_model_len, served_dtype, trackers)
        if judge_setup is not None:
            from trainer.judge.leave_out import apply_weights

            apply_weights(trainer, passed_names, cfg.judge_weight, cfg.env_reward_weight)
        if evaluation is not None:
            evaluation.bind(trainer)
    trainer.remove_callback(PrinterCallback)  # MetricsCallback prints one readable line per step instead

    from trainer.rollouts.envs_binding import sessions_closed
    from trainer.rollouts.infra_failures import EnvDown
    from trainer.judge.costs import JudgeDown

    try:
        with sessions_closed("trainer"):  # every way out frees the env slots (the async worker closes its own)
            trainer.train(resume_from_checkpoint=resume_ckpt)
            print_env_sessions(cfg, factories)  # how the sessions spread, while they are still open
    except EnvDown as exc:  # a dead env, not a blip (trainer.rollouts.infra_failures): one line, resume once it is back
        print(f"[train] stopped: {exc}", file=sys.stderr, flush=True)
        return 6
    except JudgeDown as exc:  # the judge failed every call for JUDGE_DOWN_AFTER_S (trainer.judge.costs)
        from contract.defaults import EXIT_JUDGE_DOWN

        print(f"[train] stopped: {exc}", file=sys.stderr, flush=True)
        return EXIT_JUDGE_DOWN
    except Exception as exc:
        if not chosen.server:
            raise
        from trainer.gpu import push_state
        from contract.defaults import EXIT_VLLM_WENT_AWAY
        from trainer.gpu.server import gone_line, went_away

        why = went_away(exc, cfg.vllm_server_url)
        if why is None:
            raise
        # vLLM restarted or died mid-run: it serves base weights (or nothing) now. The host restarts it and the
        # trainer resumes from its last checkpoint, whose first generation pushes the resumed weights.
        push_state.clean_finish()  # the host restarts it anyway: no marker asking for a second restart
        print(gone_line(cfg.vllm_server_url, why, EXIT_VLLM_WENT_AWAY), file=sys.stderr, flush=True)
        return EXIT_VLLM_WENT_AWAY
    if chosen.server:  # no push in flight: the next run needs no vLLM restart (trainer.gpu.push_state)
        from trainer.gpu import push_state

        push_state.clean_finish()
    step = trainer.state.global_step
    if control.disk_short:
        log(f"stopped at step {step} without saving it: {control.disk_short}")
        return 5
    if control.stop_requested:
        log(f"stopped at step {step}; checkpoint saved in {cfg.run_dir}; run again to resume")
        return 143
    if dist.is_main():
        print_summary(cfg, step)
    return 0
