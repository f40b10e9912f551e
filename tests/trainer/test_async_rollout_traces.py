"""trainer.async_grpo.async_run.TracedRolloutLoop: TRL 1.16's real async rollout loop (generate loop, env pool, get_reward,
scoring) against a real echo server with the stack's env factory (trainer.rollouts.envs_binding.EnvFactory), its vLLM
requests replaced by scripted turns (the one stand-in: no vLLM runs in this test). What it sends the trainer, reduced
the way TRL's trainer reduces it, gives the sync run's per-env figures; its traces fit rollouts.jsonl's schema and
hold each episode's calls and rewards."""

from __future__ import annotations

import asyncio
import queue
import threading
from types import SimpleNamespace

import pytest
from accelerate.state import PartialState
from datasets import Dataset
from transformers import AutoTokenizer
from trl.experimental.async_grpo.async_grpo_trainer import _reduce_metric

from envs import registry
from tests.trainer.worker_loops import ScriptedTurnsLoop, close, drained, echo_worker_loop, run_loop
from trainer.core import async_metrics
from trainer.rollouts import traces
from trainer.async_grpo.async_run import TracedRolloutLoop
from trainer.core.metrics import STATS


@pytest.fixture
def traced_loop(tmp_path, tiny_model_dir, echo_server):
    loop = echo_worker_loop(ScriptedTurnsLoop, tmp_path, tiny_model_dir, echo_server.url)
    yield loop
    close(loop)


def test_the_worker_sends_the_sync_per_env_figures_and_traces_one_group_per_policy_version(traced_loop, tmp_path):
    run_loop(traced_loop, samples_wanted=4)  # two groups of two, both of policy version 0
    samples, sink = drained(traced_loop)  # TRL's AsyncGRPOTrainer.log: the worker's pushes into the sink, reduced per key
    for key in ("env/echo/reward_mean", "env/echo/episode_length", "env/echo/tool_failures_per_episode"):
        sink[key].append(sum(s.metrics[key] for s in samples) / len(samples))  # TRL's collator: the trained samples'
    record = async_metrics.record({k: _reduce_metric(k, v) for k, v in sink.items()})
    assert record["env/echo/episodes"] >= 4  # finished by the worker (the queued groups' and maybe more)
    assert record["env/echo/episode_length"] == 1.0  # one echo_message call per episode, as scripted
    assert record["env/echo/tool_failure_frequency"] == 0.0
    for sample in samples:  # each sample carries its own episode's env reward: here the only reward function's
        assert sample.metrics["env/echo/reward_mean"] == sample.metrics["rewards/EchoTool"]
    # the step record's time/env_s and time/scoring_s: every group pushes its seconds (resets, calls, rewards; scoring)
    groups = len(sink[async_metrics.SCORING_SECONDS])
    assert groups == len(sink[async_metrics.ENV_SECONDS]) >= 2
    split = async_metrics.time_split({k: _reduce_metric(k, v) for k, v in sink.items()}, None)
    assert split["time/env_s"] > 0 and split["time/scoring_s"] > 0

    rows = traces.read(tmp_path / traces.ROLLOUTS_FILE)
    assert len(rows) == 2 and {r["step"] for r in rows} == {1} and {r["policy_version"] for r in rows} == {0}
    for row in rows:
        assert traces.problems(row) == [], row
        assert row["env"] == "echo" and row["reset"]  # the row's reset kwargs, from the env binding's trace
        [call] = row["tool_calls"]
        assert call["tool"] == "echo_message" and call["arguments"] == {"message": "hello"} and not call["failed"]
        assert "hello" in call["result"]
        assert row["rewards"]["EchoTool"] == row["env_reward"] == row["reward"]  # no other reward function


def test_trace_samples_beyond_one_group_traces_more_groups_of_the_same_policy_version(traced_loop, tmp_path):
    """TRACE_SAMPLES counts rollouts, as in sync mode: 4 of a version whose groups hold 2 are two groups' rollouts
    (the chaos bench checks every traced call's reply; one group per version left it a handful to check)."""
    traced_loop._trace_samples = 4
    run_loop(traced_loop, samples_wanted=6)  # three groups of two or more, all of policy version 0
    rows = traces.read(tmp_path / traces.ROLLOUTS_FILE)
    assert len(rows) == 4 and {r["policy_version"] for r in rows} == {0}


