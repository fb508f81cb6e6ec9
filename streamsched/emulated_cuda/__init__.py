"""An emulated CUDA device, so that CUDA stream code runs, unchanged, on a machine without a GPU.

Inside ``with EmulatedCuda(devices=2):``, ``torch.cuda`` says CUDA is available with
``devices`` devices; tensors created on ``"cuda"``/``"cuda:1"`` (factories with a device,
``.to()``, ``.cuda()``) are CPU tensors that report that device (``.device``, ``.is_cuda``);
``torch.cuda.Stream``/``Event``/``CUDAGraph``, ``current_stream``, ``set_stream``,
``torch.cuda.stream``, ``device``, ``synchronize``, ``graph``, ``graph_pool_handle`` and
``record_stream`` work, and what CUDA would do wrong is reported:

- **Races.** Every kernel's reads and writes are taken from the operator schema and
  checked per storage, on the stream that launched it, by PyTorch's stream sanitizer
  (``torch.cuda._sanitizer.EventHandler``: vector clocks over events, stream waits and
  host synchronisations). An access not ordered after a conflicting one on another stream
  (a missing ``wait_event``/``wait_stream``, a missing join) raises
  :class:`UnsynchronizedAccess` at that kernel and is kept in :attr:`EmulatedCuda.reports`.
- **Memory reuse.** A block freed by the host returns to its allocation stream's pool,
  as in PyTorch's caching allocator: if a stream that used it, without
  ``record_stream``, is not ordered before the next work of the allocation stream (which
  could be handed that memory), a ``"reuse"`` report is recorded.
- **Capture.** ``torch.cuda.graph`` captures for real: kernels on the capturing stream and
  on streams that joined it by waiting on an event recorded in the capture are recorded,
  not kept (memory written outside the graph's pool gets its bytes back at the end of the
  capture; memory allocated in it is filled with NaN). CUDA's rules raise at the call that
  breaks them and invalidate the capture, so that ``capture_end`` then fails as
  ``cudaStreamEndCapture`` does: synchronising or reading on the host (``.item()``,
  ``.cpu()``, ``synchronize()``), pinning host memory while a ``"global"`` capture runs in
  any thread (``"thread_local"``: in the capturing thread), waiting on an event recorded
  outside the capture, a forked stream not joined back before the end. The graph memory
  pool is modelled: a capture that fails leaves it recording (the next capture into it
  fails) until ``torch._C._cuda_endAllocateToPool`` / ``_cuda_releasePool``.
- **Replay** runs the captured kernels again in a random order consistent only with the
  captured dependencies (stream order and event waits), on the replaying stream as one
  launch for the checker; memory from outside the graph is read by address, and a replay
  after that memory was freed is reported instead of read.
- **Backward** runs as autograd's engine runs it on CUDA (``_autograd``): each backward
  node on the stream its forward op ran on, the engine's waits where a gradient crosses
  streams, the caller's streams ordered after the leaf streams when ``backward()``
  returns. :attr:`EmulatedCuda.backward_kernels` counts backward kernels per stream.

**Asynchronous mode** (``EmulatedCuda(asynchronous=True)``, ``_async``): a kernel
issued on a stream is queued, not run: its outputs are allocated at once (their shapes
from the operator's meta kernel) and filled with garbage (NaN, the largest integer,
``True``), and the queued work runs at a synchronisation point, in a random order
(``seed``) consistent only with stream order and event waits. A consumer that misses its
wait can then run before its producer and compute from garbage: a wrong value, not only
a report (with ``raise_on_race=False`` the kernels run; otherwise the race raises at
issue as before). A synchronisation runs only what it waits for: a stream's
``synchronize`` and a host read on it (``.item()``, ``.cpu()``, blocking copies,
data-dependent shapes) the work that stream is ordered after, an event's the work before
it, ``torch.cuda.synchronize()`` that of the device's streams, leaving the device all.
``query()`` is ``False`` while that work is queued (and the device then runs it: a poll
loop ends). A non-blocking copy to pinned host memory (``.to("cpu", non_blocking=True)``
pins its result, as PyTorch does) completes when its stream runs it, so the host reads
stale memory before synchronising; a non-blocking copy from pinned memory reads it when
it runs, from pageable memory when issued (CUDA stages it). Kernels from other threads
(inside :meth:`EmulatedCuda.attach`) go to the same queues. Graph replays are queued on
the replaying stream. What still runs when issued, after the work its stream is ordered
after: random kernels (they draw from the host generator in issue order, so seeds give
the default mode's numbers), kernels with no meta kernel, copies to pageable host memory.
Memory the host frees while queued work still uses it counts as freed (the reuse check
above runs then, as in the default mode) but stays alive until that work ran: a missing
``record_stream`` is reported, it does not corrupt a value. Not modelled: reads of
device memory behind the dispatcher's back (a C++ extension's own kernels), a GPU
running work *before* a synchronisation (queued work runs only when something waits for
it).

**Simulated time** (:meth:`EmulatedCuda.timeline`): kernels take the cost model's
duration on their stream's clock, waits and synchronisations move clocks, and streams
overlap where nothing orders them; the timeline gives the makespan, the streams used and
how many ran at once. These figures are simulated, never measurements.

What it cannot show: measured time (speed, real asynchrony of the host),
the parts of autograd's stream handling ``_autograd`` lists as not modelled,
the CUDA calls of ``streamsched._C``'s CUDA backend (its
runtime's logic runs here, through ``NativeStreamOps``), peak memory
of the real allocator, kernels PyTorch does not dispatch (custom CUDA extensions).

Example::

    >>> from streamsched.emulated_cuda import EmulatedCuda
    >>> with EmulatedCuda() as cuda:                       # doctest: +SKIP
    ...     a = torch.ones(4, device="cuda")
    ...     s = torch.cuda.Stream()
    ...     with torch.cuda.stream(s):
    ...         b = a * 2                                   # no wait: a race
    Traceback (most recent call last):
    UnsynchronizedAccess: ...
"""

