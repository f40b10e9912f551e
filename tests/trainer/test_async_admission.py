"""ASYNC_ADMISSION (issue 65 item 3): which episodes TRL's async rollout worker starts, and the figures that show what
dropping stale samples does (trainer.async_grpo.admission).

The ledger's rule is checked on its own, step by step; then the stack's loop class (StackRolloutLoop: TRL 1.16's real
generate and score loops, env pool and scoring) runs against a real echo server, vLLM's completions replaced by a
script (the one stand-in: no vLLM runs here) and the trainer's progress played by the test: it takes rows from the
queue and bumps the policy version, as TRL's RolloutQueueDataset and _sync_weight do."""

from __future__ import annotations

import asyncio
import math
import queue

import pytest

from tests.trainer.worker_loops import ANSWER, CALL, drained, echo_worker_loop
from trainer.async_grpo.admission import GENERATED_REWARD, GENERATED_TOKENS, TRAINED_TOKENS, Ledger


# ---------------------------------------------------------------------------- the rule
def test_a_new_group_waits_while_it_could_push_the_oldest_outstanding_one_past_max_staleness():
    ledger = Ledger(max_staleness=2, step_samples=4, group_size=2)
    ledger.observe(version=0, waiting=0)
    assert ledger.room(0)  # nothing outstanding
    for group in range(6):  # 6 groups of 2 = 12 rows = (0 + 2 + 1) x 4: all of them in time, at worst
        assert ledger.room(0), group
        ledger.start(group, 0)
    assert not ledger.room(0)  # a 7th could be taken after group 0's rows, which would then be 3 versions late
    ledger.scored(0, 0, rows=2)
    ledger.scored(1, 0, rows=2)  # sent to the trainer: still outstanding until it takes them
    ledger.observe(version=0, waiting=4)
    assert not ledger.room(0)
    ledger.observe(version=1, waiting=0)  # the trainer took both groups and stepped: version 1
    # the 8 rows of groups 2-5 (version 0) must be taken within versions 1-2 (8 rows): a new group could come first
    assert not ledger.room(1)
    for group in (2, 3, 4, 5):
        ledger.scored(group, 0, rows=2)
    ledger.observe(version=2, waiting=4)  # groups 2-3 taken: version 2; groups 4-5 must be the next 4 rows
    assert not ledger.room(2)
    ledger.observe(version=3, waiting=0)
    assert ledger.outstanding() == 0 and ledger.room(3)
    ledger.start(6, 3)
    assert ledger.room(3)  # 2 + 2 rows <= (3 + 2 + 1 - 3) x 4


def test_a_group_already_past_the_bound_anchors_nothing_and_an_empty_ledger_always_admits():
    ledger = Ledger(max_staleness=1, step_samples=2, group_size=2)
    ledger.observe(0, 0)
    ledger.start(0, 0)
    ledger.observe(5, 0)  # group 0 started at version 0, now 5 behind: dropped whatever happens
    assert ledger.room(5)  # the rule anchors at the current version, not at a lost group
    ledger.scored(0, 0, rows=0)  # all left out (flat, env-ended): nothing reaches the trainer
    assert ledger.outstanding() == 0 and ledger.room(5)


def test_packed_steps_that_take_more_rows_than_a_step_s_samples_widen_the_room():
    ledger = Ledger(max_staleness=0, step_samples=2, group_size=2)
    ledger.observe(0, 0)
    for group in range(5):
        ledger.start(group, 0)
        ledger.scored(group, 0, rows=2)
    ledger.observe(1, 0)  # the trainer took all 10 rows in one version: packed
    assert ledger.per_version == 10


def test_within_a_version_the_rows_taken_so_far_widen_the_room_before_any_bump():
    """A packed first step takes hundreds of rows before the version moves: counted at a step's samples (2), the
    rule would let one group start at a time; the trainer has taken 12 and not stepped, so it takes 13 or more."""
    ledger = Ledger(max_staleness=1, step_samples=2, group_size=2)
    ledger.observe(0, 0)
    for group in range(6):
        ledger.start(group, 0)
        ledger.scored(group, 0, rows=2)
    ledger.observe(0, 0)  # all 12 taken at version 0
    ledger.start(6, 0)
    assert ledger.room(0)  # 12 + 2 + 2 <= (0 + 1 + 1 - 0) x 13


