"""`make eval`: score a run's checkpoint and its base model on held-out episodes of each env, side by side.

    python -m trainer.evaluate --outputs /outputs [--run R] [--checkpoint C] [--tasks 32] [--threshold 0.5]
                               [RunConfig flags, e.g. --env-urls echo=http://...]

The run's settings are the ones its training recorded in <run>/run.json (trainer.run.run_info; RUN_SETTINGS below: its
envs, MODEL_NAME = the base model, NUM_GENERATIONS, MAX_COMPLETION_LENGTH, TEMPERATURE, the tool limits, ...); where
the env servers are and how to generate are this host's (.env, then flags; a flag given here wins over run.json too).
The checkpoint defaults to the run's last complete one (trainer.run.checkpoints).

Episodes are the trainer's own: each model is put in the trainer's GRPOTrainer subclass (trainer.train, with the
stack's rollout loop) bound to the run's real env servers (trainer.rollouts.envs_binding, as in training), which is never
trained; `_generate_and_score_completions` plays each batch exactly as a training step does (reset, generation,
tool rounds, the env's get_reward), in eval mode. So prompts, chat template, tool schemas, the tool loop, its limits
and the reward are the ones training used. Generation: transformers on the CPU profile (and wherever the trainer
runs on CPU); on GPU hosts vLLM inside this process on the checkpoint folder (TRL's vllm_mode="colocate" loads
`model.name_or_path`), each model in a process of its own so the first vLLM's memory is gone before the second starts.

Held-out tasks (trainer.run.held_out, as the evaluation during training takes them): NUM_GENERATIONS episodes per task
(pass@k for k = 1..NUM_GENERATIONS, contract.eval_report.pass_at_k), each task a seed training never used (they go to
eval.json's "seeds"); an env whose rows come from ENV_PROMPTS_FILE is scored on the rows of --prompts-file (their
indices are its "seeds"); an env that serves its own tasks (OpenEnv's Task API) on its test split, else its
validation split (the tasks' indices are its "seeds", the split is eval.json's "splits").

Reported per env and model (contract.eval_report's schema): the env's own episode reward (get_reward; the trainer's
UNFINISHED_PENALTY shaping is left out), success = reward above --threshold (default 0.5), pass@k, tool calls and
failed calls per episode (as the rollout loop counts them: calls of an unknown tool fail too) and tokens the model
generated per episode (tool results excluded, as TRL's completions/mean_length). Writes <run>/eval.json and prints
the table (contract.eval_report.markdown_table). Exit codes: 0 done, 1 no such run or checkpoint, 2 bad config or
flags, 3 an env server not ready, 4 (GPU hosts) too little free GPU memory for the eval: training, or another
eval, still holds the GPU (checked before vLLM loads: gpu_memory_verdict).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.modeling import lora
from trainer.run import checkpoints
from trainer.run.held_out import DEFAULT_THRESHOLD, Episode, held_out, play
from contract import eval_report
from contract.config import ColocateMode, ConfigError, RunConfig
from trainer.core.progress import Progress
from trainer.core import grpo_args

DEFAULT_TASKS = 32
PROGRESS_EVERY_S = 10.0


# Settings that make the run what it is, taken from its run.json (trainer.run.run_info) over .env: the envs and their
# prompts, the base model, how episodes are sampled, limited and scored, and the batch (so the sessions opened).
RUN_SETTINGS = ("env_name", "model_name", "model_revision", "enable_thinking", "seed", "dataset_size",
                "num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
                "max_completion_length", "max_tool_calling_iterations", "tool_timeout_s", "temperature",
                "unfinished_penalty", "env_instruction", "env_prompts_file", "env_reward", "env_observation_chars")


class EvalError(RuntimeError):
    """One line: what is wrong and what to do."""


def log(msg: str) -> None:
    print(f"[eval] {msg}", flush=True)


# ---------------------------------------------------------------------------- run and checkpoint
def pick_checkpoint(outputs: Path, run: str, checkpoint: str | None) -> tuple[Path, int]:
    """The checkpoint to score and its global step (trainer.run.checkpoints.pick), in a run that must exist."""
    run_dir = outputs / run
    if not run_dir.is_dir():
        runs = sorted(d.name for d in outputs.iterdir() if d.is_dir()) if outputs.is_dir() else []
        raise EvalError(f"no run {run!r} under {outputs} (runs: {', '.join(runs) or 'none'}); "
                        "pass RUN=<one of them>, or train first (`make train`)")
    try:
        return checkpoints.pick(run_dir, checkpoint)
    except checkpoints.CheckpointError as exc:
        raise EvalError(str(exc)) from None


# ---------------------------------------------------------------------------- scoring
def summarize(model: str, env: str, episodes: list[Episode], generations: int, threshold: float) -> dict[str, Any]:
    """One eval.json row: means over the scored episodes, pass@k over tasks (each played `generations` times).
    An episode the env side ended (its server died, its session was lost, a reply never came) is not the model's
    failure: it is left out of every figure and counted in `infra_failures`; `episodes` counts the scored ones, and
    pass@k for a task is taken over its scored episodes (a task with fewer than k of them is left out of pass@k)."""
    tasks: dict[int, list[Episode]] = {}
    for ep in episodes:
        tasks.setdefault(ep.task, []).append(ep)
    if any(len(group) != generations for group in tasks.values()):
        raise ValueError(f"every task needs {generations} episodes for pass@k")
    scored = [ep for ep in episodes if ep.infra_failure is None]
    n = len(scored)
    passed = [(len(ok), sum(ep.reward > threshold for ep in ok))
              for ok in ([ep for ep in group if ep.infra_failure is None] for group in tasks.values())]

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None  # every episode lost to the env: no figure

    def pass_rate(k: int) -> float | None:
        return mean([eval_report.pass_at_k(m, c, k) for m, c in passed if m >= k])

    return {
        "model": model, "env": env, "episodes": n, "infra_failures": len(episodes) - n,
        "mean_reward": mean([ep.reward for ep in scored]),
        "success_rate": mean([float(ep.reward > threshold) for ep in scored]),
        "pass_at_k": {str(k): pass_rate(k) for k in range(1, generations + 1)},
        "tool_calls_per_episode": mean([ep.calls for ep in scored]),
        "tool_failures_per_episode": mean([ep.failures for ep in scored]),
        "tokens_per_episode": mean([ep.tokens for ep in scored]),
    }


def split_note(rows: list[dict]) -> str:
    """` of split S` for the rows of an env that serves its own tasks, else nothing."""
    split = (rows[0].get("reset_kwargs") or {}).get("split") if rows else None
    return f" of its {split!r} split" if split else ""


def _generation_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """GRPOConfig kwargs for generation: none where the trainer runs on CPU (transformers generates); else vLLM
    colocated in this process on the model's folder, whatever TRAIN_MODE trained it (no vllm server, no weight sync
    needed), without TRL's importance-sampling forward pass (nothing is trained)."""
    if cfg.placement.trainer_on_cpu:
        return {}
    from trainer import gpu

    # server mode's VLLM_GPU_MEMORY_UTILIZATION is for vLLM's own GPU; here the model shares it (colocate's default)
    colocated = cfg.resolved(ColocateMode()).model_copy(update={
        "vllm_gpu_memory_utilization": cfg.vllm_gpu_memory_utilization if cfg.placement.colocated else None})
    return {**gpu.grpo_vllm_kwargs(colocated), "vllm_importance_sampling_correction": False}


