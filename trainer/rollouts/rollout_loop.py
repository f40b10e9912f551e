"""The stack's rollout loop: TRL 1.16's `GRPOTrainer._tool_call_loop`, with three changes.

1. **A round's tool calls run at once.** TRL calls the rollouts' tools one rollout after another, so
   a round cost the sum of the batch's tool latencies. Here every rollout that called a tool runs at
   the same time (each owns its env session), at most TOOL_CONCURRENCY at once; one rollout's calls of
   a turn stay in the model's order, because a session is stateful. A call past TOOL_TIMEOUT_S fails
   (the model reads why) and its session is closed.
2. **Every trainer process stays in step.** Generation is a collective in vLLM server mode
   (`gather_object`, then each rank keeps the slice `process_index * len(prompts)`) and in colocate
   with tensor parallelism (`all_gather_object` in the TP group); under FSDP or ZeRO-3, `generate`
   gathers parameters. So each round the processes agree whether anyone still generates and send the
   same number of prompts: the most any of them has, the others padded with their first prompt (its
   completion is thrown away).
3. **In vLLM server mode, an episode ends where vLLM would refuse its next turn.** TRL resends the
   episode so far with max_tokens=max_completion_length each turn, and vLLM refuses a prompt longer
   than its max_model_len minus that; TRL checks the model's max_position_embeddings instead, so a run
   failed mid-way. Here the tool results that would push the input past it are rolled back, as TRL
   does at its own limits.

4. **A batch's envs reset at once.** TRL's `_generate_and_score_completions` calls `reset(**row)` on each
   rollout's env one after another (a 250 ms reset costs 16 s at batch 64). Here they all run first, at most
   TOOL_CONCURRENCY at once, on the very instances TRL then draws from its pool; TRL's own loop then gets each
   result back from its env's `reset`, so observations land in the same prompts in the same order. A reset that
   raises raises there, the first in batch order, as in TRL (the later resets have run too: they are not undone).
   Resets are local to a process (no collective), so processes stay in step as before.
5. **A final answer in plain text reaches an env that scores answers through a tool.** An env that publishes its
   tasks and takes the answer through a tool (`openenv import`'s ORS wrapper: `answer`) scores an episode only
   when that tool is called; one that ended in plain text has its text submitted through it before TRL reads the
   env's reward (envs.core.tool.submit_final_answer; nothing happens for any other env).

Everything else is TRL's: the messages and their order, tool masks, logprobs, call and failure
counts, the overlong rollback and the iteration limit. tests/trainer/test_rollout_loop.py checks the
result against TRL's own loop token for token, and trainer/core/trl_privates.py pins the TRL source this copy follows.
Text only: a vision-language model (tool images) keeps TRL's loop.
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.core.tool import abandon_session, submit_final_answer, trace_of
from trainer.core.trl_privates import TRL_VERSION, environment_pool  # noqa: F401  (the release this loop was copied from)

THINK = re.compile(r"^\s*<think>.*?</think>", re.S)
TIMEOUT_ERROR = ("Tool {name} timed out after {seconds:g} s and the env session was closed. "
                 "Stop calling tools and give your final answer.")
NOT_RUN_ERROR = "Not run: an earlier call in this turn timed out and the env session was closed."


@dataclass
class CallResult:
    name: str
    value: Any  # what the tool returned, or {"error": message}
    failed: bool = False
    deferred: bool = False  # an async tool: TRL lists these after the turn's other results
    timed_out: bool = False


@dataclass
class RolloutCalls:
    """One rollout's tool calls of this turn, the tools it may call, and what to do when one hangs."""

    calls: list[dict]
    sync_tools: dict[str, Callable]
    async_tools: dict[str, Callable]
    on_timeout: Callable[[], None] = lambda: None