# ---------------------------------------------------------------------------- TRL's real loop
class Trainer:
    """The trainer's side, played by the test: takes `per_step` rows from the queue, then bumps the version (TRL's
    dataset drops a row more than `max_staleness` versions old, as here)."""

    def __init__(self, loop, per_step: int, max_staleness: int) -> None:
        self.loop, self.per_step, self.max_staleness = loop, per_step, max_staleness
        self.trained, self.dropped, self.taken_this_step = [], [], 0

    def take(self) -> bool:
        try:
            sample = self.loop.rollout_buffer.get_nowait()
        except queue.Empty:
            return False
        version = self.loop._model_version_value.value
        (self.dropped if version - sample.model_version > self.max_staleness else self.trained).append(sample)
        if version - sample.model_version <= self.max_staleness:
            self.taken_this_step += 1
            if self.taken_this_step == self.per_step:
                self.loop._model_version_value.value += 1
                self.taken_this_step = 0
        return True


def stack_loop(tmp_path, tiny_model_dir, url, admission: str, slow_every: int = 0):
    """StackRolloutLoop, vLLM scripted: one echo_message call, then an answer; every `slow_every`-th group's episodes
    take a long first turn (a slow episode, as a long one is on vLLM)."""
    from trainer.async_grpo.async_trainer import StackRolloutLoop

    class Scripted(StackRolloutLoop):
        slow_groups: set = set()

        async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
            if slow_every and group_id % slow_every == 0:
                Scripted.slow_groups.add(group_id)
            return await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)

        async def _generate_one_turn(self, prompt_ids):
            seen = self.tokenizer.decode(prompt_ids)
            text = ANSWER if "<tool_response>" in seen else CALL
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return ids, [-0.5] * len(ids)

    return echo_worker_loop(Scripted, tmp_path, tiny_model_dir, url, tasks=8, max_inflight_tasks=8, trace_every=0,
                            trace_samples=0, admission=admission, max_staleness=1, step_samples=2,
                            request_seeds=False)


def drive(loop, trainer: Trainer, steps: int) -> None:
    """Run the worker's loops and the trainer's takes until `steps` versions were trained."""
    async def run():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(loop._generate_loop(stop_event=stop)),
                 asyncio.create_task(loop._score_loop(stop_event=stop))]
        async with asyncio.timeout(180):
            while loop._model_version_value.value < steps:
                for task in tasks:
                    if task.done():
                        task.result()
                if not trainer.take():
                    await asyncio.sleep(0.02)  # the queue empty: let the worker run, bounded by the timeout above
        stop.set()
        tasks[0].cancel()  # as StackRolloutLoop._run_loops on a stop: held groups never start
        await asyncio.gather(*tasks, return_exceptions=True)

    try:
        loop._loop.run_until_complete(run())
    finally:
        loop._tool_pool.shutdown(wait=True)
        loop._loop.close()


@pytest.mark.parametrize("admission", ["free", "bounded"])
def test_the_worker_logs_generated_and_trained_figures_and_bounded_keeps_every_sample_in_time(
        admission, tmp_path, tiny_model_dir, echo_server):
    loop = stack_loop(tmp_path, tiny_model_dir, echo_server.url, admission)
    trainer = Trainer(loop, per_step=2, max_staleness=1)
    drive(loop, trainer, steps=6)
    _, sink = drained(loop)
    assert sink[GENERATED_REWARD] and sink[GENERATED_TOKENS]  # (sum, count) rates, every scored group
    assert all(not math.isnan(s.metrics[TRAINED_TOKENS]) and s.metrics[TRAINED_TOKENS] > 0 for s in trainer.trained)
    if admission == "bounded":
        # 8 slots, a step of 2 samples, MAX_STALENESS 1: free starts 4 groups at version 0 and the last ones come
        # back 2+ versions late; bounded starts a group only while every outstanding row can still be taken in time
        assert trainer.dropped == []
        assert sink["async/admission_wait_s"]
    else:
        assert trainer.dropped  # TRL's free admission: what came back late was dropped


# ---------------------------------------------------------------------------- the setting
def test_async_admission_is_an_async_knob_and_reaches_the_worker():
    from contract.config import ConfigError, GpuMode, RunConfig

    default = RunConfig.load([], rollouts="async")
    assert default.rollouts.async_admission == "bounded"  # chosen from make bench-async-stress (docs/async.md)
    assert RunConfig.load([], rollouts="async", async_admission="free").rollouts.async_admission == "free"
    with pytest.raises(ConfigError, match="ASYNC_ADMISSION=free is a setting of ROLLOUTS=async"):
        RunConfig.load([], rollouts="sync", async_admission="free")
    with pytest.raises(ConfigError, match="ASYNC_ADMISSION"):
        RunConfig.load([], rollouts="async", async_admission="hold")
    cfg = RunConfig.load([], rollouts="async", train_mode="gpu", weight_transfer="reload", zero_std_groups="resample",
                         zero_std_resample_max=0.5)
    assert cfg.resolved(GpuMode()).zero_std_resample_max == 0.5
