"""A bounded least-recently-used map, safe to share between the event loop and engine threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LruCache(Generic[K, V]):
    """Keeps the `size` most recently used entries; `get` counts as a use.

    With `max_weight`, entries also weigh what `put` says (e.g. the memory a compiled grammar
    holds), and the least recently used go until the total is within it.
    """

    def __init__(self, size: int, *, max_weight: int | None = None) -> None:
        self.size = size
        self.max_weight = max_weight
        self.weight = 0
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def put(self, key: K, value: V, weight: int = 1) -> None:
        with self._lock:
            self.weight += weight - self._weights.get(key, 0)
            self._entries[key] = value
            self._weights[key] = weight
            self._entries.move_to_end(key)
            while len(self._entries) > self.size or (
                self.max_weight is not None and self.weight > self.max_weight and len(self._entries) > 1
            ):
                old, _ = self._entries.popitem(last=False)
                self.weight -= self._weights.pop(old)

    def __len__(self) -> int:
        return len(self._entries)