def weights_bytes(model_dir: str | os.PathLike) -> int:
    """The model's weight files on disk (a checkpoint or a downloaded snapshot); 0 when it is not a local folder."""
    folder = Path(model_dir)
    return sum(p.stat().st_size for p in folder.glob("*.safetensors")) if folder.is_dir() else 0


def gpu_memory_verdict(free_b: int, total_b: int, vllm_share: float, model_b: int, device: str = "GPU 0") -> str | None:
    """None when the eval fits, else the one line to stop with. Each model is played in its own process: the trainer's
    copy of the weights, then vLLM, which refuses to start unless share x total is free."""
    need = vllm_share * total_b + model_b
    if free_b >= need:
        return None
    gb = 1e9
    return (f"{device}: {free_b / gb:.1f} of {total_b / gb:.1f} GB free, and the eval needs {need / gb:.1f} GB (vLLM's "
            f"{vllm_share:g} x {total_b / gb:.1f} GB + the model's {model_b / gb:.1f} GB): something still holds the "
            "GPU, most likely training (`make ps`); wait for it to finish or stop it (`make down`), then run "
            "`make eval` again")


def check_gpu_memory(cfg: RunConfig, models: list[str]) -> str | None:
    """On GPU hosts, before any vLLM loads: gpu_memory_verdict for the largest of the models played."""
    if cfg.placement.trainer_on_cpu:
        return None
    measured = _isolated(_cuda_memory)  # in a child: a CUDA context here would hold memory the models need
    if measured is None:
        return None  # no CUDA here: the model's own start fails with its message
    free_b, total_b, device = measured
    share = _generation_kwargs(cfg)["vllm_gpu_memory_utilization"]
    return gpu_memory_verdict(free_b, total_b, share, max(weights_bytes(m) for m in models), device)


