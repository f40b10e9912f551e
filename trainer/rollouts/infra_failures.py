"""Episodes the env side ended (#33 items 3, 5): not the model's failures, and a dead env stops the run.

An episode is an infrastructure failure when its env server died, its session was lost, a reply never came
(TOOL_TIMEOUT_S, RESET_TIMEOUT_S, or the socket closed), the server refused it (no capacity, its factory failed)
or the reset failed for any of these reasons. Such an episode:
  * is marked in its trace with the reason (`infra_failure` in rollouts.jsonl);
  * is counted in `rollout/infra_failures` (and `env/<name>/infra_failures`);
  * gets no reward (every reward function's value is NaN): TRL 1.16's nan-aware aggregation leaves it out of its
    group's baseline and gives it advantage 0 (`unscorable_mask` in `_generate_and_score_completions`), and its
    tokens are taken out of the loss mask, so it neither moves the policy nor dilutes the loss's token count.
    Every reward function of the stack already says None for it (the binding's `get_reward`, trainer.rollouts.rewards'
    penalty), which is all TRL's async worker needs for the same baseline rule (`_score_group`); the NaN rows here
    make the sync trainer hold to it whatever reward functions a run adds.
A tool error the env reports for a bad call (an error frame with VALIDATION_ERROR / EXECUTION_ERROR, an observation
with an error, a tool class's own exception) stays the model's: it is none of the types below.

A failed reset no longer ends the run (#33 item 5): the episode runs on without its env (every tool call fails at
once, saying why) and is left out as above. Only a dead env stops the run: when more than DEAD_ENV_SHARE of an env's
last WINDOW episodes in this process ended by the env side (at least MIN_EPISODES seen), the next failed reset raises
EnvDown, one line naming the env. A blip (a replica restarting: the session client already waits
reconnect_wait_s for it) costs a few episodes, far below the bound.
"""

from __future__ import annotations

import threading
from collections import deque

from websockets.exceptions import ConnectionClosed

from envs.core.client import EnvServerError, RedirectRefused
from envs.core.tool import infra_failure_of
from envs.core.untrusted import UntrustedReply, one_line

# Error-frame codes that say the server side failed, not the call (openenv's WSErrorCode; SESSION_LOST is ours).
INFRA_CODES = frozenset({"CAPACITY_REACHED", "FACTORY_ERROR", "SESSION_ERROR", "SESSION_EXPIRED", "SESSION_LOST"})
WINDOW = 64  # an env's last episodes judged per process
MIN_EPISODES = 16  # no verdict on fewer: one bad batch at the start is not a dead env
DEAD_ENV_SHARE = 0.5  # default-rate chaos loses under 1 %; a dead env loses all of them
REASON_CHARS = 300


class EnvDown(RuntimeError):
    """An env whose episodes keep failing on the env side: the run stops (exit 6) with this one line."""


def reason(exc: BaseException) -> str | None:
    """Why `exc` says the env side failed, in one line, or None when it is the call's own (the model's) failure."""
    if isinstance(exc, RedirectRefused):
        return None  # a setup error: it stops the run as before
    if isinstance(exc, EnvServerError):
        return _line(f"env session failed ({exc.code}): {exc}") if exc.code in INFRA_CODES else None
    if isinstance(exc, TimeoutError):
        return _line(f"no reply: {exc}")
    if isinstance(exc, (ConnectionError, ConnectionClosed)):
        return _line(f"connection lost: {type(exc).__name__}: {exc}")
    if isinstance(exc, UntrustedReply):
        return _line(f"unusable reply: {exc}")
    return None


def _line(text: str) -> str:
    return one_line(text, REASON_CHARS)


class FailureWindow:
    """Per env: whether each of its last WINDOW episodes ended by the env side (thread-safe)."""

    def __init__(self, window: int = WINDOW, min_episodes: int = MIN_EPISODES, share: float = DEAD_ENV_SHARE) -> None:
        self.window, self.min_episodes, self.share = window, min_episodes, share
        self._episodes: dict[str, deque[bool]] = {}
        self._last: dict[str, str] = {}
        self._lock = threading.Lock()

    def record(self, env: str, infra_reason: str | None) -> None:
        with self._lock:
            self._episodes.setdefault(env, deque(maxlen=self.window)).append(infra_reason is not None)
            if infra_reason is not None:
                self._last[env] = infra_reason

    def check(self, env: str, current: str) -> None:
        """Raise EnvDown when `env` looks dead (called on a failed reset, `current` its reason)."""
        with self._lock:
            seen = list(self._episodes.get(env, ()))
        failed = sum(seen)
        if len(seen) >= self.min_episodes and failed > self.share * len(seen):
            raise EnvDown(f"env {env}: {failed} of its last {len(seen)} episodes ended by the env side (more than "
                          f"{self.share:.0%}), so it looks down, not blipping; last: {current}. Check the env's "
                          f"servers (make ps, make logs) and ENV_URLS / ENV_{env.upper()}_REPLICAS, then resume")


