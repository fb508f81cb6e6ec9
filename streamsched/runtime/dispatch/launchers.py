"""Launching a branch beside the forward: onto a CPU lane, or onto a (CUDA or simulated)
stream; receiving its result where it is used; joining every launch at the end."""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any, Callable, Hashable, Optional

from ..backends import StreamBackend
from ..chaos import Chaos
from ..threads import _TorchState
from .body import _annotated_length, _BranchRunner
from .calllog import _CallLog
from .lane_pool import _LANES
from .launch import _Launch
from .pending import PendingValue
from .stream_backends import _record_stream
from .values import _tensors


def _handoff_event(task_id: int) -> int:
    """The SyncLog event of handing task ``task_id`` to its lane (task events are >= 0)."""
    return -2 - task_id


class _LaneLauncher:
    """Launches one call's branches onto the CPU lanes ``1..lanes`` of the eager lane pool.

    The branch runs in a worker thread with the caller's grad mode, inference mode and
    autocast; its result (or exception) goes into ``launch.future``, which the first use
    of its pending value waits for. A failure surfaces where the result is used, or at
    the join.
    """

    def __init__(self, runner: _BranchRunner, log: _CallLog, chaos: Optional[Chaos], lanes: int):
        self.runner = runner
        self.log = log
        self.chaos = chaos
        self.lanes = lanes
        self.launches: list[_Launch] = []
        self.used: set[int] = set()  # lanes this call launched on
        self.forked: set[int] = set()  # lanes whose fork this call has logged

    def launch(self, launch: _Launch, fn: Callable[..., Any], args: tuple, kwargs: dict) -> PendingValue:
        launch.kind = "lane"
        launch.future = concurrent.futures.Future()
        launch.expected_len = _annotated_length(fn)
        lane = _LANES.reserve(self.lanes)
        launch.stream = lane
        state = _TorchState()
        sync = self.log.sync
        handoff = None
        if sync is not None:
            # A lane's entries must appear in the lane's own order, but this thread logs
            # ahead of the lane: the first job of the call forks the lane (nothing of the
            # call ran there yet); each later job's hand-off is an event recorded here and
            # waited on by the lane when the job starts.
            if lane not in self.forked:
                self.forked.add(lane)
                sync.fork([lane])
            else:
                handoff = _handoff_event(launch.id)
                sync.record(0, handoff)
        self.used.add(lane)
        self.launches.append(launch)

        def job() -> None:
            try:
                if handoff is not None:
                    sync.wait(lane, handoff)
                with contextlib.ExitStack() as stack:
                    state.enter(stack)
                    if self.chaos is not None:
                        self.chaos.delay(lane)
                    result = self.runner.run(launch, fn, args, kwargs)
                    if sync is not None:
                        sync.record(lane, launch.id)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever uses the value
                launch.future.set_exception(exc)
            else:
                launch.future.set_result(result)

        _LANES.submit(lane, job)
        return PendingValue(launch)

    @staticmethod
    def receive(launch: _Launch) -> tuple[Any, int, Hashable]:
        """``(result, consumer, key)`` of a lane launch for the current thread, once the
        branch finished (its own exception if it raised); the consumer is a lane."""
        value = launch.future.result()
        consumer = _LANES.current_lane()
        return value, consumer, consumer

    def join(self) -> Optional[BaseException]:
        """Wait for every launched branch; the earliest failure in launch order."""
        failure: Optional[BaseException] = None
        for launch in self.launches:
            exc = launch.future.exception()  # waits
            if exc is not None and failure is None:
                failure = exc
        return failure


class _StreamLauncher:
    """Issues one call's branches from the calling thread onto the side streams of a
    :class:`~streamsched.runtime.backends.StreamBackend`, in turn.

    The side stream first waits for the caller's stream (fork); the branch's inputs stay
    alive until the end-of-call join (the call log holds them); an event is recorded
    after the branch, also when it
    raised (it raised at once, as in eager), so that the join and any later wait have an
    event to wait on. The first use on a stream waits for that event and
    ``record_stream``-s the result there.
    """

    def __init__(self, runner: _BranchRunner, log: _CallLog, chaos: Optional[Chaos]):
        self.runner = runner
        self.log = log
        self.chaos = chaos
        self.last_lane = 0
        self.used: set[int] = set()  # streams this call launched on
        self.backends: dict[int, tuple[StreamBackend, set[int]]] = {}  # id(backend) -> (backend, streams used)

    def launch(
        self, launch: _Launch, backend: StreamBackend, lanes: int, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> PendingValue:
        launch.kind = "stream"
        launch.backend = backend
        self.last_lane = self.last_lane % lanes + 1
        lane = launch.stream = self.last_lane
        side = backend.stream(lane)
        self.used.add(lane)
        self.backends.setdefault(id(backend), (backend, set()))[1].add(lane)
        sync = self.log.sync
        backend.fork(backend.current_stream(), [side])
        if sync is not None:
            sync.fork([lane])
        with backend.use(side):
            if self.chaos is not None:
                backend.chaos(self.chaos, lane)
            # Inputs made on the caller's stream need no record_stream here: the call log
            # holds every branch input (_CallLog.slot) until after the end-of-call join,
            # which orders the caller's stream after this stream's reads; so an input's
            # memory goes back to the allocator only when that is safe (and any stream
            # the caller itself ordered it on is ordered after the join too).
            # tests/test_cuda_protocol.py drops an input mid-forward to hold this. The
            # SyncLog entry stands for that hold, as for a CPU lane's consumer.
            if sync is not None:
                for slot in launch.input_slots:
                    sync.record_stream(lane, slot)
            try:
                launch.value = self.runner.run(launch, fn, args, kwargs)
            finally:
                launch.event = backend.event(launch.id)
                backend.record(side, launch.event)
            if sync is not None:
                sync.record(lane, launch.id)
        return PendingValue(launch)

    @staticmethod
    def receive(launch: _Launch) -> tuple[Any, int, Hashable]:
        """``(result, consumer, key)`` of a stream launch for the current stream, which
        waits for the branch (once per stream) and keeps the result's memory alive; the
        consumer is the stream's number in the log."""
        backend = launch.backend
        stream = backend.current_stream()
        key = backend.key(stream)
        if key not in launch.consumers:
            backend.wait(stream, launch.event)
            for t in _tensors(launch.value):
                _record_stream(backend, t, stream)
        return launch.value, backend.lane_of(stream), key

    def join(self) -> None:
        """Make the caller's stream wait for every side stream the call used."""
        for backend, streams in self.backends.values():
            backend.join(backend.current_stream(), [backend.stream(lane) for lane in sorted(streams)])