@dataclass
class ToolRunner:
    """Runs one round: rollouts concurrently, each rollout's calls in order."""

    timeout_s: float | None = None
    concurrency: int | None = None  # None: the whole round
    async_loop: asyncio.AbstractEventLoop | None = None  # where TRL runs async tools (its daemon loop)
    peak_in_flight: int = field(default=0, init=False)  # most calls running at once so far (tests, bench)
    _in_flight: int = field(default=0, init=False, repr=False)

    def run(self, rollouts: list[RolloutCalls]) -> list[list[CallResult]]:
        if not rollouts:
            return []
        width = min(self.concurrency or len(rollouts), len(rollouts))
        pool = ThreadPoolExecutor(max_workers=width, thread_name_prefix="tool-call")
        try:
            return asyncio.run(self._run_round(rollouts, pool, width))
        finally:
            pool.shutdown(wait=False, cancel_futures=True)  # a timed-out call may still run: its session is closed

    async def _run_round(self, rollouts, pool, width) -> list[list[CallResult]]:
        slots = asyncio.Semaphore(width)
        self._in_flight = 0
        return list(await asyncio.gather(*(self._run_rollout(r, pool, slots) for r in rollouts)))

    async def _run_rollout(self, rollout: RolloutCalls, pool, slots) -> list[CallResult]:
        results: list[CallResult] = []
        abandoned = False
        for call in rollout.calls:
            if call.get("type") != "function":
                name = call.get("name", "unknown")
                results.append(CallResult(name, {"error": f"Unsupported tool call type: {call.get('type')}"}, True))
                continue
            name = call["function"]["name"]
            if abandoned:
                results.append(CallResult(name, {"error": NOT_RUN_ERROR}, True))
                continue
            async with slots:
                self._in_flight += 1
                self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
                try:
                    result = await self._call(rollout, name, call["function"].get("arguments"), pool)
                finally:
                    self._in_flight -= 1
            if result.timed_out:
                abandoned = True
                await asyncio.to_thread(rollout.on_timeout)
            results.append(result)
        return results

    async def _call(self, rollout: RolloutCalls, name: str, arguments: Any, pool) -> CallResult:
        deferred = False
        try:  # as in TRL: an unknown tool, or arguments an async tool cannot bind, fail in the turn's order
            if name in rollout.sync_tools:
                tool = rollout.sync_tools[name]
                waiter = asyncio.get_running_loop().run_in_executor(pool, lambda: tool(**arguments))
            elif name in rollout.async_tools:
                coroutine = rollout.async_tools[name](**arguments)
                waiter = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self.async_loop))
                deferred = True
            else:
                raise ValueError(f"Tool {name} not found.")
        except Exception as e:
            return CallResult(name, {"error": str(e)}, failed=True)
        done, _ = await asyncio.wait({waiter}, timeout=self.timeout_s)  # a tool's own TimeoutError is its failure
        if not done:
            waiter.cancel()  # an async tool's coroutine stops; a sync tool's thread runs on, its session closed
            error = TIMEOUT_ERROR.format(name=name, seconds=self.timeout_s)
            return CallResult(name, {"error": error}, failed=True, deferred=deferred, timed_out=True)
        try:
            return CallResult(name, waiter.result(), deferred=deferred)
        except Exception as e:
            return CallResult(name, {"error": str(e)}, failed=True, deferred=deferred)


@dataclass
class ResetReplay:
    """An env's own `reset`, already run: set on the instance, it hands TRL's reset loop the outcome once and then
    gives the instance its method back."""

    env: Any
    value: Any = None
    error: BaseException | None = None

    def __call__(self, *args, **kwargs):
        self.env.__dict__.pop("reset", None)
        if self.error is not None:
            raise self.error
        return self.value