def _cuda_memory() -> tuple[int, int, str] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    free_b, total_b = torch.cuda.mem_get_info()
    return free_b, total_b, f"GPU {torch.cuda.current_device()} ({torch.cuda.get_device_name()})"


def play_model(cfg: RunConfig, label: str, model_name: str,
               tasks: dict[str, tuple[list[int], list[dict]]], threshold: float) -> list[dict[str, Any]]:
    """Every held-out episode of every env for one model (`model_name`: a hub id / folder, or a checkpoint
    folder); one eval.json row per env."""
    from datasets import Dataset

    from envs.core.tool import close_session
    from trainer.rollouts.envs_binding import build_factories
    from trainer.rollouts.rewards import stop_token_ids, unfinished_penalty
    from trainer.run import preflight
    from trainer.run.grpo_trainer import make_trainer_class
    from trainer.run.held_out import encoded
    from trainer.modeling.model import load_model_and_tokenizer
    from trainer.core.trl_privates import environment_pool

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # no "Loading weights" bars between the progress lines
    report = preflight.resolve_envs(cfg)  # here too: a child process re-learns the generic envs' tools
    model_cfg = cfg if model_name == cfg.model_path else cfg.model_copy(
        update={"model_name": model_name, "model_revision": None})
    model, tokenizer = load_model_and_tokenizer(model_cfg)
    rows = [encoded(cfg, name, row) for name, (_, env_rows) in tasks.items() for row in env_rows]
    scratch = tempfile.mkdtemp(prefix="eval-")  # the trainer's output_dir: nothing is saved, never into the run
    trainer = make_trainer_class()(
        model=model,
        reward_funcs=([unfinished_penalty(cfg.unfinished_penalty, stop_token_ids(model, tokenizer))]
                      if cfg.unfinished_penalty else None),  # as training scores; the table reports the env's reward
        args=grpo_args.grpo_config(cfg, output_dir=scratch, **_generation_kwargs(cfg)),
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        environment_factory=build_factories(cfg, report.specs),
    )
    trainer.configure_rollouts(cfg.tool_timeout_s, cfg.tool_concurrency)
    trainer.model.eval()  # TRL's eval mode: no buffering, no traces (trainer.train traces training batches only)
    generations = cfg.num_generations
    out = []
    try:
        for name, (_, env_rows) in tasks.items():
            # as many sessions at once as training opened on this env (preflight checked the servers hold them)
            progress = Progress(f"{label} {name}", len(env_rows) * generations, "episodes", log, PROGRESS_EVERY_S)
            episodes = play(trainer, cfg, name, env_rows, generations, lambda done: progress.update(len(done)))
            out.append(summarize(label, name, episodes, generations, threshold))
            lost = [ep.infra_failure for ep in episodes if ep.infra_failure is not None]
            if lost:  # not the model's failures: said, counted, and out of the scores
                log(f"{label} {name}: {len(lost)} of {len(episodes)} episodes ended by the env side, left out of the "
                    f"scores (infra_failures in eval.json); last: {lost[-1]}")
    finally:
        for pool in environment_pool(trainer).values():  # free the sessions for the next model
            for env in pool:
                close_session(env)
    return out


