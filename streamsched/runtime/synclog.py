"""A record of every synchronisation action one call performed, and a checker for it.

Each executor can log what it did, per stream: ``fork`` (side streams wait for the
caller's stream), ``launch`` (a task ran, reading and writing slots), ``record`` (a task's
event was recorded), ``wait`` (a stream waited on a task's event), ``record_stream`` (a
tensor was marked as used by a stream), ``free`` (the executor dropped its reference to
a slot), ``join`` (the caller's stream waited for every side stream) and ``output``
(slots handed to the caller).

:func:`check_happens_before` replays a log with vector clocks and reports every read
not ordered after its write, every write not ordered after the earlier reads and writes
of its location, every wait on an event never recorded, every free that could let
another stream's pending read see reused memory, and a missing join. It runs on CPU:
the same plan logic that drives CUDA streams is checked in CI.

Slots are of two kinds. A *value* slot holds one graph value, written once by the task
that produces it. A *location* slot (a program's ``location_slots``) stands for a storage
some task writes in place (a buffer updated by BatchNorm, a tensor ``mul_``-ed or
assigned into, through any view): several tasks read and write it, and each access must
be ordered after the conflicting ones before it in eager order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Optional

__all__ = ["SyncEntry", "SyncLog", "NullSyncLog", "NULL_LOG", "Race", "check_happens_before"]


class SyncEntry(NamedTuple):
    kind: str
    stream: int
    task: int = -1
    slots: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()


class SyncLog:
    """An append-only list of :class:`SyncEntry`; safe to append from several threads."""

    # Whether the entries are kept (the native runtime logs only when asked).
    keeps = True

    def __init__(self) -> None:
        self.entries: list[SyncEntry] = []
        self._lock = threading.Lock()
        self.input_slots: tuple[int, ...] = ()
        # (task, location slot) -> the task whose write it must see (-1: before the call).
        self.expected_writers: dict[tuple[int, int], int] = {}

    def _add(self, entry: SyncEntry) -> None:
        with self._lock:
            self.entries.append(entry)

    def fork(self, streams: Iterable[int]) -> None:
        for s in streams:
            self._add(SyncEntry("fork", s))

    def launch(self, stream: int, task: int, reads: tuple[int, ...], writes: tuple[int, ...]) -> None:
        self._add(SyncEntry("launch", stream, task, tuple(reads), tuple(writes)))

    def record(self, stream: int, task: int) -> None:
        self._add(SyncEntry("record", stream, task))

    def wait(self, stream: int, task: int) -> None:
        self._add(SyncEntry("wait", stream, task))

    def record_stream(self, stream: int, slot: int) -> None:
        self._add(SyncEntry("record_stream", stream, -1, (slot,)))

    def free(self, stream: int, slot: int) -> None:
        self._add(SyncEntry("free", stream, -1, (slot,)))

    def join(self, streams: Iterable[int]) -> None:
        for s in streams:
            self._add(SyncEntry("join", s))

    def output(self, slots: Iterable[int]) -> None:
        self._add(SyncEntry("output", 0, -1, tuple(slots)))

    def take_native(self, runtime: Any) -> None:
        """Append what the native stream runtime logged in the call."""
        with self._lock:
            self.entries.extend(SyncEntry(*entry) for entry in runtime.take_log())

    def without(self, predicate) -> SyncLog:
        """A copy without the entries for which ``predicate(entry)`` is true (for tests)."""
        out = SyncLog()
        out.input_slots = self.input_slots
        out.expected_writers = self.expected_writers
        out.entries = [e for e in self.entries if not predicate(e)]
        return out

    def actions(self) -> list[tuple]:
        """The entries as plain tuples, for comparing two runtimes' logs."""
        return [tuple(e) for e in self.entries]

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"SyncLog({len(self.entries)} entries)"


class NullSyncLog:
    """The log of a call that asked for none: :class:`SyncLog`'s methods, each doing
    nothing. An executor given no log writes to :data:`NULL_LOG`, so its loop logs every
    action unconditionally (the recording is an override point, as
    ``torch.fx.Interpreter`` keeps per-node hooks out of its loop) instead of testing
    for a log at each one."""

    __slots__ = ()
    keeps = False

    def fork(self, streams: Iterable[int]) -> None:
        pass

    def launch(self, stream: int, task: int, reads: tuple[int, ...], writes: tuple[int, ...]) -> None:
        pass

    def record(self, stream: int, task: int) -> None:
        pass

    def wait(self, stream: int, task: int) -> None:
        pass

    def record_stream(self, stream: int, slot: int) -> None:
        pass

    def free(self, stream: int, slot: int) -> None:
        pass

    def join(self, streams: Iterable[int]) -> None:
        pass

    def output(self, slots: Iterable[int]) -> None:
        pass

    def take_native(self, runtime: Any) -> None:
        pass

    def __repr__(self) -> str:
        return "NULL_LOG"


