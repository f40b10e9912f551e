"""TRL 1.16's async rollout worker loop built in-process, as its spawned worker builds it, against a real echo server
with its vLLM requests replaced by scripted turns (the one stand-in: no vLLM runs in these tests); shared by the
async tests (traces, admission, zero-variance groups, the judge, the episode budget)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import defaultdict
from collections.abc import Callable
from types import SimpleNamespace

from trainer.async_grpo.async_run import TracedRolloutLoop

CALL = '<tool_call>\n{"name": "echo_message", "arguments": {"message": "hello"}}\n</tool_call><|im_end|>'
ANSWER = "done<|im_end|>"


class ScriptedTurnsLoop(TracedRolloutLoop):
    """vLLM replaced by a script: call echo_message once, then answer."""

    async def _generate_one_turn(self, prompt_ids):
        seen = self.tokenizer.decode(prompt_ids)
        text = ANSWER if "<tool_response>" in seen else CALL
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, [-0.5] * len(ids)


def echo_worker_loop(loop_cls: type, tmp_path, tiny_model_dir, url: str, *, tool_class: type | None = None,
                     tasks: int = 4, reward_funcs=(), **options):
    """`loop_cls` (a TracedRolloutLoop subclass) on the echo env at `url`: `tasks` dataset rows, groups of two, the
    tiny model's tokenizer, traces of every step into `tmp_path` unless `options` say otherwise (any of the loop's
    keyword arguments). Close it with `close`."""
    from accelerate.state import PartialState
    from datasets import Dataset
    from transformers import AutoTokenizer

    from envs import registry
    from trainer.core.metrics import STATS
    from trainer.rollouts.envs_binding import EnvFactory, encode_row

    PartialState()  # as TRL's worker child does first (its logger needs it)
    STATS.drain()
    spec = registry.get("echo")
    options = {"max_inflight_tasks": 2, "max_tokens": 64, "trace_dir": str(tmp_path), "trace_every": 1,
               "trace_samples": 2, **options}
    loop = loop_cls(
        model_name="tiny", dataset=Dataset.from_list([encode_row(dict(r)) for r in spec.make_dataset(tasks, 0)]),
        reward_funcs=list(reward_funcs), processing_class=AutoTokenizer.from_pretrained(tiny_model_dir),
        eos_token_ids=[], rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
        heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(),
        exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(),
        environment_factory=EnvFactory("echo", tool_class or spec.tool_class, url), num_generations=2, **options)
    loop.eos_token_ids = [loop.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    return loop


def close(loop) -> None:
    loop._tool_pool.shutdown(wait=True)
    loop._loop.close()


def run_until(loop, done: Callable[[], bool], timeout_s: float = 120) -> None:
    """The worker's generate and score loops until `done()`; a loop that died raises its error now."""
    async def drive():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(loop._generate_loop(stop_event=stop)),
                 asyncio.create_task(loop._score_loop(stop_event=stop))]
        async with asyncio.timeout(timeout_s):
            while not done():
                for task in tasks:
                    if task.done():
                        task.result()  # a loop that died says why, now
                await asyncio.sleep(0.05)  # polling what the test waits for, bounded by the timeout above
        stop.set()
        await asyncio.gather(*tasks)

    loop._loop.run_until_complete(drive())


def run_loop(loop, samples_wanted: int) -> None:
    """Until the trainer's queue holds `samples_wanted` samples."""
    run_until(loop, lambda: loop.rollout_buffer.qsize() >= samples_wanted)


def drained(loop) -> tuple[list, dict[str, list]]:
    """What a finished rollout loop left: the samples it queued for the trainer, and every metric value it sent."""
    samples = []
    while not loop.rollout_buffer.empty():
        samples.append(loop.rollout_buffer.get_nowait())
    sink = defaultdict(list)
    while not loop._metrics_queue.empty():
        for key, value in loop._metrics_queue.get_nowait().items():
            sink[key].append(value)
    return samples, sink