def _isolated(fn, *args):
    """`fn(*args)` in a fresh process: vLLM's GPU memory goes back only when its process ends."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


# ---------------------------------------------------------------------------- entrypoint
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.splitlines()[0],
                                epilog="Other flags are RunConfig's, as for trainer.train (e.g. --env-urls).")
    p.add_argument("--outputs", default=None, help="where runs are (default: OUTPUT_DIR)")
    p.add_argument("--run", default=None, help="run folder (default: RUN_NAME, else the env names joined by +)")
    p.add_argument("--checkpoint", default=None, help="checkpoint-N of the run, or a path (default: the last complete)")
    p.add_argument("--tasks", type=int, default=DEFAULT_TASKS, help="held-out tasks per env, each played "
                   f"NUM_GENERATIONS times (default {DEFAULT_TASKS})")
    p.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD, help="an episode succeeds when its reward "
                   f"is above this (default {DEFAULT_THRESHOLD})")
    p.add_argument("--prompts-file", default=None, help="held-out rows for envs trained on ENV_PROMPTS_FILE")
    p.add_argument("--isolate", action="store_true", help="each model in its own process (always on GPU)")
    args, rest = p.parse_known_args(argv)
    if args.tasks < 1:
        p.error(f"--tasks must be >= 1, got {args.tasks}")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    from trainer.run import run_info

    args, rest = parse_args(sys.argv[1:] if argv is None else argv)
    overrides = {k: v for k, v in (("output_dir", args.outputs), ("run_name", args.run)) if v is not None}
    try:
        cfg = RunConfig.load(rest, **overrides)
        run = cfg.resolved_run_name
        checkpoint, step = pick_checkpoint(Path(cfg.output_dir), run, args.checkpoint)
        info = run_info.read(cfg.run_dir)
        if info:  # what the run trained on and with (a flag given here wins); where the servers are is this host's
            given = {arg[2:].split("=")[0].replace("-", "_") for arg in rest if arg.startswith("--")}
            recorded = {k: v for k, v in info.get("settings", {}).items() if k in RUN_SETTINGS and k not in given
                        and (v is not None or RunConfig.accepts_none(k))}  # an older run's null: then the default
            cfg = RunConfig.load(rest, **{**overrides, "run_name": run}, **recorded)
    except ConfigError as exc:
        print(f"[eval] config error:\n{exc}", file=sys.stderr, flush=True)
        return 2
    except EvalError as exc:
        print(f"[eval] {exc}", file=sys.stderr, flush=True)
        return 1
    cfg = grpo_args.resolve(cfg)  # TRAIN_MODE=auto: this host's GPUs decide how to generate
    if not info:
        log(f"run {run} has no {run_info.RUN_INFO_FILE} (trained before runs recorded their settings): using this "
            "host's settings (.env) for its envs and base model")

    from trainer.run import preflight

    report = preflight.PreflightReport()
    # the trainer's checks: healthy, tools learned, capacity (not the seed check: no GRPO group here, and every
    # episode the server sees is one of the evaluation's)
    errors = preflight.check_env_servers(cfg, report, check_seeds=False)
    try:
        tasks = held_out(cfg, report.specs, args.tasks, args.prompts_file) if not errors else {}
    except (EvalError, ValueError) as exc:
        errors.append(str(exc))
    if errors:
        print("[eval] env servers not ready:\n" + "\n".join(f"- {e}" for e in errors), file=sys.stderr, flush=True)
        return 3

    base = cfg.model_path
    g = cfg.num_generations
    log(f"run {run}: {checkpoint.name} (step {step}) vs the base model {cfg.model_id} on "
        + ", ".join(f"{name} ({len(rows)} held-out tasks{split_note(rows)} x {g})" for name, (_, rows) in tasks.items())
        + f"; success: reward > {args.threshold:g}; generation: "
        + ("transformers" if cfg.placement.trainer_on_cpu else "vLLM in this process"))
    held = check_gpu_memory(cfg, [base, str(checkpoint)])
    if held:
        print(f"[eval] {held}", file=sys.stderr, flush=True)
        return 4
    isolate = args.isolate or not cfg.placement.trainer_on_cpu
    rows = []
    with tempfile.TemporaryDirectory(prefix="eval-merged-") as scratch:
        trained = str(checkpoint)
        if lora.is_adapter(checkpoint):  # a LoRA run: base + adapter, merged (what vLLM and transformers load alike)
            trained = str(lora.write_merged(checkpoint, Path(scratch) / "model", base))
            log(f"{checkpoint.name} holds a LoRA adapter: scoring the base model with it merged in")
        for label, model in (("base", base), ("trained", trained)):
            call = (cfg, label, model, tasks, args.threshold)
            rows += _isolated(play_model, *call) if isolate else play_model(*call)
    data = {"run": run, "checkpoint": checkpoint.name, "step": step, "base_model": cfg.model_id,
            "threshold": args.threshold, "episodes_per_env": max(len(r) for _, r in tasks.values()) * g,
            "ks": list(range(1, g + 1)),
            "seeds": {name: ids for name, (ids, _) in tasks.items()}, "rows": rows}
    splits = {name: rows_[0]["reset_kwargs"]["split"] for name, (_, rows_) in tasks.items()
              if rows_ and "split" in (rows_[0].get("reset_kwargs") or {})}
    if splits:  # envs serving their own tasks: "seeds" are task indices of these splits
        data["splits"] = splits
    path = eval_report.write(cfg.run_dir, data)
    print(eval_report.markdown_table(data), flush=True)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
