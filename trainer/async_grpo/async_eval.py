"""Held-out episodes for ROLLOUTS=async (EVAL_EVERY): played greedily in the trainer's rank-0 process, beside the rollout
worker, by the stack's own async rollout loop (`StackRolloutLoop`: TRL's episode loop with the episode budget, tool
timeouts and the final-answer submission), against the vLLM server the worker generates with.

The async trainer's process neither generates nor holds env sessions (its spawned worker does), so the evaluation
builds a second loop here from the worker's own settings (`AsyncRolloutWorker._loop_kwargs`: model, tokenizer,
chat template kwargs, env factories, budget, limits), with temperature 0 (vLLM: greedy) and no traces, and plays each
held-out row as the worker plays a rollout: reset, the observation folded into the prompt, `_generate_one`, the env's
`get_reward`. Its env sessions are its own, at most `AsyncRollouts.eval_sessions` at once per env (counted in the
capacity the stack sizes: RunConfig.sessions_needed); they are closed after each evaluation. Requests name the policy
version the worker's requests name (the shared model version: an adapter's `-v<N>` with LORA_R).

trainer.run.evaluation.AsyncEvalCallback drives it (this floor cannot import trainer.run): `play` returns plain tuples.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import queue
import threading
from types import SimpleNamespace
from typing import Any

from envs.core.tool import close_session, infra_failure_of
from trainer.core.trl_privates import environment_pool

# The TRL privates used here (the loop's `_loop`, `_env_tools`, `_standalone_tools`, `_tool_pool`, `_generate_one`,
# its env pool through trl_privates.environment_pool) are pinned in trainer/core/trl_privates.py.

# (task index, env reward, tool calls, failed calls, tokens generated, why the env side ended it or None)
Played = tuple[int, float, int, int, int, "str | None"]


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """The row's prompt with the reset observation folded into its last message, as TRL's worker and trainer do."""
    if observation is None:
        return list(prompt)
    last = prompt[-1]
    content = last["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**last, "content": content + observation}]


class EpisodePlayer:
    """A greedy copy of the rollout worker's loop, in this process; `play(env, rows)` per evaluation, `close()` at the
    end. `session`: a stand-in for the aiohttp session (tests), else one is opened on first use."""

    def __init__(self, loop_cls: type, loop_kwargs: dict[str, Any], model_version_value: Any, concurrency: int,
                 session: Any = None) -> None:
        kwargs = {**loop_kwargs, "temperature": 0.0, "max_inflight_tasks": max(1, concurrency), "num_generations": 1,
                  "trace_dir": None, "trace_every": 0}
        if "admission" in kwargs:  # ASYNC_ADMISSION gates training rollouts only (trainer.async_grpo.admission)
            kwargs["admission"] = "free"
        self.concurrency = max(1, concurrency)
        self.metrics: queue.Queue = queue.Queue(maxsize=64)  # the loop's own counters: not the run's, dropped
        self.loop = loop_cls(**kwargs, rollout_buffer=queue.Queue(), model_version_value=model_version_value,
                             heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(),
                             exception_info_queue=queue.Queue(), metrics_queue=self.metrics)
        self.loop.session = session
        self._own_session = session is None

    def play(self, key: str | None, rows: list[dict]) -> list[Played]:
        """Each encoded row (trainer.run.held_out.encoded) played once, greedily, `concurrency` at a time; `key`: the
        env's name in a multi-env run, else None (TRL's key for the one env)."""
        try:
            return self.loop._loop.run_until_complete(self._play(key, rows))
        finally:
            for env in environment_pool(self.loop).get(key, []):
                close_session(env)  # between evaluations the sessions are free again (a reset opens a new one)
            while not self.metrics.empty():
                self.metrics.get_nowait()

    async def _play(self, key: str | None, rows: list[dict]) -> list[Played]:
        if self.loop.session is None:
            import aiohttp

            self.loop.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency))
        slots = asyncio.Semaphore(self.concurrency)

        async def one(task: int, row: dict) -> Played:
            async with slots:
                return await self._episode(task, key, row)

        return list(await asyncio.gather(*(one(i, row) for i, row in enumerate(rows))))

    async def _episode(self, task: int, key: str | None, row: dict) -> Played:
        loop, running = self.loop, asyncio.get_running_loop()
        pool = environment_pool(loop)[key]
        env = pool.pop() if pool else loop.environment_factories[key]()
        try:
            kwargs = {k: v for k, v in row.items() if k != "environment"}
            observation = await running.run_in_executor(loop._tool_pool, functools.partial(env.reset, **kwargs))
            methods = [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
                       if name not in ("reset", "get_reward") and not name.startswith("_")]
            tool_dict = {tool.__name__: tool for tool in loop._standalone_tools + methods}
            completion, ids, _, calls, failures, _ = await loop._generate_one(
                with_observation(row["prompt"], observation), tool_dict=tool_dict, tools=loop._env_tools[key])
            getattr(loop, "_episode_of", {}).pop(id(completion), None)  # TracedRollouts' note, for a group never scored
            reward = await running.run_in_executor(loop._tool_pool, env.get_reward)
            return task, float(reward or 0.0), calls, failures, len(ids), infra_failure_of(env)
        finally:
            pool.append(env)

    def close(self) -> None:
        for envs in environment_pool(self.loop).values():
            for env in envs:
                close_session(env)
        if self._own_session and self.loop.session is not None:
            self.loop._loop.run_until_complete(self.loop.session.close())
        self.loop._tool_pool.shutdown(wait=False)
        self.loop._loop.close()
