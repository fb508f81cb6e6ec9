"""A bounded least-recently-used table (plans, traces, per-call-structure state)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["LRU"]


class LRU(OrderedDict):
    """An ``OrderedDict`` that keeps at most ``maxsize`` entries, dropping the least
    recently used; :meth:`get_fresh` and :meth:`put` count as uses."""

    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def get_fresh(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)
