"""The SyncLog side of one eager-dispatch call.

The log talks about values by small integer ids (*slots*); :class:`_CallLog` hands them
out and writes the entries of a call's launches and consumers, so that
:func:`~streamsched.runtime.synclog.check_happens_before` can replay the call.
Slots are handed out whether or not the call logs: a stream launch pairs its input
tensors with theirs.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

from ..synclog import SyncLog
from .launch import _Launch
from .values import _tensors


class _CallLog:
    """Slots of one call's values and, with ``sync`` (the call's SyncLog, or None), its entries.

    Used from the calling thread and from lane threads (a branch logs where it runs).
    """

    def __init__(self, sync: Optional[SyncLog]):
        self.sync = sync
        self.lock = threading.Lock()
        # Small integer ids for the values the log talks about; the objects are held so
        # that no id() is reused during the call.
        self.slots: dict[int, tuple[int, Any]] = {}

    def slot(self, value: Any) -> tuple[int, bool]:
        """``value``'s slot, and whether it is new."""
        with self.lock:
            entry = self.slots.get(id(value))
            if entry is not None:
                return entry[0], False
            entry = self.slots[id(value)] = (len(self.slots), value)
            return entry[0], True

    def caller_values(self, tensors: list[torch.Tensor]) -> list[int]:
        """Slots of a launch's tensor arguments; a tensor the forward made is logged as
        written on the caller's stream (0) before the launch forks from it."""
        slots = []
        for t in tensors:
            slot, new = self.slot(t)
            if new and self.sync is not None:
                self.sync.launch(0, -1, (), (slot,))
            slots.append(slot)
        return slots

    def launched(self, launch: _Launch, result: Any) -> None:
        """Log a branch that ran: it read its inputs and its producers' results, and wrote
        its result's tensors (or the result itself when it holds none)."""
        outputs = _tensors(result)
        writes = [self.slot(t)[0] for t in outputs] if outputs else [self.slot(result)[0]]
        launch.write_slots = tuple(writes)
        reads = list(launch.input_slots)
        for p in launch.producers:
            reads.extend(p.write_slots)
        self.sync.launch(launch.stream, launch.id, tuple(reads), launch.write_slots)

    def consumed(self, consumer: int, launch: _Launch) -> None:
        """Log stream ``consumer``'s first use of ``launch``'s result."""
        self.sync.wait(consumer, launch.id)
        # On a CPU lane the consumer's reference keeps the memory alive; the entry
        # stands for that, as record_stream does on CUDA.
        for slot in launch.write_slots:
            self.sync.record_stream(consumer, slot)
        self.sync.launch(consumer, -1, launch.write_slots, ())

    def output(self, output: Any) -> None:
        """Log the call's output: the slots of its tensors that the log knows."""
        if self.sync is None:
            return
        slots = []
        for t in _tensors(output):
            entry = self.slots.get(id(t))
            if entry is not None and entry[1] is t:
                slots.append(entry[0])
        self.sync.output(slots)

    def close(self) -> None:
        self.slots.clear()
