"""ROLLOUTS=async episodes under MAX_COMPLETION_LENGTH, as the sync rollout loop (trainer.rollouts.rollout_loop) bounds
them: a budget for the whole episode, every token after the first prompt counted (assistant turns, tool results, the
template's framing).

TRL 1.16's async loop caps each turn (max_tokens = max_completion_length) and nothing else: without
MAX_TOOL_CALLING_ITERATIONS an episode grew until vLLM refused its next turn (HTTP 400), which TRL's worker retried
(30 x 3 attempts with backoff, ~8 minutes) before the run stopped. `BudgetedRollouts._generate_one` is TRL's, with:

  * each turn asks for at most what is left of the budget and of the server's max_model_len (`max_tokens`, set in the
    stack's `_post` from the task-local `turn_cap()`), so a turn that runs out is cut as sync cuts it (no stop token:
    the unfinished penalty applies);
  * a round whose tool results leave nothing ends the episode with those results rolled back, as the sync loop rolls
    back a round that does not fit: the episode ends on the turn that made the calls and is scored (as in sync, the
    unfinished penalty applies: trainer.rollouts.rewards.budget_ended reads that last turn's calls);
  * a 400 for the context length (max_model_len not known here, or a reset observation longer than preflight's
    prompts) is `ContextFull`, which TRL's `_retry` does not retry: the turn is asked again once within the
    max_model_len vLLM's message names (later turns stay within it), else the episode ends the same way.

PINNED to trl 1.16.0 (trainer/core/trl_privates.py): `_AsyncRolloutLoop._generate_one` (copied below; digest),
`_generate_one_turn`, `_retry`, `_push_rollout_metrics`, `TurnRecord`, `_chain_to_sequences`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import re
import time
import uuid

# vLLM 0.31's 400s for a request past max_model_len: prompt + max_tokens too long, or the prompt alone
CONTEXT_FULL_PHRASES = ("maximum context length", "maximum model length")

_TURN_CAP: contextvars.ContextVar[int | None] = contextvars.ContextVar("turn_cap", default=None)


class ContextFull(Exception):
    """vLLM refused a turn for its length: the episode ends there (scored), not retried. `max_model_len`: the limit
    vLLM's message names (None if it names none)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        found = re.search(r"maximum (?:context length is|model length of) (\d+)", message)
        self.max_model_len = int(found.group(1)) if found else None


def turn_cap() -> int | None:
    """The most tokens the turn being generated in this task may ask for (None: outside a budgeted episode)."""
    return _TURN_CAP.get()


def context_full(status: int, body: str) -> bool:
    return status == 400 and any(phrase in body for phrase in CONTEXT_FULL_PHRASES)


def vllm_message(body: str) -> str:
    """The message of vLLM's error body ({"error": {"message": ...}}), else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body[:300]


class EpisodeBudget:
    """One episode's budget: MAX_COMPLETION_LENGTH tokens after the first prompt, within max_model_len."""

    def __init__(self, budget: int, max_model_len: int | None) -> None:
        self.budget, self.max_model_len = budget, max_model_len
        self.first_prompt: int | None = None

    def cap(self, prompt_tokens: int) -> int:
        """max_tokens for a turn whose prompt (the whole conversation so far) has `prompt_tokens`; < 1: none fits."""
        if self.first_prompt is None:
            self.first_prompt = prompt_tokens
        left = self.budget - (prompt_tokens - self.first_prompt)
        return min(left, self.max_model_len - prompt_tokens) if self.max_model_len else left


