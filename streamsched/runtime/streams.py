"""CUDA streams: the plan's tasks issued from one thread onto a pool of streams.

Per call::

    caller = current stream                         # stream 0 of the plan
    side streams wait on an event recorded on caller   (fork)
    for task in issue order:
        make its stream current
        wait on the events of producers on other streams (only those the plan lists)
        run the task's nodes
        record_stream(s) on every tensor it read that another stream allocated
        record its event if some other stream (or the join) waits for it
    caller waits on every side stream                  (join, also on error)
    record_stream(caller) on outputs allocated on a side stream

Only the plan's waits are issued: the vector-clock pass already dropped every wait that
an earlier one implies. Streams are created once per module and reused; events once per
plan (``cudaEventDisableTiming``). The caller's current stream is restored afterwards,
so the module composes with the caller's own streams, also inside ``torch.cuda.stream``.

The stream operations go through a *backend* (:mod:`.backends`, shared with eager
dispatch). :class:`CudaBackend` drives real CUDA; :class:`SimulatedBackend` runs the work
immediately on CPU while the executor still makes every decision and logs it, which is
how the same logic is tested without a GPU. Both are importable from here.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from .backends import CudaBackend, NativeStreamOps, SimulatedBackend
from .chaos import Chaos
from .executor import PerProgram
from .program import Program, run_task
from .synclog import NULL_LOG, NullSyncLog, SyncLog

__all__ = ["StreamExecutor", "CudaBackend", "SimulatedBackend"]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    # Lists, tuples and dicts, their subclasses included, as the native runtime walks them
    # (csrc/runtime.cpp): pytree would take a dict subclass for a leaf, and a tensor in it
    # would miss its record_stream.
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _has_stream_ops(native: Any) -> bool:
    """Whether ``streamsched._C`` can drive streams through a Python backend (a build
    from before csrc/python_backend.cpp cannot)."""
    return bool(getattr(native, "stream_ops", False))


class StreamExecutor:
    """Issues a plan onto streams; see the module docstring for the exact protocol.

    With the native runtime (``streamsched._C``) the bookkeeping of each task is two C++
    calls (enter, leave) instead of a dozen Python ones; the decisions and the SyncLog
    are the same. On CUDA the native runtime issues its stream operations through its
    C++ CUDA backend (a CUDA build) or, in a CPU-only build, through
    :class:`~.backends.NativeStreamOps` (torch.cuda: the emulated device runs the native
    runtime so).
    """

    name = "streams"

    def __init__(self, backend: Any, native: Any = None):
        self.backend = backend
        self.native = native
        if native is not None and backend.is_cuda and not native.cuda_compiled() and not _has_stream_ops(native):
            self.native = None  # an older CPU-only build cannot drive CUDA streams
        # Made once per program and reused on every call: the native task table, the
        # backend's events.
        self._runtimes: PerProgram[Any] = PerProgram()
        self._events: PerProgram[dict[int, Any]] = PerProgram()

    def forget(self, program: Optional[Program] = None) -> None:
        """Drop the native runtime and events made for ``program`` (all when None): its
        tasks' waits, records or reads changed after it ran."""
        self._runtimes.forget(program)
        self._events.forget(program)

    def _runtime(self, program: Program) -> Any:
        return self._runtimes.get(program, self._make_runtime)

    def _make_runtime(self, program: Program) -> Any:
        nat = self.native
        tasks = [
            nat.TaskSync(
                t.id,
                t.stream,
                list(t.waits),
                t.records,
                list(t.reads),
                list(t.writes),
                list(t.cross_reads),
                list(t.frees),
            )
            for t in program.tasks
        ]
        device = 0
        if self.backend.is_cuda and self.backend.device.index is not None:
            device = self.backend.device.index
        args = (tasks, max(1, program.num_streams), list(program.side_outputs), list(program.output_slots))
        if self.backend.is_cuda and not nat.cuda_compiled():
            # Python issues what the runtime decides: one event per recording task, as the
            # runtime numbers them (csrc/runtime.cpp).
            events = sum(1 for t in program.tasks if t.records)
            ops = NativeStreamOps(self.backend, max(1, program.num_streams), events)
            return nat.StreamRuntime(*args, False, device, ops=ops)
        return nat.StreamRuntime(*args, bool(self.backend.is_cuda), device)

    def _run_native(
        self, program: Program, inputs: list[Any], log: SyncLog | NullSyncLog, chaos: Optional[Chaos], observer: Any
    ) -> Any:
        rt = self._runtime(program)
        env = program.new_env(inputs)
        ranges = observer
        be = self.backend
        rt.begin(log.keeps)
        completed = False
        try:
            for index, task in enumerate(program.tasks):
                rt.enter(index)
                if chaos is not None:
                    be.chaos(chaos, task.stream)
                run_task(task, env, ranges, task.stream)
                rt.leave(index, env)
            completed = True
        finally:
            if completed:
                rt.end(env, completed)
            else:
                try:
                    rt.end(env, completed)
                except Exception:  # noqa: BLE001 - the task's own error propagates (see run())
                    pass
            log.take_native(rt)
        return program.output(env)

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Optional[Chaos] = None,
        observer: Any = None,
    ) -> Any:
        """Run one call; ``observer.push(task, stream)``/``pop`` bracket each task on its
        stream (NVTX ranges, timelines)."""
        if log is None:
            log = NULL_LOG
        if self.native is not None:
            return self._run_native(program, inputs, log, chaos, observer)
        be = self.backend
        caller = be.current_stream()
        pool = be.streams(program.num_streams)
        streams = [caller] + pool[1:]
        events = self._events.get(program, be.events)
        side_ids = [s for s in program.streams_used() if s != 0]
        side = [streams[s] for s in side_ids]
        env = program.new_env(inputs)
        ranges = observer

        be.fork(caller, side)
        log.fork(side_ids)
        current = 0
        completed = False
        try:
            for task in program.tasks:
                sid = task.stream
                stream = streams[sid]
                if sid != current:
                    be.set_stream(stream)
                    current = sid
                for producer in task.waits:
                    be.wait(stream, events[producer])
                    log.wait(sid, producer)
                if chaos is not None:
                    be.chaos(chaos, sid)
                run_task(task, env, ranges, task.stream)
                log.launch(sid, task.id, task.reads, task.writes)
                for slot in task.cross_reads:
                    for tensor in _tensors(env[slot]):
                        be.record_stream(tensor, stream)
                    log.record_stream(sid, slot)
                if task.records:
                    be.record(stream, events[task.id])
                    log.record(sid, task.id)
                for slot in task.frees:
                    env[slot] = None
                    log.free(sid, slot)
            completed = True
        finally:
            if current != 0:
                be.set_stream(caller)
            if completed:
                be.join(caller, side)
            else:
                try:
                    be.join(caller, side)
                except Exception:  # noqa: BLE001
                    # The task's own error propagates: a join that fails too (the error
                    # invalidated a CUDA graph capture these streams belong to) must not
                    # replace it.
                    pass
            log.join(side_ids)
        for slot in program.side_outputs:
            for tensor in _tensors(env[slot]):
                be.record_stream(tensor, caller)
            log.record_stream(0, slot)
        log.output(program.output_slots)
        return program.output(env)

    def close(self) -> None:
        pass