def test_the_worker_gets_a_traced_loop_class_it_can_pickle_by_name():
    """TRL's worker pickles its loop class into the spawned child: the traced loop is composed at module level, and
    a stack loop class that does not inherit TracedRollouts is refused with what to write."""
    import pickle

    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop

    from trainer.async_grpo.async_run import TracedRolloutLoop, TracedRollouts, use_traced_loop

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


# ---------------------------------------------------------------------------- #33: infra-ended episodes, async side
class EveryOtherResetDown(registry.get("echo").tool_class):
    """The echo tool class whose env is unreachable at every second reset (the session client's error after its
    reconnect wait, raised at once): each group of two then has one episode the env side ended."""

    resets = 0

    def reset(self, **row):
        EveryOtherResetDown.resets += 1
        if EveryOtherResetDown.resets % 2 == 0:
            raise ConnectionError("Cannot reach env server at ws://env-echo:8000/ws: [Errno 111] refused")
        return super().reset(**row)


def infra_loop(tmp_path, tiny_model_dir, url, tool_class, reward_funcs):
    STATS.drain_infra_failures()
    return echo_worker_loop(ScriptedTurnsLoop, tmp_path, tiny_model_dir, url, tool_class=tool_class,
                            reward_funcs=reward_funcs)


def test_an_episode_the_env_side_ended_is_counted_and_never_reaches_the_trainer(tmp_path, tiny_model_dir,
                                                                                echo_server, monkeypatch):
    """With the unfinished-episode penalty among the reward functions (it scores an unmarked row, so it must see the
    episodes to say None), each group's one env-ended episode is out of its baseline (the other's advantage is 0: it
    is the only scored row), its sample is dropped before the queue (never in a loss or its token count), and the
    step record counts it under the sync trainer's key."""
    from trainer.rollouts import infra_failures
    from trainer.rollouts.rewards import unfinished_penalty

    monkeypatch.setattr(EveryOtherResetDown, "resets", 0)
    monkeypatch.setattr(infra_failures, "WINDOWS", infra_failures.FailureWindow())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    penalty = unfinished_penalty(-1.0, frozenset({tokenizer.convert_tokens_to_ids("<|im_end|>")}))
    loop = infra_loop(tmp_path, tiny_model_dir, echo_server.url, EveryOtherResetDown, [penalty])
    try:
        run_loop(loop, samples_wanted=2)
    finally:
        close(loop)
    samples, sink = drained(loop)
    groups = len(sink[async_metrics.INFRA_TOTAL])
    assert groups >= 2 and sink[async_metrics.INFRA_TOTAL] == [1.0] * groups  # one env-ended episode per group
    assert len(samples) == groups  # one trained sample per group: the env-ended one was dropped
    for sample in samples:
        assert sample.advantage == 0.0, "the env-ended episode was in the group's baseline"
        assert sample.metrics["reward"] == sample.metrics["reward"]  # not NaN: a scored episode
        assert sample.completion_mask.sum() > 0
    record = async_metrics.record({k: _reduce_metric(k, v) for k, v in sink.items()})
    assert record[infra_failures.METRIC] == groups
    assert record["env/echo/infra_failures"] >= 1
    [traced] = [r for r in traces.read(tmp_path / traces.ROLLOUTS_FILE) if r["infra_failure"]]
    assert traced["infra_failure"].startswith("reset failed: connection lost") and traced["reward"] is None


class AlwaysDown(registry.get("echo").tool_class):
    def reset(self, **row):
        raise ConnectionError("Cannot reach env server at ws://env-echo:8000/ws: [Errno 111] refused")


