"""trainer.run.async_run.TracedRolloutLoop: TRL 1.16's real async rollout loop (generate loop, env pool, get_reward,
scoring) against a real echo server with the stack's env factory (trainer.rollouts.envs_binding.EnvFactory), its vLLM
requests replaced by scripted turns (the one stand-in: no vLLM runs in this test). What it sends the trainer, reduced
the way TRL's trainer reduces it, gives the sync run's per-env figures; its traces fit rollouts.jsonl's schema and
hold each episode's calls and rewards."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import defaultdict
from types import SimpleNamespace

import pytest
from accelerate.state import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from envs import registry
from trainer.run import async_metrics
from trainer.rollouts import traces
from trainer.run.async_run import TracedRolloutLoop
from trainer.rollouts.envs_binding import EnvFactory, encode_row
from trainer.run.metrics import STATS

CALL = '<tool_call>\n{"name": "echo_message", "arguments": {"message": "hello"}}\n</tool_call><|im_end|>'
ANSWER = "done<|im_end|>"


class ScriptedTurnsLoop(TracedRolloutLoop):
    """vLLM replaced by a script: call echo_message once, then answer."""

    async def _generate_one_turn(self, prompt_ids):
        seen = self.tokenizer.decode(prompt_ids)
        text = ANSWER if "<tool_response>" in seen else CALL
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids, [-0.5] * len(ids)


def run_loop(loop: TracedRolloutLoop, samples_wanted: int) -> None:
    async def drive():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(loop._generate_loop(stop_event=stop)),
                 asyncio.create_task(loop._score_loop(stop_event=stop))]
        async with asyncio.timeout(120):
            while loop.rollout_buffer.qsize() < samples_wanted:
                for task in tasks:
                    if task.done():
                        task.result()  # a loop that died says why, now
                await asyncio.sleep(0.05)  # polling the queue the trainer reads, bounded by the timeout above
        stop.set()
        await asyncio.gather(*tasks)

    loop._loop.run_until_complete(drive())


@pytest.fixture
def traced_loop(tmp_path, tiny_model_dir, echo_server):
    PartialState()  # as TRL's worker child does first (its logger needs it)
    STATS.drain()
    spec = registry.get("echo")
    rows = [encode_row(dict(r)) for r in spec.make_dataset(4, 0)]
    loop = ScriptedTurnsLoop(
        model_name="tiny", dataset=Dataset.from_list(rows), reward_funcs=[],
        processing_class=AutoTokenizer.from_pretrained(tiny_model_dir), eos_token_ids=[],
        rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
        heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(),
        exception_info_queue=queue.Queue(), metrics_queue=queue.Queue(),
        environment_factory=EnvFactory("echo", spec.tool_class, echo_server.url), num_generations=2,
        max_inflight_tasks=2,
        max_tokens=64, trace_dir=str(tmp_path), trace_every=1, trace_samples=2)
    loop.eos_token_ids = [loop.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    yield loop
    loop._tool_pool.shutdown(wait=True)
    loop._loop.close()


def test_the_worker_sends_the_sync_per_env_figures_and_traces_one_group_per_policy_version(traced_loop, tmp_path):
    run_loop(traced_loop, samples_wanted=4)  # two groups of two, both of policy version 0
    samples = []
    while not traced_loop.rollout_buffer.empty():
        samples.append(traced_loop.rollout_buffer.get_nowait())
    sink = defaultdict(list)  # TRL's AsyncGRPOTrainer.log: the worker's pushes into the sink, reduced per key
    while not traced_loop._metrics_queue.empty():
        for key, value in traced_loop._metrics_queue.get_nowait().items():
            sink[key].append(value)
    record = async_metrics.record({k: _reduce_metric(k, v) for k, v in sink.items()})
    scored = len(sink["env/echo/reward_mean"]) and sum(den for _, den in sink["env/echo/reward_mean"])
    assert record["env/echo/episodes"] == scored >= 4
    assert record["env/echo/episode_length"] == 1.0  # one echo_message call per episode, as scripted
    assert record["env/echo/tool_failure_frequency"] == 0.0
    trained_rewards = [s.metrics["rewards/EchoTool"] for s in samples]
    assert min(trained_rewards) - 1e-9 <= record["env/echo/reward_mean"] <= max(trained_rewards) + 1e-9

    rows = traces.read(tmp_path / traces.ROLLOUTS_FILE)
    assert len(rows) == 2 and {r["step"] for r in rows} == {1} and {r["policy_version"] for r in rows} == {0}
    for row in rows:
        assert traces.problems(row) == [], row
        assert row["env"] == "echo" and row["reset"]  # the row's reset kwargs, from the env binding's trace
        [call] = row["tool_calls"]
        assert call["tool"] == "echo_message" and call["arguments"] == {"message": "hello"} and not call["failed"]
        assert "hello" in call["result"]
        assert row["rewards"]["EchoTool"] == row["env_reward"] == row["reward"]  # no other reward function


def test_the_worker_gets_a_traced_loop_class_it_can_pickle_by_name():
    """TRL's worker pickles its loop class into the spawned child: the traced loop is composed at module level, and
    a stack loop class that does not inherit TracedRollouts is refused with what to write."""
    import pickle

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

    from trainer.run.async_run import TracedRolloutLoop, TracedRollouts, use_traced_loop

    class Composed(TracedRollouts, _AsyncRolloutLoop):
        pass

    class Untraced(_AsyncRolloutLoop):
        pass

    worker = object.__new__(AsyncRolloutWorker)  # TRL's own class (its __init__ wants vLLM installed)
    worker._loop_kwargs = {}
    use_traced_loop(worker, trace_every=3)
    assert worker._loop_cls is TracedRolloutLoop and worker._loop_kwargs == {"trace_every": 3}
    assert pickle.loads(pickle.dumps(worker._loop_cls)) is TracedRolloutLoop
    worker._loop_cls = Composed
    use_traced_loop(worker, trace_every=3)
    assert worker._loop_cls is Composed  # a stack loop that already traces stays as it is
    worker._loop_cls = Untraced
    with pytest.raises(TypeError, match=r"class Untraced\(TracedRollouts, \.\.\.\)"):
        use_traced_loop(worker)
