"""Reward terms the trainer adds to every env's own reward (TRL sums its reward functions per rollout).

`unfinished`: an episode its budget ended before the model ended its turn loses UNFINISHED_PENALTY. Why: an env's
reward is often decided before the episode ends (echo's by the first call), so the tokens after that point take the
episode's advantage whatever they say. On the CPU profile that let a final turn drift into rambling until the token
budget ran out (lengths 12 -> 190, 75 % cut in a 100-step run), and nothing pulled it back; TRL's
`mask_truncated_completions` made it worse (it drops the only signal against it). With the penalty a rollout that
never finishes is worse than one that does, whatever the env said.

A budget ends an episode in one of two ways, in both modes (trainer.rollouts.rollout_loop, TRL's own loop,
trainer.async_grpo.async_budget): a turn cut mid-generation (its ids end in no stop token), or a tool-calling turn whose
calls never ran or whose results never got an answer: the next round would not fit MAX_COMPLETION_LENGTH or the
server's max_model_len (the round's results are rolled back), or MAX_TOOL_CALLING_ITERATIONS was reached. That turn
ends in a stop token, so the episode's last message tells it: an assistant turn with tool calls (or a tool result).
Every other assistant turn ends the episode because the model ended it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable


def stop_token_ids(model, tokenizer) -> frozenset[int]:
    """The ids that end a completion, as TRL counts them: every eos id of the model's generation config, the
    tokenizer's eos, and pad (TRL 1.16 `_generate`: a completion is truncated when its last id is none of these)."""
    declared = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids: Iterable[int | None] = declared if isinstance(declared, (list, tuple)) else [declared]
    return frozenset(i for i in (*ids, tokenizer.eos_token_id, tokenizer.pad_token_id) if i is not None)


def unfinished_penalty(penalty: float, stop_ids: frozenset[int]) -> Callable[..., list[float | None]]:
    """A TRL reward function: -penalty for an episode its budget ended (`budget_ended`), else 0; None (not scored)
    for an episode the env side ended (trainer.rollouts.infra_failures), so that, with the env's own None, every reward
    function leaves it unscored: TRL's sync and async trainers then keep it out of the group's baseline. A partial
    of a module-level function, not a closure: ROLLOUTS=async pickles reward functions into its spawned rollout
    worker (TRL names it by the function: `rewards/unfinished/mean` in both modes)."""
    return functools.partial(unfinished, penalty=penalty, stop_ids=stop_ids)


def unfinished(completion_ids: list[list[int]], *, penalty: float, stop_ids: frozenset[int],
               completions: list | None = None, environments: list | None = None, **_: object) -> list[float | None]:
    from envs.core.tool import infra_failure_of

    ended = [infra_failure_of(env) is not None for env in environments or []] or [False] * len(completion_ids)
    episodes = completions if completions is not None else [None] * len(completion_ids)
    return [None if gone else -penalty if budget_ended(ids, messages, stop_ids) else 0.0
            for ids, messages, gone in zip(completion_ids, episodes, ended)]


def budget_ended(ids: list[int], messages: list | str | None, stop_ids: frozenset[int]) -> bool:
    """Whether a budget, not the model, ended the episode (see the module docstring): its ids end in no stop token,
    or its last message is a tool-calling turn or a tool result. `messages`: the episode's completion messages as TRL
    hands them to reward functions (a string, or None, for a completion that is not a conversation)."""
    if ids and ids[-1] not in stop_ids:
        return True
    last = messages[-1] if isinstance(messages, list) and messages else None
    return isinstance(last, dict) and (last.get("role") == "tool" or bool(last.get("tool_calls")))
