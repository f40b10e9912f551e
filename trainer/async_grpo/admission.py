"""ROLLOUTS=async: which episodes TRL's rollout worker starts (ASYNC_ADMISSION), and the figures that show what dropping
stale samples does to what is trained (issue 65 item 3). `AdmittedRollouts` is a mixin for the worker's loop class (it
runs in the spawned worker process, on one asyncio loop: no locks needed).

TRL 1.16's worker starts an episode whenever one of its `max_inflight_tasks` slots is free, and the trainer drops a
sample that reaches it more than MAX_STALENESS weight updates after its group was started. Which samples go stale is
not random: the slow episodes (long, many tool calls, often the hard or failed ones) finish last, so dropping tilts the
trained batch toward the fast ones. Every step logs the two sides (docs/async.md "Stale samples: drop or hold"):

    async/generated_reward, async/generated_tokens   mean reward and completion tokens of every episode the worker
                                                     scored in the logging window (before any drop)
    reward, async/trained_tokens                     the same over the samples the step trained (per training row)
    async/admission_wait_s                           mean seconds a new group waited to start (bounded only)

ASYNC_ADMISSION=bounded holds a new group while, if it went ahead, the oldest outstanding work could reach the trainer
more than MAX_STALENESS updates late. `Ledger` counts the rows outstanding (queued for the trainer, and one per
episode started but not scored) and the trainer's progress (rows it took from the queue, and at which policy version).
The trainer takes rows in the order they finish, so in the worst case the oldest outstanding row is taken last, after
every other outstanding row: it stays in time while

    taken this version + outstanding + the new group's rows <= (oldest version + MAX_STALENESS + 1 - version) x rows
                                                               the trainer takes per version

(AReaL's staleness-bounded admission, anchored at the oldest outstanding version rather than the current one; rows per
version: the samples of one optimizer step, or more where the trainer was seen to take more: packed steps, learned
from the last version bump and, within a version, at least one more than taken so far). A group
already started is never held (its group-mates are what lets it be scored), work already past the bound does not
anchor the rule (it is dropped whatever happens), and with nothing outstanding a group always starts. The trainer still
drops what comes back stale (an episode may produce more rows than the one counted); the figures say how often.

Under bounded, a group's `model_version` is the version at which it was let start (TRL stamps when its first episode
took a slot and reset its env, which may be earlier while it waited): the tokens were sampled from then on.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from typing import Any

MODES = ("free", "bounded")
POLL_S = 0.05  # how often a held group looks again (the trainer's version and queue live in other processes)
GENERATED_REWARD = "async/generated_reward"
GENERATED_TOKENS = "async/generated_tokens"
TRAINED_TOKENS = "async/trained_tokens"
ADMISSION_WAIT = "async/admission_wait_s"


class Ledger:
    """Outstanding work and the trainer's progress, in training rows (pure bookkeeping: tests drive it directly)."""

    def __init__(self, max_staleness: int, step_samples: int, group_size: int) -> None:
        self.max_staleness, self.step_samples, self.group_size = max_staleness, max(1, step_samples), group_size
        self.per_version = self.step_samples  # rows the trainer takes per policy version (estimate, grows if seen)
        self.open: dict[int, int] = {}  # group started, not yet scored -> version it started at
        self.queued: collections.deque[tuple[int, int]] = collections.deque()  # (version, pushed count after it)
        self.pushed = 0  # rows sent to the trainer's queue
        self.taken = 0  # rows the trainer took (pushed less what its queue still holds)
        self.version: int | None = None  # the trainer's policy version when last observed
        self.taken_at_version = 0  # rows taken when that version was first observed

    def observe(self, version: int, waiting: int) -> None:
        """The trainer's policy version now, and the rows still waiting in its queue."""
        taken = max(self.taken, self.pushed - waiting)
        if self.version is None:
            self.version, self.taken_at_version = version, taken
        elif version != self.version:
            if version > self.version:  # packed steps take more than a step's samples: learn it
                seen = math.ceil((taken - self.taken_at_version) / (version - self.version))
                self.per_version = max(self.step_samples, seen)
            self.version, self.taken_at_version = version, taken
        self.taken = taken
        while self.queued and self.queued[0][1] <= taken:
            self.queued.popleft()

    def outstanding(self) -> int:
        return (self.pushed - self.taken) + self.group_size * len(self.open)

    def room(self, version: int) -> bool:
        """Whether a new group may start now at `version` (observe first)."""
        outstanding = self.outstanding()
        if outstanding == 0:
            return True
        live = [v for v in (*self.open.values(), *(v for v, _ in self.queued)) if version - v <= self.max_staleness]
        oldest = min(live, default=version)
        taken_now = self.taken - self.taken_at_version
        # the trainer has not stepped yet: it takes at least one row more than it took at this version (a packed step,
        # before a version bump has shown its size, else trickles one group at a time)
        per_version = max(self.per_version, taken_now + 1)
        return taken_now + outstanding + self.group_size <= \
            (oldest + self.max_staleness + 1 - version) * per_version

    def start(self, group_id: int, version: int) -> None:
        self.open.setdefault(group_id, version)

    def scored(self, group_id: int, version: int, rows: int) -> None:
        """A group scored; `rows` of it sent to the trainer (0: all left out)."""
        self.open.pop(group_id, None)
        if rows:
            self.pushed += rows
            self.queued.append((version, self.pushed))