class BudgetedRollouts:
    """Mixin for TRL's `_AsyncRolloutLoop` (after TracedRollouts, which wraps `_generate_one`); see the module
    docstring. `max_model_len` is the vLLM server's, as preflight read it (None: the 400 is the only guard)."""

    max_model_len: int | None = None

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        """TRL 1.16's `_AsyncRolloutLoop._generate_one`, with the episode budget (marked `budget:`)."""
        from trl.chat_template_utils import parse_response
        from trl.experimental.async_grpo.async_rollout_worker import TurnRecord, _chain_to_sequences

        t_dispatch = time.monotonic()
        messages = list(prompt)
        rollout_id = uuid.uuid4().hex
        turns: list = []
        completion, completion_ids = [], []
        tool_call_count = 0
        tool_failure_count = 0
        iteration_num = 0
        loop_exhausted = False
        max_iterations = self.max_tool_calling_iterations
        budget = EpisodeBudget(self.max_tokens, self.max_model_len)  # budget:
        last_results = 0  # budget: tool messages of the last round, rolled back if the next turn cannot run
        while True:
            prompt_ids = self.tokenizer.apply_chat_template(
                messages,
                return_dict=False,
                add_generation_prompt=True,
                tools=tools or None,
                chat_template=self.chat_template,
                **self.chat_template_kwargs,
            )
            turn = await self._budgeted_turn(prompt_ids, budget)  # budget:
            if turn is None:  # budget: no room for another turn; the round that filled it is rolled back
                del completion[len(completion) - last_results:]
                break
            turn_ids, turn_logprobs = turn
            assistant_message = parse_response(self.tokenizer, turn_ids, prefix=prompt_ids, tools=tools)
            completion.append(assistant_message)
            completion_ids.extend(turn_ids)
            messages.append(assistant_message)
            turns.append(TurnRecord(prompt_ids, turn_ids, turn_logprobs))
            tool_calls = assistant_message.get("tool_calls")
            if tool_calls is None:
                break
            if max_iterations is not None and iteration_num >= max_iterations:
                loop_exhausted = True
                break
            tool_messages, n_calls, n_failures = await self._execute_tool_calls(tool_calls, tool_dict)
            tool_call_count += n_calls
            tool_failure_count += n_failures
            completion.extend(tool_messages)
            messages.extend(tool_messages)
            last_results = len(tool_messages)
            iteration_num += 1
        await self._submit_final(completion, tool_dict)  # an answer in plain text, to an env scoring it by a tool
        sequences, tally = _chain_to_sequences(turns, rollout_id, self._fork_threshold_tokens)
        self._push_rollout_metrics(
            turns=len(turns),
            sequences=len(sequences),
            completion_ids=completion_ids,
            tally=tally,
            loop_exhausted=loop_exhausted,
            duration_s=time.monotonic() - t_dispatch,
        )
        return completion, completion_ids, sequences, tool_call_count, tool_failure_count, None

    async def _submit_final(self, completion: list, tool_dict: dict) -> None:
        """As the sync loop does (trainer.rollouts.rollout_loop.submit_final): an episode that ended in plain text has
        its text submitted through the env's answer tool, before the env's reward is read."""
        from trainer.rollouts.rollout_loop import ended_in_text, submit_final

        last = ended_in_text(completion)
        env = next((m.__self__ for m in tool_dict.values() if hasattr(m, "__self__")), None)
        if last is not None and env is not None:
            await asyncio.get_running_loop().run_in_executor(self._tool_pool, submit_final, env, last)

    async def _budgeted_turn(self, prompt_ids: list[int], budget: EpisodeBudget):
        """TRL's `_generate_one_turn` asking for at most what the budget leaves; None where nothing is left, or vLLM
        refused the turn for its length. A refusal that names a max_model_len this loop did not know (preflight could
        not read it, or a reset observation made the prompt longer than preflight's) is asked again once within it,
        and every later turn stays within it."""
        for _ in range(2):
            cap = budget.cap(len(prompt_ids))
            if cap < 1:
                return None
            token = _TURN_CAP.set(cap)
            try:
                return await self._generate_one_turn(prompt_ids)
            except ContextFull as refused:
                if not refused.max_model_len or refused.max_model_len == budget.max_model_len:
                    return None
                if refused.max_model_len != self.max_model_len:
                    print(f"[rollouts] vLLM refused a turn for its length ({refused}); episodes now stay within its "
                          f"max_model_len {refused.max_model_len}", flush=True)
                self.max_model_len = budget.max_model_len = refused.max_model_len
            finally:
                with contextlib.suppress(ValueError):  # closed at the worker's shutdown outside its task's context
                    _TURN_CAP.reset(token)
        return None

    async def _post_completion(self, payload: dict, timeout: float) -> dict:
        """TRL's `_post` for one /v1/completions request, except that a 400 for the context length is ContextFull:
        raise_for_status drops vLLM's message, and TRL's `_retry` would retry the 400 as any aiohttp error."""
        import aiohttp

        async with self.session.post(f"{self.vllm_server_url}/v1/completions", json=payload,
                                     timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status == 400:
                body = await response.text()
                if context_full(response.status, body):
                    raise ContextFull(vllm_message(body))
            response.raise_for_status()
            content = await response.json()
            return content if content else {}
