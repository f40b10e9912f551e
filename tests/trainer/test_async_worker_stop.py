"""The end of an async run: TRL's rollout worker process exits by itself, at once, when the trainer stops it, instead
of TRL's 15 s join and SIGTERM: its rollouts in flight are cancelled (trainer.async_grpo.async_trainer.StackRolloutLoop
._run_loops) and its unread queues drained (trainer.async_grpo.async_run.drain_on_stop).

A spawned process that has put more into a multiprocessing queue than its pipe holds cannot exit until someone reads
the pipe (multiprocessing joins the queue's feeder thread at exit). TRL's worker puts samples ahead of the trainer,
so at the end of every run some are unread: with TRL's `stop()` alone the process below is terminated after 15 s
(exit code -15; measured once, 2026-12-04, and on every `make rehearse` with ROLLOUTS=async: "Child did not exit
within 15s; terminating"). This module stays cheap to import: the spawned child imports it.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp


def unread_samples_child(rollout_buffer, metrics_queue, stop_event) -> None:
    """What TRL's worker leaves behind at a run's end: a backlog of samples no one has read (an async `make rehearse`
    of 3-4 steps ended with 350-710 queued, 400-470 of them still in the worker's own buffer when it stopped), a
    metric, then a stop. 1,500 of 4 KiB: more than a drain slowed to ~20 reads/s (one timed wait on the empty metrics
    queue between two samples, as before 2026-12-06) gets through in TRL's 15 s."""
    for _ in range(1500):
        rollout_buffer.put(b"x" * 4096)
    metrics_queue.put({"rollout/inflight": 1.0})
    stop_event.wait()


def test_a_worker_with_unread_samples_exits_by_itself_when_stopped():
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trainer.async_grpo.async_run import drain_on_stop

    PartialState()  # TRL's worker logs through accelerate's logger, as in the trainer
    ctx = mp.get_context("spawn")  # as TRL's worker
    worker = object.__new__(AsyncRolloutWorker)  # TRL's class and its own stop() (its __init__ wants vLLM installed)
    worker.rollout_buffer, worker.metrics_queue = ctx.Queue(), ctx.Queue(maxsize=4096)
    worker._stop_event_mp = ctx.Event()
    worker._process = process = ctx.Process(
        target=unread_samples_child, args=(worker.rollout_buffer, worker.metrics_queue, worker._stop_event_mp),
        daemon=True)
    process.start()
    drain_on_stop(worker)
    worker.stop()
    assert process.exitcode == 0, f"the worker process was ended with exit code {process.exitcode}, not by itself"
    assert worker._process is None


def test_a_stop_cancels_the_rollouts_in_flight_instead_of_finishing_them(monkeypatch):
    """TRL's generate loop returns only once no rollout is in flight; here one never ends (as a rollout the CPU twin
    is still generating): the stop must end it, through TRL's own cancellation path, and not wait for it."""
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    from trainer.async_grpo.async_trainer import StackRolloutLoop

    entered, ended = asyncio.Event(), []

    async def trls_loops_with_a_rollout_that_never_ends(self, stop_event):
        entered.set()
        try:
            await asyncio.Event().wait()  # in flight, whatever the stop event says
        finally:
            ended.append("cancelled")

    monkeypatch.setattr(_AsyncRolloutLoop, "_run_loops", trls_loops_with_a_rollout_that_never_ends)
    loop = object.__new__(StackRolloutLoop)  # its __init__ wants a model, a dataset and a vLLM URL

    async def stop_once_running() -> None:
        stop = asyncio.Event()
        running = asyncio.ensure_future(StackRolloutLoop._run_loops(loop, stop))
        await entered.wait()
        stop.set()
        await asyncio.wait_for(running, timeout=60)  # a guard only: the cancel is immediate

    asyncio.run(stop_once_running())
    assert ended == ["cancelled"]