# One per process: every bound tool class of the run records here (trainer.rollouts.envs_binding).
WINDOWS = FailureWindow()


def row_mask(environments) -> list[bool]:
    """For each rollout of a batch: whether its episode ended by the env side (the binding's mark)."""
    return [infra_failure_of(env) is not None for env in environments or []]


# ---------------------------------------------------------------------------- the sync trainer's side (trainer.train)
METRIC = "rollout/infra_failures"


def leave_out_rewards(trainer, rewards_per_func):
    """TRL's `_calculate_rewards` result (every process's rows, process-major, as TRL gathers them) with the rows of
    episodes the env side ended set to NaN in every column: TRL 1.16 then leaves them out of their group's mean and
    std and sets their advantage to 0 (`unscorable_mask`). Logs METRIC (episodes of the batch, all processes).
    Every process calls this together (TRL's reward step): the gather keeps them in step."""
    import torch

    processes = trainer.accelerator.num_processes
    local_n = rewards_per_func.shape[0] // processes
    marks = row_mask(trainer.environments) or [False] * local_n
    local = torch.tensor(marks, dtype=torch.long, device=rewards_per_func.device)
    every = trainer.accelerator.gather(local) if processes > 1 else local
    rows = every.bool()
    trainer._infra_rows = local.bool()  # for leave_out_of_loss: this process's rows
    trainer._infra_any = bool(rows.any())
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode][METRIC].append(float(rows.sum()))
    if not trainer._infra_any:
        return rewards_per_func
    out = rewards_per_func.clone()
    out[rows] = float("nan")
    return out


def also_leave_out(trainer, local_rows: list[bool]) -> None:
    """More of this process's rows for leave_out_of_loss, by the same means (trainer.rollouts.zero_variance's flat
    groups). Call after leave_out_rewards, on every process, whenever any process has such a row (leave_out_of_loss
    gathers a count then)."""
    import torch

    current = getattr(trainer, "_infra_rows", None)
    rows = torch.tensor(local_rows, dtype=torch.bool)
    trainer._infra_rows = rows if current is None else current | rows.to(current.device)
    trainer._infra_any = True


def leave_out_of_loss(trainer, output: dict) -> dict:
    """`_generate_and_score_completions`' output with the tokens of those episodes out of the loss mask, and TRL's
    token count (`num_items_in_batch`, the loss's normaliser) counted again without them. Advantage 0 alone would
    keep them in the count and shrink every other token's weight. Every process calls this together."""
    if not getattr(trainer, "_infra_any", False):
        return output
    rows = trainer._infra_rows.to(output["completion_mask"].device)
    key = "tool_mask" if output.get("tool_mask") is not None else "completion_mask"
    output[key] = output[key] * (~rows).unsqueeze(1).to(output[key].dtype)
    loss_mask = output["completion_mask"] if output.get("tool_mask") is None \
        else output["completion_mask"] * output["tool_mask"]
    output["num_items_in_batch"] = trainer.accelerator.gather(loss_mask.sum()).sum()
    trainer._infra_any = False
    return output


# ---------------------------------------------------------------------------- the async trainer's side (ROLLOUTS=async)
# TRL's rollout worker (a spawned process) scores each group (`_score_group`: NaN-aware, a row every reward function
# left None gets advantage 0 and stays out of the group's mean and std) and queues one sample per training row.
# trainer.async_grpo.async_run.TracedRollouts hands the reward functions the episodes (`environments`, as the sync trainer does:
# the stack's say None for an env-ended one) and then drops those episodes' samples before the queue: never trained,
# so no advantage and no tokens in the loss's normaliser (TRL's `global_n_tokens` counts the trained tokens of the
# batch). The count goes to the trainer as `rollout/infra_failures_total` (summed per logging window, one push per
# group, 0 included), which trainer.core.async_metrics.record writes as METRIC, per step as in sync mode.
def ended_by_env(episodes) -> list[bool]:
    """For each rollout of a group (its episode stand-in, or None without an env): whether the env side ended it."""
    return [infra_failure_of(episode) is not None for episode in episodes]


def leave_out_samples(completions: list, samples: list, ended: list[bool]) -> list:
    """`samples` (TRL's RolloutSamples of a group; `sample.completion` is the group's own list object) without those of
    the rollouts `ended` marks."""
    if not any(ended):
        return samples
    dropped = {id(completion) for completion, out in zip(completions, ended) if out}
    return [sample for sample in samples if id(sample.completion) not in dropped]
