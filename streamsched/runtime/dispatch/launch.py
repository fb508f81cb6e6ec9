"""One launched branch: where it ran, what it read and wrote, its outcome, and what an
observer sees of it.

A launch belongs to the call that made it (``launch.call``), which gives its result to
whoever uses it (:class:`_Consumer`): the lower modules (:mod:`.pending`) know a call
only by that one method.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from .values import _storage_key, _tensors


class _Consumer(Protocol):
    """What a launch needs of its call: the result for the current thread and stream,
    after the waits it needs (see ``_EagerCall.consume``)."""

    def consume(self, launch: _Launch) -> Any: ...


class _Launch:
    """Book-keeping of one branch call: where it ran, what it read and wrote, its outcome."""

    def __init__(self, call: Optional[_Consumer], task_id: int, name: str, kind: str):
        self.call = call
        self.id = task_id
        self.name = name
        self.kind = kind  # "lane", "stream" or "inline"
        self.stream = 0
        self.backend: Any = None  # a StreamBackend, for stream launches
        self.future: Optional[concurrent.futures.Future] = None
        self.value: Any = None  # the result, for stream launches
        self.event: Any = None
        self.expected_len: Optional[int] = None
        self.input_slots: list[int] = []
        self.input_keys: set = set()
        self.producers: list[_Launch] = []
        self.waits: list[int] = []
        self.write_slots: tuple[int, ...] = ()
        self.result_keys: Optional[set] = None
        self.consumers: set = set()  # stream keys (or lanes) that already waited for this branch
        self.cross_waits = 0
        self.cost_us = 0.0

    def result(self) -> Any:
        """The result for the current thread and stream, after the waits it needs."""
        return self.call.consume(self)

    def peek(self) -> tuple[bool, Any]:
        """The raw result, for questions that need no synchronisation (its length, its
        shape): ``(False, None)`` while a lane still runs it; a failed branch raises."""
        if self.kind == "lane":
            if not self.future.done():
                return False, None
            return True, self.future.result()
        return True, self.value

    def settled_for_caller(self) -> bool:
        """Whether the calling thread may write what this branch reads without waiting."""
        if self.kind == "lane":
            return self.future.done()
        if self.kind == "stream":
            return self.backend.key(self.backend.current_stream()) in self.consumers
        return True

    def reads_storage(self, keys: set) -> bool:
        if self.input_keys & keys:
            return True
        for producer in self.producers:
            if producer.kind == "lane" and (not producer.future.done() or producer.future.exception() is not None):
                continue  # the forward cannot hold a result that does not exist
            if producer.result_keys is None:
                value = producer.peek()[1]
                producer.result_keys = {k for t in _tensors(value) if (k := _storage_key(t)) is not None}
            if producer.result_keys & keys:
                return True
        return False


@dataclass(frozen=True)
class _TaskInfo:
    """What an observer's ``push(task, stream)``/``pop`` see of a branch."""

    id: int
    name: str
    stream: int
