"""Evaluation during training (EVAL_EVERY, EVAL_EPISODES): held-out episodes, played greedily, beside the training
curve, and the best checkpoint by their reward kept as `checkpoint-best`. ROLLOUTS=sync: `EvalCallback`, below;
ROLLOUTS=async: `AsyncEvalCallback` (at the end), which plays them with the async rollout loop instead.

A TrainerCallback (`EvalCallback`) on TRL's loop: at the end of every EVAL_EVERY-th optimizer step it plays
EVAL_EPISODES held-out tasks per env (trainer.run.held_out: seeds training never uses, as `make eval`'s), one greedy
episode each, through the training trainer itself (`_generate_and_score_completions` in TRL's eval mode, with
`num_generations_eval` = 1), so prompts, chat template, tool loop, limits and reward are training's. What it plays:

  * sampling: greedy (transformers: do_sample off; vLLM: temperature 0), restored after;
  * env sessions: the ones TRL's pool already holds for training, a batch no larger than a generation batch
    (held_out.batch_rows): evaluation needs no env capacity beyond what RunConfig.sessions_needed counts for training;
  * processes: each trainer process plays its share of the tasks (padded to the same count: TRL gathers every batch
    across processes), the episodes gathered on every process, so all decide the same;
  * the step's own figures: the episodes go to an account set apart (RolloutStats.set_apart), not to the step's
    env/<env>/... figures.

The figures go into the step's record (metrics.jsonl, every tracker, `make report`): eval/<env>/reward_mean,
eval/<env>/success_rate (reward > 0.5, as `make eval`'s default threshold), eval/<env>/tool_calls_per_episode,
eval/<env>/tool_failures_per_episode, eval/<env>/tokens_per_episode, eval/<env>/episodes, eval/<env>/infra_failures,
eval/reward (the envs' mean: what "best" compares) and time/eval_s. A new best asks TRL to save this step's checkpoint,
whose files are then hard-linked as checkpoint-best (trainer.run.checkpoints.keep_as_best; transformers' rotation
spares it as its state's best_model_checkpoint; `make export CHECKPOINT=best`). At the end the run prints eval's share of its time.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from contract.config import RunConfig
from trainer.core.dist import log
from trainer.run import checkpoints
from trainer.run.held_out import DEFAULT_THRESHOLD, Episode, encoded, play

PREFIX = "eval/"
OVERALL = "eval/reward"  # the envs' mean eval reward: what checkpoint-best is chosen by
SECONDS = "time/eval_s"
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


@contextmanager
def greedy(trainer):
    """The trainer in TRL's eval mode, one greedy episode per row (num_generations_eval = 1), for the block; its
    sampling settings and train mode restored after, and the eval-mode figures TRL collected dropped (the run's are
    the eval/... ones)."""
    saved = {"num_generations_eval": trainer.num_generations_eval}
    trainer.num_generations_eval = 1
    if getattr(trainer, "generation_config", None) is not None:  # transformers generation (the CPU profile)
        saved["generation_config"] = trainer.generation_config
        config = copy.deepcopy(trainer.generation_config)
        config.do_sample = False
        for key in SAMPLING_KEYS:
            setattr(config, key, None)
        trainer.generation_config = config
    if getattr(trainer, "generation_kwargs", None) is not None:  # overrides the model's own generation config
        saved["generation_kwargs"] = trainer.generation_kwargs
        trainer.generation_kwargs = {**{k: v for k, v in trainer.generation_kwargs.items() if k not in SAMPLING_KEYS},
                                     "do_sample": False}
    vllm = getattr(trainer, "vllm_generation", None)
    if vllm is not None:  # vLLM: temperature 0 is greedy
        saved_temperature, vllm.temperature = vllm.temperature, 0.0
    training = trainer.model.training
    trainer.model.eval()
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(trainer, key, value)
        if vllm is not None:
            vllm.temperature = saved_temperature
        if training:
            trainer.model.train()
        trainer._metrics["eval"].clear()


def figures(env: str, episodes: list[Episode], threshold: float = DEFAULT_THRESHOLD) -> dict[str, float]:
    """eval/<env>/... of one env's episodes: means over the scored ones (an episode the env side ended is counted in
    infra_failures, not scored: trainer.rollouts.infra_failures); none but the counts when every one was lost."""
    scored = [ep for ep in episodes if ep.infra_failure is None]
    out: dict[str, float] = {f"{PREFIX}{env}/episodes": len(scored),
                             f"{PREFIX}{env}/infra_failures": len(episodes) - len(scored)}
    if scored:
        n = len(scored)
        out.update({f"{PREFIX}{env}/reward_mean": sum(ep.reward for ep in scored) / n,
                    f"{PREFIX}{env}/success_rate": sum(ep.reward > threshold for ep in scored) / n,
                    f"{PREFIX}{env}/tool_calls_per_episode": sum(ep.calls for ep in scored) / n,
                    f"{PREFIX}{env}/tool_failures_per_episode": sum(ep.failures for ep in scored) / n,
                    f"{PREFIX}{env}/tokens_per_episode": sum(ep.tokens for ep in scored) / n})
    return out


def overall(record: dict[str, Any]) -> float | None:
    """The envs' mean eval reward of a record (None: no env scored an episode)."""
    rewards = [v for k, v in record.items() if k.startswith(PREFIX) and k.endswith("/reward_mean")]
    return sum(rewards) / len(rewards) if rewards else None