NULL_LOG = NullSyncLog()


@dataclass(frozen=True)
class Race:
    """One problem the checker found."""

    kind: str
    slot: int
    stream: int
    task: int
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


class _StreamClocks:
    """One vector clock per stream: ``knows(s, other, seq)`` is whether stream ``s`` is
    ordered after the first ``seq`` launches of stream ``other``."""

    def __init__(self, streams: list[int]) -> None:
        size = max(streams) + 1
        self._clock = [[0] * size for _ in range(size)]
        # A side stream that was never forked knows nothing of the caller's stream.
        for s in streams:
            if s != 0:
                self._clock[s][0] = -1

    def tick(self, stream: int) -> int:
        """Count one launch on ``stream``; returns its sequence number."""
        self._clock[stream][stream] += 1
        return self._clock[stream][stream]

    def now(self, stream: int) -> int:
        return self._clock[stream][stream]

    def knows(self, stream: int, other: int, seq: int) -> bool:
        return self._clock[stream][other] >= seq

    def snapshot(self, stream: int) -> list[int]:
        return list(self._clock[stream])

    def merge(self, stream: int, other: list[int]) -> None:
        """``stream`` now waits for everything ``other`` had seen."""
        self._clock[stream] = [max(a, b) for a, b in zip(self._clock[stream], other)]

    def join(self, stream: int, other: int) -> None:
        """``stream`` now waits for everything stream ``other`` has seen."""
        self.merge(stream, self._clock[other])


_BEFORE_THE_CALL = (0, 0, -1)  # a value that exists before the call: written on stream 0