def test_a_dead_env_in_the_rollout_worker_stops_the_trainer_with_the_sync_line(tmp_path, tiny_model_dir, monkeypatch):
    """TRL's worker loop (`run`, as in the spawned child) ends on EnvDown and reports it; the trainer's health check
    (async_run.stop_on_env_or_vllm_down over TRL's own) raises that EnvDown, one line, on its next empty queue: train.py then
    exits 6, as in sync mode, instead of a chained traceback or a wait for the 300 s heartbeat."""
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.rollouts import infra_failures
    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down

    monkeypatch.setattr(infra_failures, "WINDOWS", infra_failures.FailureWindow(window=8, min_episodes=4))
    loop = infra_loop(tmp_path, tiny_model_dir, "http://127.0.0.1:9", AlwaysDown, [])

    async def loops_without_http_session(stop_event):  # TRL's _run_loops minus aiohttp's session (not installed here)
        await asyncio.gather(loop._generate_loop(stop_event=stop_event), loop._score_loop(stop_event=stop_event))

    loop._run_loops = loops_without_http_session
    with pytest.raises(infra_failures.EnvDown):
        loop.run()  # TRL's own: puts (type, message, traceback), sets the failed event, re-raises
    worker = object.__new__(AsyncRolloutWorker)  # TRL's class (its __init__ wants vLLM installed)
    worker._failed_event, worker._exception_info_queue = loop._failed_event, loop._exception_info_queue
    worker._heartbeat_value, worker._process = SimpleNamespace(value=0.0), None
    stop_on_env_or_vllm_down(worker)
    with pytest.raises(infra_failures.EnvDown) as stopped:
        worker.check_health(300.0)
    line = str(stopped.value)
    assert "\n" not in line and line.startswith("env echo: ") and "Cannot reach env server" in line


def test_the_health_check_keeps_trls_report_for_other_failures_and_sees_a_silent_death_at_once():
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.async_grpo.async_run import stop_on_env_or_vllm_down

    worker = object.__new__(AsyncRolloutWorker)
    worker._failed_event, worker._exception_info_queue = threading.Event(), queue.Queue(maxsize=1)
    worker._heartbeat_value = SimpleNamespace(value=__import__("time").time())
    worker._process = SimpleNamespace(pid=4242, exitcode=-9, is_alive=lambda: False)
    stop_on_env_or_vllm_down(worker)
    with pytest.raises(RuntimeError, match=r"pid 4242\) exited with code -9") as died:
        worker.check_health(300.0)  # the heartbeat is fresh: TRL's check alone would wait for it to go stale
    assert "\n" not in str(died.value)
    worker._failed_event.set()
    worker._exception_info_queue.put(("ValueError", "bad row", "Traceback ..."))
    with pytest.raises(RuntimeError, match="Rollout worker child has failed") as failed:
        worker.check_health(300.0)
    assert "ValueError: bad row" in str(failed.value.__cause__)


def test_the_worker_registers_its_tokenizers_own_tokens_for_neutralisation(monkeypatch):
    """#63: TRL's worker is a spawned process, where nothing had registered the tokenizer's special tokens, so an
    env's `<eos>` or `<start_of_image>` (Gemma's) reached the prompt as such. TRL's real loop, built as the child
    builds it, with a tokenizer that has them."""
    from envs.core import untrusted
    from trainer.tiny_model import make_tokenizer

    monkeypatch.setattr(untrusted, "_tokens", untrusted._tokens)  # restored after the test
    untrusted.register_tokens([])  # what a freshly spawned process has: the generic patterns only
    tokenizer = make_tokenizer(["a b c"], 300)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<eos>", "<start_of_image>"]})
    assert untrusted.safe_text("<eos><start_of_image>") == "<eos><start_of_image>"
    PartialState()
    loop = TracedRolloutLoop(
        model_name="tiny", dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "x"}]}]),
        reward_funcs=[lambda completions, **kwargs: [0.0] * len(completions)], processing_class=tokenizer,
        eos_token_ids=[], rollout_buffer=queue.Queue(), model_version_value=SimpleNamespace(value=0),
        heartbeat_value=SimpleNamespace(value=0.0), failed_event=threading.Event(), exception_info_queue=queue.Queue(),
        metrics_queue=queue.Queue(), num_generations=2, max_inflight_tasks=2, max_tokens=8)
    try:
        assert untrusted.safe_text("<eos><start_of_image>") == "\u2039eos>\u2039start_of_image>"
    finally:
        loop._tool_pool.shutdown(wait=True)
        loop._loop.close()
