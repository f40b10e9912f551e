"""What the judge cost this step (judge/calls, judge/seconds, judge/tokens, judge/cache_hits, judge/failures in the
step record and the step line: trainer.core.metrics), and the down watch: a judge failing every call for
JUDGE_DOWN_AFTER_S stops the run (JudgeDown: exit EXIT_JUDGE_DOWN, `make train` resumes once it is back).

One COSTS per process. Sync: the trainer's rank 0 logs its own process's figures. Async: the rollout worker (a spawned
process) pushes its figures to the trainer as TRL counters (`judge/<figure>_total`, summed over the logging window;
trainer.core.async_metrics.record names them as a sync run does)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable

FIGURES = ("calls", "seconds", "tokens", "cache_hits", "failures")
PREFIX = "judge/"
TOTAL_SUFFIX = "_total"  # TRL's async trainer sums a key whose last word is `total`


class JudgeDown(RuntimeError):
    """The judge failed every call for JUDGE_DOWN_AFTER_S: the run stops with this one line."""


class JudgeCosts:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._figures = dict.fromkeys(FIGURES, 0.0)
        self.seen = False  # any judge activity in this process (the step line shows judge figures only then)

    def add(self, calls: int = 0, seconds: float = 0.0, tokens: int = 0, cache_hits: int = 0,
            failures: int = 0) -> None:
        with self._lock:
            self.seen = True
            for name, value in zip(FIGURES, (calls, seconds, tokens, cache_hits, failures)):
                self._figures[name] += value

    def drain(self) -> dict[str, float]:
        """The figures since the last drain as `judge/<figure>` ({} before the first judge call of the process)."""
        with self._lock:
            if not self.seen:
                return {}
            out = {f"{PREFIX}{name}": value for name, value in self._figures.items()}
            self._figures = dict.fromkeys(FIGURES, 0.0)
        return out


    @contextmanager
    def set_apart(self):
        """Figures recorded inside go to the dict this yields (filled on exit), not to the step's (the evaluation
        during training plays between two steps, and its episodes are judged too)."""
        with self._lock:
            saved, seen = self._figures, self.seen
            self._figures = dict.fromkeys(FIGURES, 0.0)
        apart: dict[str, float] = {}
        try:
            yield apart
        finally:
            with self._lock:
                if any(self._figures.values()):
                    apart.update({f"{PREFIX}{name}": value for name, value in self._figures.items()})
                self._figures, self.seen = saved, seen or self.seen


COSTS = JudgeCosts()


def as_counters(figures: dict[str, float]) -> dict[str, float]:
    """Async: `judge/calls` -> `judge/calls_total` (TRL sums it over the window)."""
    return {f"{key}{TOTAL_SUFFIX}": value for key, value in figures.items()}


def from_counters(key: str) -> str | None:
    """The step record's name of an async counter (`judge/calls_total` -> `judge/calls`), else None."""
    if key.startswith(PREFIX) and key.endswith(TOTAL_SUFFIX):
        return key[: -len(TOTAL_SUFFIX)]
    return None


class DownWatch:
    """Whether the judge has failed every call for `down_after_s`: the first failure after the last success starts
    the clock, any success stops it. Thread-safe; `clock` for the tests (no sleeps)."""

    def __init__(self, down_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.down_after_s, self.clock = down_after_s, clock
        self._failing_since: float | None = None
        self._failures = 0
        self._last = ""
        self._lock = threading.Lock()

    def record(self, failure: str | None) -> None:
        with self._lock:
            if failure is None:
                self._failing_since, self._failures = None, 0
                return
            if self._failing_since is None:
                self._failing_since = self.clock()
            self._failures += 1
            self._last = failure

    def check(self) -> None:
        with self._lock:
            since, failures, last = self._failing_since, self._failures, self._last
        if since is None:
            return
        down_for = self.clock() - since
        if down_for >= self.down_after_s:
            raise JudgeDown(f"the judge failed all of its last {failures} calls over {down_for:.0f} s "
                            f"(JUDGE_DOWN_AFTER_S={self.down_after_s:g}); last: {last}. Check the judge (`make logs` "
                            "for the judge service, or JUDGE_URL), then `make train` resumes from the last checkpoint")