class _HappensBeforeChecker:
    """Replays a :class:`SyncLog`, one ``_handle_<kind>`` method per entry kind (the shape
    of ``torch.cuda._sanitizer.EventHandler``), over vector clocks and per-slot accesses."""

    def __init__(self, log: SyncLog, task_names: Optional[dict[int, str]]) -> None:
        self.log = log
        self.names = task_names or {}
        self.streams = sorted({e.stream for e in log.entries} | {0})
        self.clocks = _StreamClocks(self.streams)
        self.event_clock: dict[int, list[int]] = {}
        self.writer: dict[int, tuple[int, int, int]] = {}  # slot -> (stream, seq, task)
        self.readers: dict[int, dict[int, int]] = {}  # slot -> {stream: seq of last read}
        self.recorded: dict[int, set[int]] = {}  # slot -> streams it was record_stream'ed on
        self.outputs: set[int] = set()
        self.races: list[Race] = []

    def name(self, task: int) -> str:
        return self.names.get(task, f"task {task}")

    def run(self) -> list[Race]:
        handlers = self._HANDLERS
        for entry in self.log.entries:
            handler = handlers.get(entry.kind)
            if handler is not None:
                handler(self, entry)
        self._check_joined()
        self._check_outputs_recorded()
        return self.races

    def _race(self, kind: str, slot: int, stream: int, task: int, detail: str) -> None:
        self.races.append(Race(kind, slot, stream, task, detail))

    # --- one handler per entry kind ---

    def _handle_fork(self, e: SyncEntry) -> None:
        self.clocks.join(e.stream, 0)

    def _handle_launch(self, e: SyncEntry) -> None:
        self.clocks.tick(e.stream)
        for slot in (*e.slots, *e.writes):
            self._check_eager_order(e, slot)
        for slot in e.slots:
            self._check_read(e, slot)
        for slot in e.writes:
            self._check_write(e, slot)

    def _handle_record(self, e: SyncEntry) -> None:
        self.event_clock[e.task] = self.clocks.snapshot(e.stream)

    def _handle_wait(self, e: SyncEntry) -> None:
        s = e.stream
        vc = self.event_clock.get(e.task)
        if vc is None:
            detail = f"stream {s} waits on the event of {self.name(e.task)} before it is recorded"
            self._race("wait-unrecorded", -1, s, e.task, detail)
            return
        self.clocks.merge(s, vc)

    def _handle_record_stream(self, e: SyncEntry) -> None:
        self.recorded.setdefault(e.slots[0], set()).add(e.stream)

    def _handle_free(self, e: SyncEntry) -> None:
        slot = e.slots[0]
        w = self.writer.get(slot)
        alloc = w[0] if w is not None else 0
        for r, seq in self.readers.get(slot, {}).items():
            if r == alloc or r in self.recorded.get(slot, set()):
                continue
            if not self.clocks.knows(alloc, r, seq):
                detail = (
                    f"slot {slot} (allocated on stream {alloc}) is released while stream "
                    f"{r} may still read it, and it was not record_stream'ed on stream {r}"
                )
                self._race("unsafe-free", slot, r, w[2] if w else -1, detail)

    def _handle_join(self, e: SyncEntry) -> None:
        self.clocks.join(0, e.stream)

    def _handle_output(self, e: SyncEntry) -> None:
        self.outputs.update(e.slots)

    _HANDLERS = {
        "fork": _handle_fork,
        "launch": _handle_launch,
        "record": _handle_record,
        "wait": _handle_wait,
        "record_stream": _handle_record_stream,
        "free": _handle_free,
        "join": _handle_join,
        "output": _handle_output,
    }

    # --- the checks of one launch ---

    def _check_eager_order(self, e: SyncEntry, slot: int) -> None:
        """A location access must see the write eager order has it see."""
        expected = self.log.expected_writers.get((e.task, slot))
        if expected is None:
            return
        seen = self.writer.get(slot, _BEFORE_THE_CALL)[2]
        if seen != expected:
            detail = (
                f"{self.name(e.task)} on stream {e.stream} accesses location {slot} after the write of "
                f"{self.name(seen)}, where eager order has it see the write of {self.name(expected)}"
            )
            self._race("out-of-order", slot, e.stream, e.task, detail)

    def _check_read(self, e: SyncEntry, slot: int) -> None:
        """A read must be ordered after the slot's write; it is then a pending read."""
        s = e.stream
        w = self.writer.get(slot)
        if w is None:
            if slot in self.log.input_slots or not self.log.input_slots:
                w = _BEFORE_THE_CALL
            else:
                detail = f"{self.name(e.task)} on stream {s} reads slot {slot} that no task wrote"
                self._race("read-before-write", slot, s, e.task, detail)
                return
        ws, wseq, wtask = w
        if ws != s and not self.clocks.knows(s, ws, wseq):
            detail = (
                f"{self.name(e.task)} on stream {s} reads slot {slot} written by "
                f"{self.name(wtask)} on stream {ws} without waiting for it"
            )
            self._race("unordered-read", slot, s, e.task, detail)
        self.readers.setdefault(slot, {})[s] = self.clocks.now(s)

    def _check_write(self, e: SyncEntry, slot: int) -> None:
        """A write must be ordered after the slot's earlier write and reads."""
        s = e.stream
        prev = self.writer.get(slot)
        if prev is None and slot in self.log.input_slots:
            prev = _BEFORE_THE_CALL
        if prev is not None and prev[0] != s and not self.clocks.knows(s, prev[0], prev[1]):
            detail = (
                f"{self.name(e.task)} on stream {s} writes slot {slot} also written by "
                f"{self.name(prev[2])} on stream {prev[0]} without waiting for it"
            )
            self._race("unordered-write", slot, s, e.task, detail)
        for r, seq in self.readers.get(slot, {}).items():
            if r != s and not self.clocks.knows(s, r, seq):
                detail = (
                    f"{self.name(e.task)} on stream {s} writes slot {slot} while a read of it on "
                    f"stream {r} may not have finished"
                )
                self._race("write-after-read", slot, s, e.task, detail)
        self.writer[slot] = (s, self.clocks.now(s), e.task)

    # --- the checks at the end of the call ---

    def _check_joined(self) -> None:
        """The caller's stream must wait for every side stream before returning."""
        for s in self.streams:
            if s != 0 and not self.clocks.knows(0, s, self.clocks.now(s)):
                detail = f"the caller's stream does not wait for stream {s} before returning"
                self._race("missing-join", -1, s, -1, detail)

    def _check_outputs_recorded(self) -> None:
        """An output allocated on a side stream must be record_stream'ed on the caller's."""
        for slot in self.outputs:
            w = self.writer.get(slot)
            if w is not None and w[0] != 0 and 0 not in self.recorded.get(slot, set()):
                detail = (
                    f"output slot {slot} was allocated on stream {w[0]} and handed to the caller "
                    "without record_stream on the caller's stream"
                )
                self._race("output-not-recorded", slot, w[0], w[2], detail)


def check_happens_before(log: SyncLog, task_names: Optional[dict[int, str]] = None) -> list[Race]:
    """Replay ``log`` and return every ordering or lifetime violation (empty when clean).

    Values that exist before the call (inputs, parameters) count as written on the
    caller's stream (0) before the fork.
    """
    return _HappensBeforeChecker(log, task_names).run()
