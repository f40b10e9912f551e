"""Reward terms the trainer adds to every env's own reward (TRL sums its reward functions per rollout).

`unfinished`: an episode cut at MAX_COMPLETION_LENGTH before the model ended its turn loses UNFINISHED_PENALTY.
Why: an env's reward is often decided before the episode ends (echo's by the first call), so the tokens after
that point take the episode's advantage whatever they say. On the CPU profile that let a final turn drift into
rambling until the token budget ran out (lengths 12 -> 190, 75 % cut in a 100-step run), and nothing pulled it
back; TRL's `mask_truncated_completions` made it worse (it drops the only signal against it). With the penalty
a rollout that never finishes is worse than one that does, whatever the env said.
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
    """A TRL reward function: -penalty for a completion that does not end in a stop token, else 0; None (not scored)
    for an episode the env side ended (trainer.rollouts.infra_failures), so that, with the env's own None, every reward
    function leaves it unscored: TRL's sync and async trainers then keep it out of the group's baseline. A partial
    of a module-level function, not a closure: ROLLOUTS=async pickles reward functions into its spawned rollout
    worker (TRL names it by the function: `rewards/unfinished/mean` in both modes)."""
    return functools.partial(unfinished, penalty=penalty, stop_ids=stop_ids)


def unfinished(completion_ids: list[list[int]], *, penalty: float, stop_ids: frozenset[int],
               environments: list | None = None, **_: object) -> list[float | None]:
    from envs.core.tool import infra_failure_of

    ended = [infra_failure_of(env) is not None for env in environments or []] or [False] * len(completion_ids)
    return [None if gone else -penalty if ids and ids[-1] not in stop_ids else 0.0
            for ids, gone in zip(completion_ids, ended)]
