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
from typing import Iterable, NamedTuple, Optional

__all__ = ["SyncEntry", "SyncLog", "Race", "check_happens_before"]


class SyncEntry(NamedTuple):
    kind: str
    stream: int
    task: int = -1
    slots: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()


class SyncLog:
    """An append-only list of :class:`SyncEntry`; safe to append from several threads."""

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


def check_happens_before(log: SyncLog, task_names: Optional[dict[int, str]] = None) -> list[Race]:
    """Replay ``log`` and return every ordering or lifetime violation (empty when clean).

    Values that exist before the call (inputs, parameters) count as written on the
    caller's stream (0) before the fork.
    """
    names = task_names or {}

    def name(t: int) -> str:
        return names.get(t, f"task {t}")

    streams = sorted({e.stream for e in log.entries} | {0})
    size = max(streams) + 1
    clock = [[0] * size for _ in range(size)]
    # A side stream that was never forked knows nothing of the caller's stream.
    for s in streams:
        if s != 0:
            clock[s][0] = -1
    event_clock: dict[int, list[int]] = {}
    writer: dict[int, tuple[int, int, int]] = {}  # slot -> (stream, seq, task)
    readers: dict[int, dict[int, int]] = {}  # slot -> {stream: seq of last read}
    recorded: dict[int, set[int]] = {}
    races: list[Race] = []
    outputs: set[int] = set()

    for e in log.entries:
        s = e.stream
        if e.kind == "fork":
            clock[s] = [max(a, b) for a, b in zip(clock[s], clock[0])]
        elif e.kind == "launch":
            clock[s][s] += 1
            for slot in (*e.slots, *e.writes):
                expected = log.expected_writers.get((e.task, slot))
                if expected is None:
                    continue
                seen = writer.get(slot, (0, 0, -1))[2]
                if seen != expected:
                    races.append(
                        Race(
                            "out-of-order",
                            slot,
                            s,
                            e.task,
                            f"{name(e.task)} on stream {s} accesses location {slot} after the write of "
                            f"{name(seen)}, where eager order has it see the write of {name(expected)}",
                        )
                    )
            for slot in e.slots:
                w = writer.get(slot)
                if w is None:
                    if slot in log.input_slots or not log.input_slots:
                        w = (0, 0, -1)
                    else:
                        races.append(
                            Race(
                                "read-before-write",
                                slot,
                                s,
                                e.task,
                                f"{name(e.task)} on stream {s} reads slot {slot} that no task wrote",
                            )
                        )
                        continue
                ws, wseq, wtask = w
                if ws != s and clock[s][ws] < wseq:
                    races.append(
                        Race(
                            "unordered-read",
                            slot,
                            s,
                            e.task,
                            f"{name(e.task)} on stream {s} reads slot {slot} written by "
                            f"{name(wtask)} on stream {ws} without waiting for it",
                        )
                    )
                readers.setdefault(slot, {})[s] = clock[s][s]
            for slot in e.writes:
                prev = writer.get(slot)
                if prev is None and slot in log.input_slots:
                    prev = (0, 0, -1)
                if prev is not None and prev[0] != s and clock[s][prev[0]] < prev[1]:
                    races.append(
                        Race(
                            "unordered-write",
                            slot,
                            s,
                            e.task,
                            f"{name(e.task)} on stream {s} writes slot {slot} also written by "
                            f"{name(prev[2])} on stream {prev[0]} without waiting for it",
                        )
                    )
                for r, seq in readers.get(slot, {}).items():
                    if r != s and clock[s][r] < seq:
                        races.append(
                            Race(
                                "write-after-read",
                                slot,
                                s,
                                e.task,
                                f"{name(e.task)} on stream {s} writes slot {slot} while a read of it on "
                                f"stream {r} may not have finished",
                            )
                        )
                writer[slot] = (s, clock[s][s], e.task)
        elif e.kind == "record":
            event_clock[e.task] = list(clock[s])
        elif e.kind == "wait":
            vc = event_clock.get(e.task)
            if vc is None:
                races.append(
                    Race(
                        "wait-unrecorded",
                        -1,
                        s,
                        e.task,
                        f"stream {s} waits on the event of {name(e.task)} before it is recorded",
                    )
                )
                continue
            clock[s] = [max(a, b) for a, b in zip(clock[s], vc)]
        elif e.kind == "record_stream":
            recorded.setdefault(e.slots[0], set()).add(s)
        elif e.kind == "free":
            slot = e.slots[0]
            w = writer.get(slot)
            alloc = w[0] if w is not None else 0
            for r, seq in readers.get(slot, {}).items():
                if r == alloc or r in recorded.get(slot, set()):
                    continue
                if clock[alloc][r] < seq:
                    races.append(
                        Race(
                            "unsafe-free",
                            slot,
                            r,
                            w[2] if w else -1,
                            f"slot {slot} (allocated on stream {alloc}) is released while stream "
                            f"{r} may still read it, and it was not record_stream'ed on stream {r}",
                        )
                    )
        elif e.kind == "join":
            clock[0] = [max(a, b) for a, b in zip(clock[0], clock[s])]
        elif e.kind == "output":
            outputs.update(e.slots)

    for s in streams:
        if s != 0 and clock[0][s] < clock[s][s]:
            races.append(
                Race("missing-join", -1, s, -1, f"the caller's stream does not wait for stream {s} before returning")
            )
    for slot in outputs:
        w = writer.get(slot)
        if w is not None and w[0] != 0 and 0 not in recorded.get(slot, set()):
            races.append(
                Race(
                    "output-not-recorded",
                    slot,
                    w[0],
                    w[2],
                    f"output slot {slot} was allocated on stream {w[0]} and handed to the caller "
                    "without record_stream on the caller's stream",
                )
            )
    return races