def my_share(rows: list[dict], rank: int, world: int) -> tuple[list[dict], int]:
    """(this process's rows, how many of them are its own): every `world`-th row from `rank`, padded with the first
    row to the same count on every process (TRL gathers each batch across processes: the sizes must match)."""
    mine = rows[rank::world]
    size = -(-len(rows) // world)
    return mine + [rows[0]] * (size - len(mine)), len(mine)


class EvalCallback(TrainerCallback):
    """Held-out evaluation every EVAL_EVERY steps; see the module docstring. Build it before the trainer (it goes
    before the run's control callback, whose disk check must see the save it asks for), then `bind(trainer)`."""

    def __init__(self, cfg: RunConfig, tasks: dict[str, tuple[list[int], list[dict]]], stats, print_fn=log) -> None:
        self.cfg, self.tasks, self.stats, self.print = cfg, tasks, stats, print_fn
        self.every = cfg.rollouts.eval_every
        self.run_dir = Path(cfg.run_dir)
        self.trainer = None
        self.best = checkpoints.best_note(self.run_dir)  # a resumed run competes with the best it kept
        self.pending: dict[str, Any] | None = None  # a new best whose checkpoint TRL saves after this step
        self.seconds, self.evaluations, self.started = 0.0, 0, None

    def bind(self, trainer) -> "EvalCallback":
        self.trainer = trainer
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.perf_counter()
        if self.best:  # a resumed run's checkpoint-best, protected from the rotation as below
            state.best_model_checkpoint = str(Path(args.output_dir) / checkpoints.BEST)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if not self.every or step % self.every or self.trainer is None:
            return control
        start = time.perf_counter()
        record = self.evaluate()
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.evaluations += 1
        record[SECONDS] = seconds
        reward = overall(record)
        if reward is not None:
            record[OVERALL] = reward
        self.stats.add_figures(record)  # into this step's record (trainer.core.metrics.MetricsCallback.on_log)
        control.should_log = True  # whatever LOGGING_STEPS says: the eval point lands at its own step
        best = self.best.get("reward") if self.best else None
        if reward is not None and (best is None or reward > best):
            self.pending = {"step": step, "reward": reward}
            control.should_save = True  # this step's checkpoint becomes checkpoint-best once saved (on_save)
        if state.is_world_process_zero:
            self.print(self.line(step, record, seconds))
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.pending is None or self.pending["step"] != state.global_step:
            return
        note, self.pending = self.pending, None
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"{checkpoints.PREFIX}{state.global_step}"
            checkpoints.keep_as_best(folder, state.global_step, note)
        self.best = note
        # transformers rotates checkpoint-* folders by mtime (save_total_limit), checkpoint-best among them, except
        # the one its state names best: name ours (nothing else of the Trainer reads it without load_best_model_at_end)
        state.best_model_checkpoint = str(Path(args.output_dir) / checkpoints.BEST)

    def on_train_end(self, args, state, control, **kwargs):
        if not self.evaluations or not state.is_world_process_zero or self.started is None:
            return
        total = time.perf_counter() - self.started
        share = self.seconds / total if total else 0.0
        ratio = total / (total - self.seconds) if total > self.seconds else float("inf")
        best = (f"; best eval reward {self.best['reward']:.3f} at step {self.best['step']} (checkpoint-best)"
                if self.best else "")
        self.print(f"eval: {self.evaluations} evaluation(s) took {self.seconds:.1f} s of the run's {total:.1f} s "
                   f"({share:.0%}): the run took {ratio:.2f}x its time without them{best}")

    def evaluate(self) -> dict[str, float]:
        """Every env's held-out tasks, one greedy episode each, on every process together; eval/<env>/... figures."""
        from accelerate.utils import gather_object

        trainer = self.trainer
        rank, world = trainer.accelerator.process_index, trainer.accelerator.num_processes
        record: dict[str, float] = {}
        from trainer.judge.costs import COSTS

        with greedy(trainer), self.stats.set_apart(), COSTS.set_apart() as judged:
            for name, (_, rows) in self.tasks.items():
                share, own = my_share(rows, rank, world)
                episodes = play(trainer, self.cfg, name, share, generations=1)[:own]
                everyone = gather_object(episodes) if world > 1 else episodes
                record.update(figures(name, everyone))
        record.update({f"eval/{key}": value for key, value in judged.items()})  # a judge on: eval/judge/calls, ...
        return record

    @staticmethod
    def line(step: int, record: dict[str, Any], seconds: float) -> str:
        envs = sorted({k.split("/")[1] for k in record if k.startswith(PREFIX) and k.count("/") == 2})
        parts = []
        for env in envs:
            reward, success = record.get(f"{PREFIX}{env}/reward_mean"), record.get(f"{PREFIX}{env}/success_rate")
            calls = record.get(f"{PREFIX}{env}/tool_calls_per_episode")
            parts.append(f"{env} reward {reward:.3f} success {success:.0%} tool calls/ep {calls:.2f}"
                         if reward is not None else f"{env}: every episode ended by the env side")
            parts[-1] += f" ({record[f'{PREFIX}{env}/episodes']:.0f} episodes)"
        return f"eval at step {step}: {'; '.join(parts)}, greedy, held out; {seconds:.1f} s"


class AsyncEvalCallback(EvalCallback):
    """EVAL_EVERY for ROLLOUTS=async: the same callback (figures, checkpoint-best, the share of the time), the episodes
    played by trainer.async_grpo.async_eval.EpisodePlayer on rank 0 (where TRL's rollout worker and its settings live),
    greedily against the vLLM server, on env sessions of the evaluation's own; the record goes to every process.

    TRL pushes the new weights in a callback of its own at the end of a step (weight_sync_steps, 1 here); `bind` puts
    it before this one, so an evaluation plays the weights of the step it is recorded at, the ones checkpoint-best
    saves."""

    def __init__(self, cfg: RunConfig, tasks: dict[str, tuple[list[int], list[dict]]], stats, print_fn=log) -> None:
        super().__init__(cfg, tasks, stats, print_fn)
        self.player = None

    def bind(self, trainer, player=None) -> "AsyncEvalCallback":
        """`player`: an EpisodePlayer made elsewhere (tests); else one from the rank-0 rollout worker's settings."""
        from trl.experimental.async_grpo import async_grpo_trainer as trl_async
        from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

        from trainer.async_grpo.async_eval import EpisodePlayer

        self.trainer = trainer
        worker = getattr(trainer, "rollout_worker", None)
        if player is None and isinstance(worker, AsyncRolloutWorker):
            player = EpisodePlayer(worker._loop_cls, worker._loop_kwargs, worker._model_version_value,
                                   self.cfg.rollouts.eval_sessions(self.cfg))
        self.player = player
        handler = getattr(trainer, "callback_handler", None)
        sync = next((cb for cb in getattr(handler, "callbacks", []) if isinstance(cb, trl_async.StepIntervalCallback)),
                    None)
        if sync is not None and self in handler.callbacks:  # the step's weights pushed before they are evaluated
            handler.callbacks.remove(sync)
            handler.callbacks.insert(handler.callbacks.index(self), sync)
        return self

    def evaluate(self) -> dict[str, float]:
        record: dict[str, float] = {}
        if self.player is not None:
            multi = len(self.cfg.env_names) > 1
            with self.stats.set_apart():
                for name, (_, rows) in self.tasks.items():
                    played = self.player.play(name if multi else None, [encoded(self.cfg, name, r) for r in rows])
                    record.update(figures(name, [Episode(*episode) for episode in played]))
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:  # every process decides the same (best, save)
            from accelerate.utils import broadcast_object_list

            record = broadcast_object_list([record], from_process=0)[0]
        return record

    def on_train_end(self, args, state, control, **kwargs):
        super().on_train_end(args, state, control, **kwargs)
        if self.player is not None:
            self.player.close()
            self.player = None

    @staticmethod
    def line(step: int, record: dict[str, Any], seconds: float) -> str:
        return EvalCallback.line(step, record, seconds) + " (ROLLOUTS=async: the vLLM server's policy, sessions of its own)"