class AdmittedRollouts:
    """Mixin for TRL's `_AsyncRolloutLoop`, first in the stack's loop class (it sees what `_score_group` finally
    queues); see the module docstring."""

    def __init__(self, *, admission: str = "free", max_staleness: int = 4, **kwargs: Any) -> None:
        super().__init__(**kwargs)  # TracedRollouts, next, sets step_samples (the samples of one optimizer step)
        if admission not in MODES:
            raise ValueError(f"ASYNC_ADMISSION={admission!r}: choose from {', '.join(MODES)}")
        self.admission = admission
        self._ledger = Ledger(max_staleness, getattr(self, "step_samples", 0) or self.num_generations,
                              self.num_generations)
        self.scored_rewards: dict[int, list[float]] = {}  # group -> every episode's reward (TracedRollouts fills it)

    async def _generate_one(self, prompt, tool_dict, tools, group_id: int = 0):
        if group_id not in self._ledger.open:
            waited = await self._admit(group_id)
            if self.admission == "bounded":
                self._rates[ADMISSION_WAIT][0] += waited
                self._rates[ADMISSION_WAIT][1] += 1
        return await super()._generate_one(prompt, tool_dict=tool_dict, tools=tools, group_id=group_id)

    async def _admit(self, group_id: int) -> float:
        """Start `group_id` (free: now; bounded: once `Ledger.room`); the seconds it waited."""
        start = time.monotonic()
        ledger = self._ledger
        while self.admission == "bounded" and group_id not in ledger.open:
            ledger.observe(self.model_version, self.rollout_buffer.qsize())
            if ledger.room(self.model_version):
                break
            await asyncio.sleep(POLL_S)  # the trainer's progress is in other processes: look again
        ledger.start(group_id, self.model_version)  # no await since room(): the next group sees this one
        return time.monotonic() - start

    async def _score_group(self, group):
        if self.admission == "bounded" and group.group_id in self._ledger.open:
            group.model_version = self._ledger.open[group.group_id]  # when it was let start (module docstring)
        samples = await super()._score_group(group)
        self._ledger.scored(group.group_id, group.model_version, len(samples))
        self._ledger.observe(self.model_version, self.rollout_buffer.qsize() + len(samples))  # not pushed yet
        tokens = {id(c): float(len(ids)) for c, ids in zip(group.completions, group.completions_ids)}
        for sample in samples:
            sample.metrics[TRAINED_TOKENS] = tokens.get(id(sample.completion), math.nan)
        scored = [r for r in self.scored_rewards.pop(group.group_id, []) if not math.isnan(r)]
        self._rates[GENERATED_REWARD][0] += sum(scored)
        self._rates[GENERATED_REWARD][1] += len(scored)
        self._rates[GENERATED_TOKENS][0] += sum(tokens.values())
        self._rates[GENERATED_TOKENS][1] += len(tokens)
        return samples
