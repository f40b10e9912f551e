"""Milestones of a run, printed once each as one machine-readable line, so `make gpu-smoke` (and a
person reading `docker logs`) can tell how far a first run got and how long each stage took.

    [stage] {"stage": "first_weight_sync", "seconds": 1.84, "detail": "..."}
"""

from __future__ import annotations

import json
import os
import threading

PREFIX = "[stage] "
_seen: set[str] = set()
_lock = threading.Lock()


def mark(stage: str, seconds: float | None = None, detail: str = "", **values) -> bool:
    """Print the stage's line the first time it is reached (on the main trainer process: RANK 0, as accelerate sets it,
    the variable trainer.core.dist reads too); False (and silent) afterwards."""
    if int(os.environ.get("RANK", "0") or 0) != 0:
        return False
    with _lock:
        if stage in _seen:
            return False
        _seen.add(stage)
    record = {"stage": stage, "seconds": None if seconds is None else round(float(seconds), 2), "detail": detail,
              **values}
    print(PREFIX + json.dumps(record), flush=True)
    return True


def parse(text: str) -> dict[str, dict]:
    """The stage records in a log, by stage name (first record of each wins)."""
    found: dict[str, dict] = {}
    for line in text.splitlines():
        at = line.find(PREFIX)
        if at < 0:
            continue
        try:
            record = json.loads(line[at + len(PREFIX):])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and "stage" in record:
            found.setdefault(record["stage"], record)
    return found