def reset_all(envs: list, kwargs: list[dict], concurrency: int | None) -> list[ResetReplay]:
    """`envs[i].reset(**kwargs[i])` for every i at once (at most `concurrency` at a time), outcomes in order."""

    def one(i: int) -> ResetReplay:
        try:
            return ResetReplay(envs[i], envs[i].reset(**kwargs[i]))
        except Exception as e:  # kept, and raised where TRL's loop calls this env's reset
            return ResetReplay(envs[i], error=e)

    if not envs:
        return []
    width = min(concurrency or len(envs), len(envs))
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="env-reset") as pool:
        return list(pool.map(one, range(len(envs))))


def tool_messages(results: list[CallResult]) -> list[dict]:
    """The turn's tool messages in TRL's order: sync results as they ran, then async ones."""
    ordered = [r for r in results if not r.deferred] + [r for r in results if r.deferred]
    return [{"role": "tool", "name": r.name, "content": r.value if isinstance(r.value, list) else str(r.value)}
            for r in ordered]


def make_rollout_loop_class(base: type) -> type:
    """`base` (a GRPOTrainer class) with the loop above in place of TRL's `_tool_call_loop`."""
    import torch
    from trl.chat_template_utils import parse_response

    from trainer.core.metrics import STATS

    class RolloutLoopTrainer(base):
        tool_runner: ToolRunner | None = None  # set by configure_rollouts; defaults on first use
        server_max_model_len: int | None = None  # vLLM server mode: the max_model_len the server reports
        last_tool_counts: list[tuple[int, int]] | None = None  # (calls, failures) per rollout of the last batch

        def configure_rollouts(self, timeout_s: float | None, concurrency: int | None,
                               server_max_model_len: int | None = None) -> None:
            self.tool_runner = ToolRunner(timeout_s, concurrency, getattr(self, "async_loop", None))
            self.server_max_model_len = server_max_model_len

        def _tool_call_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images,
                            multimodal_fields):
            if self._is_vlm or images is not None or multimodal_fields:
                self.last_tool_counts = None
                return super()._tool_call_loop(prompts, prompt_ids, completion_ids, completions, logprobs, images,
                                               multimodal_fields)
            if self.tool_runner is None:
                self.configure_rollouts(None, None)
            tool_calls = [completion[0].get("tool_calls") for completion in completions]
            calling = [i for i, calls in enumerate(tool_calls) if calls]  # rollouts whose last turn called tools
            tool_calls = {i: tool_calls[i] for i in calling}
            tool_mask = [[1] * len(ids) for ids in completion_ids]  # 0 for tool result tokens, 1 elsewhere
            tool_images = [[] for _ in completion_ids]
            tool_call_count = tool_failure_count = 0
            per_rollout = [[0, 0] for _ in completion_ids]  # TRL only sums them; trainer.evaluate needs each
            iteration = 0
            while iteration < self.max_tool_calling_iterations:
                # 1. Run the round's calls; their results become tool messages (rolled back below if overlong).
                completions_before = {i: len(completions[i]) for i in calling}
                prompts_before = {i: len(prompts[i]) for i in calling}
                for i in calling:
                    prompts[i].append(completions[i][-1])  # the assistant turn that made the calls
                start = time.perf_counter()
                results = self.tool_runner.run([self._rollout_calls(i, tool_calls[i]) for i in calling])
                STATS.add_time("env", time.perf_counter() - start)  # wall time of the round, not the sum of calls
                for i, turn in zip(calling, results, strict=True):
                    tool_call_count += len(turn)
                    tool_failure_count += sum(r.failed for r in turn)
                    per_rollout[i][0] += len(turn)
                    per_rollout[i][1] += sum(r.failed for r in turn)
                    for message in tool_messages(turn):
                        prompts[i].append(message)
                        completions[i].append(message)

                # 2. prompt + completion so far + the template's tool block: the next turn's input, no re-tokenizing.
                next_ids = {i: prompt_ids[i] + completion_ids[i]
                            + self._get_tool_suffix_ids(trailing_tool_messages(completions[i])) for i in calling}

                # 3. Results that would overrun the completion budget or the context are dropped with their turn.
                overlong = {i for i in calling if len(next_ids[i]) - len(prompt_ids[i]) > self.max_completion_length
                            or not self._input_fits(len(next_ids[i]))}
                for i in overlong:
                    del completions[i][completions_before[i]:]
                    del prompts[i][prompts_before[i]:]
                calling = [i for i in calling if i not in overlong]

                # 4. One generation for every process, with the same number of prompts on each.
                width = self._agree_on_width(len(calling))
                if width == 0:
                    break
                batch = [next_ids[i] for i in calling] + [prompt_ids[0]] * (width - len(calling))
                post_ids, post_logprobs = self._generate_single_turn(batch, None, {}, num_generations=1,
                                                                     has_tool_images=False)
                post_ids = post_ids[:len(calling)]
                post_logprobs = post_logprobs[:len(calling)] if post_logprobs is not None else None

                # 5. Truncate to the budget; extend masks, logprobs and ids; parse the new turns.
                for k, i in enumerate(calling):
                    excess = len(next_ids[i]) - len(prompt_ids[i]) + len(post_ids[k]) - self.max_completion_length
                    if excess > 0:
                        post_ids[k] = post_ids[k][:len(post_ids[k]) - excess]
                        if logprobs is not None:
                            post_logprobs[k] = post_logprobs[k][:len(post_ids[k])]
                    tool_length = len(next_ids[i]) - len(prompt_ids[i]) - len(completion_ids[i])
                    tool_mask[i] += [0] * tool_length + [1] * len(post_ids[k])
                    if logprobs is not None:
                        logprobs[i] += [0.0] * tool_length + post_logprobs[k]
                    completion_ids[i] = next_ids[i][len(prompt_ids[i]):] + post_ids[k]
                turns = {}
                for k, i in enumerate(calling):
                    tools = (self._env_tools[self._batch_environments[i]] if self.environment_factories is not None
                             else self.tools)
                    turns[i] = parse_response(self._tokenizer, post_ids[k], prefix=next_ids[i], tools=tools) \
                        if post_ids[k] else {}
                    if turns[i]:  # {} when the budget left no room for the turn
                        completions[i].append(turns[i])
                tool_calls = {i: turns[i].get("tool_calls") for i in calling if turns[i].get("tool_calls")}
                calling = list(tool_calls)
                iteration += 1
            self._submit_final_answers(completions)
            self.last_tool_counts = [(calls, failures) for calls, failures in per_rollout]
            return tool_mask, completions, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images

        def _submit_final_answers(self, completions) -> None:
            """Episodes that ended in plain text, on an env that scores final answers through a tool: the text is
            submitted through it (envs.core.tool.submit_final_answer), before TRL reads the env's reward; the trace
            shows the call as the stack's, not the model's (it is no tool call of the model's and not counted)."""
            if not self.environments:
                return
            start = time.perf_counter()
            for i, turns in enumerate(completions):
                last = ended_in_text(turns)
                if last is not None:
                    submit_final(self.environments[i], last)
            STATS.add_time("env", time.perf_counter() - start)

        def _generate_and_score_completions(self, inputs):
            """TRL's, with the batch's env resets run at once beforehand (change 4 above)."""
            replays = self._reset_batch_at_once(inputs)
            try:
                return super()._generate_and_score_completions(inputs)
            finally:
                for replay in replays:  # left over only when an earlier reset raised
                    if replay.env.__dict__.get("reset") is replay:
                        del replay.env.__dict__["reset"]

        def _reset_batch_at_once(self, inputs) -> list[ResetReplay]:
            """Draw the batch's envs from TRL's pool exactly as TRL is about to (so it draws these very instances),
            reset them concurrently, and leave each outcome on its instance for TRL's reset loop to collect."""
            if self.environment_factories is None:
                return []
            multi = self._multi_environment
            names = [x.get("environment") if multi else None for x in inputs]
            if any(name not in self.environment_factories for name in names):
                return []  # TRL raises its own error for an unknown environment
            envs, cursor = [], {}
            for name in names:
                pool = environment_pool(self)[name]
                index = cursor.get(name, 0)
                if index == len(pool):
                    pool.append(self.environment_factories[name]())
                cursor[name] = index + 1
                envs.append(pool[index])
            if any(not hasattr(env, "__dict__") for env in envs):
                return []  # no instance attribute to leave the outcome on (__slots__): TRL's sequential resets
            kwargs = [{k: v for k, v in x.items() if k != "environment"} if multi else x for x in inputs]
            if self.tool_runner is None:
                self.configure_rollouts(None, None)
            replays = reset_all(envs, kwargs, self.tool_runner.concurrency)
            for replay in replays:
                replay.env.__dict__["reset"] = replay
            return replays

        def _rollout_calls(self, i: int, calls: list[dict]) -> RolloutCalls:
            env = self.environments[i] if self.environments else None
            return RolloutCalls(calls, self._sync_tool_dicts[i], self._async_tool_dicts[i],
                                lambda: abandon_session(env))  # a call past TOOL_TIMEOUT_S closes its session

        def _input_fits(self, length: int) -> bool:
            """Whether the next turn can be generated from an input of `length` tokens. Server mode: vLLM's own
            check (server_fits), which TRL's loop does not make, so an episode ends where vLLM would refuse the
            request mid-run. Otherwise TRL's: below vLLM's max_model_len in colocate mode, else below the model's
            max_position_embeddings."""
            if self.use_vllm and self.vllm_mode == "server" and self.server_max_model_len:
                return server_fits(length, self.max_completion_length, self.server_max_model_len)
            if self.use_vllm and self.vllm_mode == "colocate":
                return length < self.vllm_generation.llm.llm_engine.model_config.max_model_len
            config = self.model.config.text_config if self._is_vlm else self.model.config
            return length < config.max_position_embeddings

        def _agree_on_width(self, count: int) -> int:
            """The most prompts any process generates for this round (0: every process is done)."""
            if self.accelerator.num_processes == 1:
                return count
            counts = self.accelerator.gather(torch.tensor([count], device=self.accelerator.device))
            return int(counts.max().item())

    return RolloutLoopTrainer


