"""A bounded least-recently-used table (plans, traces, per-call-structure state)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["LRU"]


class LRU(OrderedDict):
    """An ``OrderedDict`` that keeps at most ``maxsize`` entries, dropping the least
    recently used; :meth:`get_fresh` and :meth:`put` count as uses. ``moves`` counts
    them: while it stands still, no entry changed places (a caller that keeps one entry
    fresh need not move it again: ``hot_plans``)."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize
        self.moves = 0

    def get_fresh(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
            self.moves += 1
        return value

    def put(self, key: Any, value: Any) -> None:
        self.moves += 1
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)
