"""Stream backends: the stream operations of the ``streams`` executor and of eager dispatch.

Both issue work onto a pool of side streams and take the same decisions (fork, wait,
record, ``record_stream``, join); they differ only in who asks. The
:class:`~.streams.StreamExecutor` runs a compiled program task by task; eager dispatch
(:mod:`streamsched.runtime.dispatch`) launches one ``@streamsched.branch`` call at a time.
Each goes through a :class:`StreamBackend`:

- :class:`CudaBackend` drives real CUDA streams and events on one device, from a pool of
  side streams made on first use and kept (the executor keeps one per model and device,
  eager dispatch one per device for the process).
- :class:`SimulatedBackend` stands for streams with their numbers: work runs at once, in
  issue order, on the CPU, while the caller still takes and logs every decision. That is
  how the CUDA logic is exercised, and its SyncLog checked, without a GPU.

Streams are numbered as in plans and SyncLogs: 0 is the caller's stream, ``1..k`` the
pool's side streams.
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Hashable, Iterator, Optional, Protocol

import torch

from .chaos import Chaos

if TYPE_CHECKING:
    from .program import Program

__all__ = ["StreamBackend", "CudaBackend", "SimulatedBackend", "NativeStreamOps"]


class StreamBackend(Protocol):
    """The stream operations the ``streams`` executor and eager dispatch issue."""

    is_cuda: bool
    device: torch.device  # the device whose streams these are (``cpu`` for the simulation)

    # --- the streams ---

    def stream(self, index: int) -> Any:
        """Side stream ``index`` (``>= 1``) of the pool, made on first use."""
        ...

    def streams(self, count: int) -> list[Any]:
        """``count`` entries: entry ``i >= 1`` is :meth:`stream` ``(i)``; entry 0 stands for
        the caller's stream, which the caller looks up with :meth:`current_stream`."""
        ...

    def current_stream(self) -> Any:
        """The calling thread's current stream."""
        ...

    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` the calling thread's current stream (the caller restores it)."""
        ...

    def use(self, stream: Any) -> ContextManager[Any]:
        """A context in which ``stream`` is current; the previous stream is current after it."""
        ...

    def key(self, stream: Any) -> Hashable:
        """A hashable identity of ``stream`` (who already waited for a result)."""
        ...

    def lane_of(self, stream: Any) -> int:
        """The log's number of ``stream``: its index in the pool, 0 for any other stream
        (the caller's, or one the user made current)."""
        ...

    # --- ordering ---

    def fork(self, caller: Any, side: list[Any]) -> None:
        """Make every stream of ``side`` wait for the work issued so far on ``caller``."""
        ...

    def event(self, task: int) -> Any:
        """A fresh event for the end of task ``task``."""
        ...

    def events(self, program: Program) -> dict[int, Any]:
        """A fresh event per task of ``program`` that records one (the executor keeps them
        per program)."""
        ...

    def record(self, stream: Any, event: Any) -> None:
        """Record ``event`` on ``stream``: it completes when the work issued so far does."""
        ...

    def wait(self, stream: Any, event: Any) -> None:
        """Make ``stream`` wait for ``event``."""
        ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the allocator that ``tensor``'s memory is in use on ``stream`` (CUDA
        tensors only), so that it is not handed out again before that use completes."""
        ...

    def join(self, caller: Any, side: list[Any]) -> None:
        """Make ``caller`` wait for all the work issued on every stream of ``side``."""
        ...

    def chaos(self, chaos: Chaos, lane: int) -> None:
        """Delay the next task on stream ``lane`` at random (``chaos`` testing)."""
        ...


class CudaBackend:
    """Real CUDA streams and events on one device.

    ``shared``: the backend is used by several threads at once (eager dispatch keeps one
    per device for the whole process). A fork then records an event of its own
    (``Stream.wait_stream``): the one fork event an unshared backend re-records on every
    call could be re-recorded by another thread between this fork's record and its waits.
    """

    is_cuda = True

    def __init__(self, device: torch.device, shared: bool = False):
        self.device = device
        self.shared = shared
        # Made on first use and reused: the pool grows only to the widest plan or call.
        self._pool: list[torch.cuda.Stream] = []
        self._lane_of: dict[int, int] = {}
        self._fork_event: Optional[torch.cuda.Event] = None

    def _grow(self, size: int) -> None:
        while len(self._pool) < size:
            s = torch.cuda.Stream(device=self.device)
            self._pool.append(s)
            self._lane_of[s.cuda_stream] = len(self._pool)

    def stream(self, index: int) -> torch.cuda.Stream:
        self._grow(index)
        return self._pool[index - 1]

    def streams(self, count: int) -> list[Any]:
        self._grow(count - 1)
        return [None] + self._pool[: count - 1]

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def set_stream(self, stream: torch.cuda.Stream) -> None:
        # torch.cuda.set_stream also makes the stream's device the current one: on a module
        # of another device than the current, keep the caller's current device.
        index = self.device.index
        if index is None or torch.cuda.current_device() == index:
            torch.cuda.set_stream(stream)
        else:
            with torch.cuda.device(index):
                torch.cuda.set_stream(stream)

    def use(self, stream: torch.cuda.Stream) -> ContextManager[Any]:
        return torch.cuda.stream(stream)

    def key(self, stream: torch.cuda.Stream) -> int:
        return stream.cuda_stream

    def lane_of(self, stream: torch.cuda.Stream) -> int:
        return self._lane_of.get(stream.cuda_stream, 0)

    def fork(self, caller: torch.cuda.Stream, side: list[torch.cuda.Stream]) -> None:
        if self.shared:
            for s in side:
                s.wait_stream(caller)
            return
        if self._fork_event is None:
            self._fork_event = torch.cuda.Event()
        self._fork_event.record(caller)
        for s in side:
            s.wait_event(self._fork_event)

    def event(self, task: int) -> torch.cuda.Event:
        return torch.cuda.Event()

    def events(self, program: Program) -> dict[int, Any]:
        return {t.id: self.event(t.id) for t in program.tasks if t.records}

    def record(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def join(self, caller: torch.cuda.Stream, side: list[torch.cuda.Stream]) -> None:
        for s in side:
            caller.wait_stream(s)

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.gpu_delay(lane)


class NativeStreamOps:
    """The stream operations of the native runtime (``Backend`` in ``csrc/runtime.h``)
    over a :class:`CudaBackend`: the native runtime decides, this issues.

    It does what ``csrc/cuda/cuda_backend.cpp`` does with ``c10::cuda``, through
    ``torch.cuda``: the caller's stream is the stream current at :meth:`fork`; events are
    made once per plan (one per recording task); the join waits for each side stream's
    work so far. A CPU-only build of ``streamsched._C`` drives CUDA streams through it,
    which is how every synchronisation action of the native runtime runs on the emulated
    device; a CUDA build uses its C++ backend instead.
    """

    def __init__(self, backend: CudaBackend, num_streams: int, num_events: int):
        self.backend = backend
        self._side = backend.streams(max(1, num_streams))[1:]
        self._events = [backend.event(e) for e in range(num_events)]
        self._caller: Any = None

    def _stream(self, index: int) -> Any:
        return self._caller if index == 0 else self._side[index - 1]

    def fork(self, side: list[int]) -> None:
        self._caller = self.backend.current_stream()
        self.backend.fork(self._caller, [self._stream(s) for s in side])

    def set_stream(self, index: int) -> None:
        self.backend.set_stream(self._stream(index))

    def wait(self, index: int, event: int) -> None:
        self.backend.wait(self._stream(index), self._events[event])

    def record(self, index: int, event: int) -> None:
        self.backend.record(self._stream(index), self._events[event])

    def record_stream(self, tensor: torch.Tensor, index: int) -> None:
        self.backend.record_stream(tensor, self._stream(index))

    def join(self, side: list[int]) -> None:
        self.backend.join(self._caller, [self._stream(s) for s in side])

    def restore(self) -> None:
        self.backend.set_stream(self._caller)


def _caller_stream() -> int:
    return 0


class SimulatedBackend:
    """Streams as their numbers, every operation a no-op: work runs at once, in issue
    order, on the CPU, while the caller still takes and logs every decision.

    ``default_stream`` gives the number of the calling thread's stream while it made none
    current: 0 (the caller's), or for eager dispatch the CPU lane the thread is.
    """

    is_cuda = False
    device = torch.device("cpu")

    def __init__(self, default_stream: Callable[[], int] = _caller_stream):
        self._default_stream = default_stream
        self._local = threading.local()

    def stream(self, index: int) -> int:
        return index

    def streams(self, count: int) -> list[Any]:
        return list(range(count))

    def current_stream(self) -> int:
        current = getattr(self._local, "stream", None)
        return self._default_stream() if current is None else current

    def set_stream(self, stream: int) -> None:
        self._local.stream = stream

    @contextlib.contextmanager
    def use(self, stream: int) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def key(self, stream: int) -> int:
        return stream

    def lane_of(self, stream: int) -> int:
        return stream

    def fork(self, caller: int, side: list[int]) -> None:
        pass

    def event(self, task: int) -> int:
        return task

    def events(self, program: Program) -> dict[int, Any]:
        return {t.id: t.id for t in program.tasks if t.records}

    def record(self, stream: int, event: Any) -> None:
        pass

    def wait(self, stream: int, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        pass

    def join(self, caller: int, side: list[int]) -> None:
        pass

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.delay(lane)
