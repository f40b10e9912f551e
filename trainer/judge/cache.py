"""Identical judge requests answered once: an in-process LRU of parsed verdicts, keyed by the request's exact JSON
(model, method, rendered prompt, constraint). A GRPO group often holds identical episodes (a policy that has
converged, a task with one obvious answer); a resume replays steps. Failures are never cached: the next identical
request asks again."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any


def key_of(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class LruCache:
    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> Any | None:
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key: str, value: Any) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