from __future__ import annotations

import contextlib
import random
from typing import Any, Iterator, Optional

from . import _api
from ._async import WorkQueue
from ._autograd import BackwardStreams
from ._core import CudaError, Emulator, Report, UnsynchronizedAccess
from ._modes import KernelMode, PlacementMode
from ._timing import KernelSpan, Timeline

__all__ = ["EmulatedCuda", "Report", "UnsynchronizedAccess", "CudaError", "active", "Timeline", "KernelSpan"]


def active() -> Optional[EmulatedCuda]:
    """The emulated device in use, if any."""
    return _CURRENT


_CURRENT: Optional[EmulatedCuda] = None


class EmulatedCuda:
    """Context manager: emulate ``devices`` CUDA devices in this process (see the module
    docstring). One at a time; enter and exit in the same thread. Its PyTorch modes are
    thread-local: threads other than the entering one see ``torch.cuda`` emulated, and
    create or run tensors on the emulated device inside :meth:`attach`.

    Args:
        devices: how many devices (``cuda:0`` ... ``cuda:{devices-1}``).
        seed: seed of the random replay order of captured graphs, and of the order in
            which the asynchronous mode runs queued work.
        raise_on_race: raise :class:`UnsynchronizedAccess` at the kernel that races (the
            report is kept either way).
        asynchronous: queue kernels per stream and run them at synchronisation points
            (see the module docstring); by default every kernel runs when issued.
    """

    def __init__(self, devices: int = 2, seed: int = 0, raise_on_race: bool = True, asynchronous: bool = False):
        self.emulator = Emulator(devices, seed=seed, raise_on_race=raise_on_race)
        self.emulator.backward = BackwardStreams(self.emulator)
        if asynchronous:
            self.emulator.work = WorkQueue(random.Random(seed))
        self._patches: Any = None
        self._modes: list[Any] = []

    def __enter__(self) -> EmulatedCuda:
        global _CURRENT
        if _CURRENT is not None:
            raise RuntimeError("an emulated CUDA device is already active")
        emu = self.emulator
        self._patches = _api.install(emu)
        emu.active = True
        self._modes = [PlacementMode(emu), KernelMode(emu)]
        for m in self._modes:
            m.__enter__()
        _CURRENT = self
        return self

    def __exit__(self, *exc: Any) -> None:
        work = self.emulator.work
        try:
            if work is not None:
                with self.emulator.lock:
                    work.run_all()  # what is still queued runs before the device goes away
        except Exception:
            self._leave(exc)
            if exc[0] is None:
                raise
            return
        self._leave(exc)

    def _leave(self, exc: tuple) -> None:
        global _CURRENT
        _CURRENT = None
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []
        self.emulator.active = False
        _api.uninstall(self._patches)

    @property
    def asynchronous(self) -> bool:
        """Whether kernels are queued per stream and run at synchronisation points."""
        return self.emulator.work is not None

    @contextlib.contextmanager
    def attach(self) -> Iterator[None]:
        """Enter the device's PyTorch modes in this thread (they are thread-local): a
        thread other than the one that entered the device issues kernels on it inside
        this block, onto the same streams (and, in the asynchronous mode, queues)."""
        if not self.emulator.active:
            raise RuntimeError("the emulated CUDA device is not active")
        modes = [PlacementMode(self.emulator), KernelMode(self.emulator)]
        for m in modes:
            m.__enter__()
        try:
            yield
        finally:
            for m in reversed(modes):
                m.__exit__(None, None, None)

    def pending(self) -> int:
        """Asynchronous mode: how many kernels are queued and have not run yet."""
        work = self.emulator.work
        return 0 if work is None else len(work.pending)

    # --- what was found -------------------------------------------------------------------

    @property
    def reports(self) -> list[Report]:
        return self.emulator.reports

    def take_reports(self, kind: Optional[str] = None) -> list[Report]:
        """Reports so far (of ``kind``: ``"race"``, ``"reuse"``, ``"replay-freed"``, or all),
        removed from :attr:`reports`."""
        return self.emulator.take_reports(kind)

    def leaks(self) -> list[str]:
        """Graph memory pools left behind by failed captures."""
        return self.emulator.leaks()

    def take_leaks(self) -> list[str]:
        """:meth:`leaks`, after which those pools count as released."""
        return self.emulator.take_leaks()

    @property
    def advisories(self) -> list[str]:
        """Things CUDA allows that PyTorch advises against (a graph pool shared by captures
        on different streams)."""
        return self.emulator.advisories

    def check(self) -> None:
        """Raise ``AssertionError`` listing every report and leak not taken yet."""
        problems = [str(r) for r in self.emulator.reports] + self.leaks()
        if problems:
            raise AssertionError("emulated CUDA device found:\n  " + "\n  ".join(problems))

    @contextlib.contextmanager
    def timeline(self) -> Iterator[Timeline]:
        """Record the kernels issued inside the block in simulated time (durations from
        ``streamsched.ir.cost.GPU_MODEL``, streams overlapping where no wait orders them;
        see ``streamsched.emulated_cuda._timing``). Every figure it gives is simulated."""
        recorded = Timeline()
        clocks = self.emulator.clocks
        clocks.recording.append(recorded)
        try:
            yield recorded
        finally:
            clocks.recording.remove(recorded)

    @property
    def backward_kernels(self) -> dict[str, int]:
        """How many kernels autograd's backward ran on each stream (by stream name), since
        the device was entered: backward nodes run on the streams of their forward ops."""
        names = {s.skey: s.name for s in self.emulator._streams.values()}
        return {names[k]: n for k, n in self.emulator.backward.backward_kernels.items()}

    def is_capturing(self) -> bool:
        return any(not c.ended for c in self.emulator._captures)
