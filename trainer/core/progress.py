"""Progress lines for the long waits a user sits through (model download, eval): done/total, rate and ETA, one
line at most every `every_s` seconds and always the last one. Lines, not a bar: they read the same in
`docker compose` logs, a terminal and CI."""

from __future__ import annotations

import time
from typing import Callable


def human(n: float, unit: str) -> str:
    if unit != "B":
        return f"{n:.0f} {unit}"
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.1f} {name}"
    return f"{n:.0f} B"


def duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60} min {seconds % 60:02d} s" if seconds >= 60 else f"{seconds} s"


class Progress:
    def __init__(self, label: str, total: float | None, unit: str, log: Callable[[str], None] = print,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.label, self.total, self.unit, self.log, self.every_s, self.clock = label, total, unit, log, every_s, clock
        self.start = clock()
        self.said_at: float | None = None

    def line(self, done: float) -> str:
        spent = max(self.clock() - self.start, 1e-9)
        rate = done / spent
        rate_text = f"{human(rate, self.unit)}/s" if self.unit == "B" else f"{rate:.2f} {self.unit}/s"
        if not self.total:  # the total is not known: no share, no ETA
            return f"{self.label}: {human(done, self.unit)}, {rate_text}"
        share = f"{human(done, self.unit)} of {human(self.total, self.unit)} ({min(done / self.total, 1):.0%})"
        if self.unit != "B":
            share = f"{done:.0f}/{self.total:.0f} {self.unit} ({min(done / self.total, 1):.0%})"
        eta = f", ETA {duration((self.total - done) / rate)}" if rate > 0 and done < self.total else ""
        return f"{self.label}: {share}, {rate_text}{eta}"

    def update(self, done: float, final: bool = False) -> None:
        """Print a line when the last one is `every_s` old, or this is the first or the last."""
        now = self.clock()
        last = final or (self.total is not None and done >= self.total)
        if last or self.said_at is None or now - self.said_at >= self.every_s:
            self.said_at = now
            self.log(self.line(done))