def server_fits(prompt_tokens: int, max_tokens: int, max_model_len: int) -> bool:
    """vLLM 0.31's check on a request: it refuses (HTTP 400) a prompt longer than max_model_len - max_tokens.
    TRL asks for max_tokens = max_completion_length on every turn, tool rounds included."""
    return prompt_tokens + max_tokens <= max_model_len


def ended_in_text(completion: list) -> dict | None:
    """The episode's last assistant turn when it ended in plain text (no tool call), else None."""
    last = completion[-1] if completion else None
    if isinstance(last, dict) and last.get("role") == "assistant" and not last.get("tool_calls"):
        return last
    return None


def submit_final(env: Any, turn: dict) -> None:
    """`turn`'s text submitted through the env's answer tool where it has one (envs.core.tool.submit_final_answer),
    traced as the stack's call, not the model's. Both ROLLOUTS modes (trainer.async_grpo.async_budget)."""
    submitted = submit_final_answer(env, final_text(turn.get("content")))
    trace = trace_of(env)
    if submitted is not None and trace is not None:
        name, arguments, result, failed = submitted
        trace.call(f"{name} (final answer, submitted by the stack)", arguments, result, failed)


def final_text(content) -> str:
    """An assistant turn's answer as text, a leading <think> block left out."""
    text = content if isinstance(content, str) else "".join(
        part.get("text", "") for part in content or [] if isinstance(part, dict))
    return THINK.sub("", text).strip()


def trailing_tool_messages(messages: list[dict]) -> list[dict]:
    tail = []
    for message in reversed(messages):
        if message["role"] != "tool":
            break
        tail.insert(0, message)
    return tail
