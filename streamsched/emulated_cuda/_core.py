"""The emulated device: streams, events, memory blocks, captures and the race checker.

Everything here is plain bookkeeping in Python; the torch-facing pieces (the
``torch.cuda`` replacements, the two PyTorch modes) call into :class:`Emulator`.

Ordering is analysed, not simulated: kernels run at once on the CPU, and every kernel's
reads and writes of device memory are handed, per storage, to PyTorch's own stream
sanitizer (``torch.cuda._sanitizer.EventHandler``), which keeps a vector clock per stream
and reports an access that no chain of events, stream waits or host synchronisations
orders after a conflicting one. Captured work is different: it is recorded as a graph
and each replay runs it again in a random order consistent only with the captured
dependencies. In the asynchronous mode (``_async``) kernels are queued per stream
instead and run at synchronisation points (:attr:`Emulator.work`); the checker still
sees every kernel when it is issued.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.utils._pytree as pytree
from torch.cuda._sanitizer import EventHandler, UnsynchronizedAccessError
from torch.utils._python_dispatch import _disable_current_modes

from ._timing import Clocks, critical_path

__all__ = ["Emulator", "Report", "UnsynchronizedAccess", "CudaError"]

CudaError: type = getattr(torch, "AcceleratorError", RuntimeError)
"""What PyTorch raises for a failing CUDA call (``torch.AcceleratorError``)."""

_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"
_NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"


class _StackSummary(traceback.StackSummary):
    """The sanitizer records a stack with every access; walking the whole stack through
    ``linecache`` per kernel dominates the emulator's cost, so keep the innermost frames
    that are neither PyTorch's nor the emulator's, with source lines read only if printed."""

    @classmethod
    def extract(
        cls, frame_gen: Any, *, limit: Any = None, lookup_lines: bool = True, capture_locals: bool = False
    ) -> Any:
        out = cls()
        for frame, lineno in frame_gen:
            name = frame.f_code.co_filename
            if _INTERNAL in name or _TORCH in name or "_pytest" in name or "pluggy" in name:
                continue
            out.append(traceback.FrameSummary(name, lineno, frame.f_code.co_name, lookup_line=False))
            if len(out) >= 10:
                break
        return out


_INTERNAL = "emulated_cuda"
_TORCH = f"{torch.__path__[0]}"
SANITIZER_TRACEBACK = types.SimpleNamespace(StackSummary=_StackSummary, walk_stack=traceback.walk_stack)


class UnsynchronizedAccess(RuntimeError):
    """A kernel touched memory another stream may still be using (a missing wait), or the
    allocator could hand out memory another stream may still read (a missing
    ``record_stream``), or a graph replay read memory freed after its capture."""

    def __init__(self, reports: list[Report]):
        self.reports = reports
        super().__init__("\n".join(str(r) for r in reports))


@dataclass
class Report:
    """One problem found on the emulated device.

    ``kind`` is one of ``"race"`` (two accesses to one storage, at least one a write, on
    streams with nothing ordering them), ``"reuse"`` (memory freed while a stream that
    used it, without ``record_stream``, may still be running), ``"replay-freed"`` (a graph
    replay reads memory freed after the capture), ``"capture"`` (a capture rule broken),
    ``"pool"`` (a graph memory pool left recording by a capture that never ended).
    """

    kind: str
    message: str
    detail: Any = field(default=None, repr=False)

    def __str__(self) -> str:
        return f"[{self.kind}] {self.message}"


class _Stream:
    __slots__ = ("device", "stream_id", "skey", "handle", "priority", "capture")

    def __init__(self, device: int, stream_id: int, skey: int, handle: int, priority: int = 0):
        self.device = device
        self.stream_id = stream_id
        self.skey = skey
        self.handle = handle
        self.priority = priority
        self.capture: Optional[_Capture] = None

    @property
    def name(self) -> str:
        if self.stream_id == 0:
            return f"default stream of cuda:{self.device}"
        return f"stream {self.stream_id} of cuda:{self.device}"


class _EventState:
    __slots__ = (
        "eid",
        "device",
        "recorded",
        "capture",
        "frontier",
        "time",
        "timing",
        "checker",
        "sim",
        "marks",
        "__weakref__",
    )

    def __init__(self, eid: int, timing: bool):
        self.eid = eid
        self.device: Optional[int] = None
        self.recorded = False
        self.capture: Optional[_Capture] = None
        self.frontier: frozenset = frozenset()
        self.time = 0.0
        self.timing = timing
        self.checker: Optional[EventHandler] = None
        self.sim = 0.0  # simulated time of the work it was recorded after (_timing)
        self.marks: frozenset = frozenset()  # queued work it was recorded after (_async)


class _Block:
    """One storage on an emulated device (what the caching allocator calls a block)."""

    __slots__ = ("cdata", "key", "device", "alloc", "capture", "uses", "recorded", "nbytes", "dtype", "storage_ref")

    def __init__(self, cdata: int, key: Optional[int], device: int, alloc: _Stream, capture: Optional[_Capture]):
        self.cdata = cdata
        self.key = key
        self.device = device
        self.alloc = alloc
        self.capture = capture
        self.uses: dict[int, tuple[int, int, _Stream]] = {}  # stream key -> (checker id, seq, stream)
        self.recorded: set[int] = set()
        self.nbytes = 0
        self.dtype: Optional[torch.dtype] = None
        self.storage_ref: Any = None

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "") if self.dtype is not None else "?"
        return f"{self.nbytes} bytes ({dtype}) on cuda:{self.device}, allocated on the {self.alloc.name}"


class _Pool:
    __slots__ = ("pool_id", "users", "recording", "streams")

    def __init__(self, pool_id: tuple):
        self.pool_id = pool_id
        self.users = 0
        self.recording: Optional[_Capture] = None
        self.streams: set[int] = set()


class _Node:
    __slots__ = ("nid", "func", "args", "kwargs", "outputs", "fresh", "deps", "reads", "writes", "stream", "duration")

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if not self.fresh:
            return
        for i, (old, value) in enumerate(zip(self.outputs, tensors_in(result))):
            if i in self.fresh:
                old.copy_(value)


class _Capture:
    _ids = itertools.count(1)

    def __init__(self, origin: _Stream, mode: str, pool: _Pool):
        self.cid = next(self._ids)
        self.origin = origin
        self.device = origin.device
        self.mode = mode
        self.thread = threading.get_ident()
        self.pool = pool
        self.streams: dict[int, _Stream] = {origin.skey: origin}
        self.frontier: dict[int, frozenset] = {origin.skey: frozenset()}
        self.nodes: list[_Node] = []
        self.checker = EventHandler()
        self.invalid: Optional[str] = None
        self.ended = False
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.allocations: list[_Block] = []
        self.externals: dict[int, tuple[Any, str]] = {}  # cdata -> (weakref to storage, description)
        self.aliases: dict[tuple, torch.Tensor] = {}


class _Graph:
    def __init__(self, capture: _Capture):
        self.device = capture.device
        self.nodes = capture.nodes
        self.externals = list(capture.externals.values())
        self.reads: dict[int, _Block] = {}
        self.writes: dict[int, _Block] = {}
        self.holds: list[torch.Tensor] = []  # the graph's own memory, kept alive as its pool would
        for node in self.nodes:
            for b in node.reads:
                self.reads.setdefault(b.cdata, b)
            for b in node.writes:
                self.writes.setdefault(b.cdata, b)


_UNTYPED_STORAGE = torch._C.TensorBase.untyped_storage
_USE_COUNT = torch._C._storage_Use_Count
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction


def tensors_in(value: Any, out: Optional[list] = None) -> list:
    """The tensors in a nest of tuples, lists and dicts, in order (pytree's order)."""
    if out is None:
        out = []
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            tensors_in(v, out)
    return out


def storage_id(t: torch.Tensor) -> Optional[int]:
    """The identity of ``t``'s storage, or ``None`` for a tensor without one (a sparse or
    meta tensor): what the modes match fresh outputs and gradients by."""
    try:
        return torch._C.TensorBase.untyped_storage(t)._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _storage(t: torch.Tensor) -> Any:
    with _NO_TORCH_FUNCTION():
        return _UNTYPED_STORAGE(t)


class Emulator:
    """The state of every emulated CUDA device of the process; see the package docstring."""

    def __init__(self, devices: int = 2, seed: int = 0, raise_on_race: bool = True):
        if devices < 1:
            raise ValueError("devices must be >= 1")
        self.num_devices = devices
        self.rng = random.Random(seed)
        self.raise_on_race = raise_on_race
        self.lock = threading.RLock()
        self.active = False
        self.checker = EventHandler()
        self.reports: list[Report] = []
        self.advisories: list[str] = []
        self.synchronize_calls: list[int] = []
        self._tls = threading.local()
        self._skeys = itertools.count(1)
        self._stream_ids = itertools.count(1)
        self._eids = itertools.count(1)
        self._private_pools = itertools.count(1)
        self._user_pools = itertools.count(1)
        self._streams: dict[tuple[int, int], _Stream] = {}
        self._blocks: dict[int, _Block] = {}
        self._pinned: dict[int, bool] = {}
        self._pending: dict[tuple[int, int], list[tuple[str, _Stream, int, _Stream]]] = {}
        self._captures: list[_Capture] = []
        self._pools: dict[tuple, _Pool] = {}
        # Devices whose CUDA generator is in capture mode (``CUDAGeneratorState.capturing_``):
        # ``CUDAGraph::capture_begin`` sets it before any of its checks, only a successful
        # ``capture_end`` clears it. While set, a random kernel outside a capture raises.
        self.generators_capturing: set[int] = set()
        self._graphs: weakref.WeakSet[Any] = weakref.WeakSet()
        self._allocated = [0] * devices
        self._peak = [0] * devices
        self.clocks = Clocks()  # simulated time (_timing)
        # Autograd's stream handling in backward (_autograd.BackwardStreams), set by EmulatedCuda.
        self.backward: Any = None
        # The queues of the asynchronous mode (_async.WorkQueue), set by EmulatedCuda; None:
        # every kernel runs when issued.
        self.work: Any = None
        for d in range(devices):
            self._new_stream(d, 0)

    # --- per-thread device and stream --------------------------------------------------

    def _local(self) -> Any:
        tls = self._tls
        if not hasattr(tls, "device"):
            tls.device = 0
            tls.current = {}
            tls.targets = []
        return tls

    def check_index(self, index: int) -> int:
        if not 0 <= index < self.num_devices:
            raise CudaError("CUDA error: invalid device ordinal")
        return index

    def current_device(self) -> int:
        return self._local().device

    def set_device(self, index: int) -> None:
        if index < 0:
            return
        self._local().device = self.check_index(index)

    def exchange_device(self, index: int) -> int:
        if index < 0:
            return -1
        previous = self.current_device()
        self.set_device(index)
        return previous

    def resolve(self, device: torch.device) -> torch.device:
        """A ``cuda`` device with its index (the current device when it has none)."""
        if device.type != "cuda":
            return device
        index = self.current_device() if device.index is None else self.check_index(device.index)
        return torch.device("cuda", index)

    def _new_stream(self, device: int, stream_id: int, priority: int = 0) -> _Stream:
        skey = next(self._skeys)
        handle = 0 if stream_id == 0 else 0x7F0000000000 + skey * 0x200
        s = _Stream(device, stream_id, skey, handle, priority)
        self._streams[(device, stream_id)] = s
        self.checker._handle_stream_creation(skey)
        return s

    def new_stream(self, device: int, priority: int = 0) -> _Stream:
        with self.lock:
            return self._new_stream(self.check_index(device), next(self._stream_ids), priority)

    def stream(self, device: int, stream_id: int) -> _Stream:
        try:
            return self._streams[(device, stream_id)]
        except KeyError:
            raise CudaError(f"CUDA error: invalid resource handle (no stream {stream_id} on cuda:{device})") from None

    def stream_of(self, obj: Any) -> _Stream:
        return self.stream(obj.device_index, obj.stream_id)

    def current_stream(self, device: Optional[int] = None) -> _Stream:
        tls = self._local()
        d = tls.device if device is None or device < 0 else device
        return self._streams[(d, tls.current.get(d, 0))]

    def set_current_stream(self, stream: _Stream) -> None:
        """``cudaSetStream`` as PyTorch does it: the stream's device becomes current too."""
        tls = self._local()
        tls.device = stream.device
        tls.current[stream.device] = stream.stream_id

    def push_target(self, device: Optional[torch.device]) -> None:
        self._local().targets.append(device)

    def pop_target(self) -> None:
        self._local().targets.pop()

    def target(self) -> Optional[torch.device]:
        targets = self._local().targets
        return targets[-1] if targets else None

    # --- memory --------------------------------------------------------------------------

    def block_of(self, t: torch.Tensor) -> Optional[_Block]:
        try:
            return self._blocks.get(_storage(t)._cdata)
        except (RuntimeError, NotImplementedError, TypeError):
            return None

    def device_of(self, t: torch.Tensor) -> Optional[int]:
        block = self.block_of(t)
        return None if block is None else block.device

    def adopt(self, value: Any, device: int, stream: Optional[_Stream] = None) -> list[_Block]:
        """Register every storage in ``value`` not known yet as memory of ``device``
        allocated on ``stream`` (the device's current stream by default)."""
        new: list[_Block] = []
        for t in tensors_in(value):
            if t.layout != torch.strided:
                continue
            try:
                st = _storage(t)
            except (RuntimeError, NotImplementedError):
                continue
            if st.device.type != "cpu":
                continue
            with self.lock:
                if st._cdata in self._blocks:
                    continue
                if stream is None:
                    stream = self.current_stream(device)
                new.append(self._register(st, t.dtype, device, stream))
        return new

    def _register(self, st: Any, dtype: torch.dtype, device: int, stream: _Stream) -> _Block:
        nbytes = st.nbytes()
        key = st.data_ptr() if nbytes else None
        cap = stream.capture if stream.capture is not None and not stream.capture.ended else None
        block = _Block(st._cdata, key, device, stream, cap)
        block.nbytes = nbytes
        block.dtype = dtype
        block.storage_ref = weakref.ref(st)
        self._blocks[st._cdata] = block
        weakref.finalize(st, self._freed, st._cdata)
        if cap is not None:
            cap.allocations.append(block)
        checker = cap.checker if cap is not None else self.checker
        if key is not None:
            checker.tensors_accessed.accesses.pop(key, None)
            checker.tensors_accessed.create_tensor(key, None)
        self._allocated[device] += nbytes
        self._peak[device] = max(self._peak[device], self._allocated[device])
        if self.work is not None:
            self._host_released(stream)
        self._check_reuse(checker, stream)
        return block

    def _freed(self, cdata: int) -> None:
        with self.lock:
            block = self._blocks.pop(cdata, None)
            if block is None or not self.active:
                return
            if self.work is not None and cdata in self.work.released:
                self.work.released.discard(cdata)  # freed by the host already (below)
                return
            self._release(block)

    def _host_released(self, stream: _Stream) -> None:
        """Asynchronous mode: memory allocated on ``stream`` that only queued work still
        holds was freed by the host; the allocator takes it back now (as the default mode
        does when the host frees it), though it stays alive for that work."""
        work = self.work
        held = work.holds.get(stream.skey)
        if not held:
            return
        released = work.released
        for cdata, n in list(held.items()):
            # Queued work holds n references; the storage's Python object one more.
            if cdata not in released and _USE_COUNT(cdata) <= n + 1:
                block = self._blocks.get(cdata)
                if block is not None:
                    released.add(cdata)
                    self._release(block)

    def _release(self, block: _Block) -> None:
        """The host freed ``block``: its memory goes back to its allocation stream's pool."""
        self._allocated[block.device] -= block.nbytes
        if block.key is not None:
            for checker in self._checkers():
                checker.tensors_accessed.accesses.pop(block.key, None)
        live = {id(c) for c in self._checkers()}
        for skey, (cid, seq, user) in block.uses.items():
            if skey in block.recorded or cid not in live:
                continue  # record_stream: the allocator waits for that stream's work
            pending = self._pending.setdefault((cid, block.alloc.skey), [])
            pending.append((block.describe(), user, seq, block.alloc))

    def rekey(self, blocks: list[_Block]) -> None:
        """Storages that were resized in place (``out=`` arguments) have new addresses."""
        for block in blocks:
            st = block.storage_ref()
            if st is None:
                continue
            nbytes = st.nbytes()
            key = st.data_ptr() if nbytes else None
            if key != block.key:
                self._allocated[block.device] += nbytes - block.nbytes
                block.key, block.nbytes = key, nbytes

    def is_pinned(self, t: torch.Tensor) -> bool:
        try:
            return _storage(t)._cdata in self._pinned
        except (RuntimeError, NotImplementedError):
            return False

    def mark_pinned(self, t: torch.Tensor) -> None:
        st = _storage(t)
        if st._cdata not in self._pinned:
            self._pinned[st._cdata] = True
            weakref.finalize(st, self._pinned.pop, st._cdata, None)

    def record_stream(self, t: torch.Tensor, stream: _Stream) -> None:
        block = self.block_of(t)
        if block is None:
            raise NotImplementedError(
                "Could not run 'aten::record_stream' with arguments from the 'CPU' backend: "
                "record_stream is for CUDA tensors"
            )
        block.recorded.add(stream.skey)

    def memory_stats(self, device: int) -> dict:
        def stat(current: int, peak: int) -> dict:
            return {"all": {"current": current, "peak": peak, "allocated": peak, "freed": peak - current}}

        cur, peak = self._allocated[device], self._peak[device]
        return {
            "allocated_bytes": stat(cur, peak),
            "reserved_bytes": stat(cur, peak),
            "active_bytes": stat(cur, peak),
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak(self, device: int) -> None:
        self._peak[device] = self._allocated[device]

    # --- the checker ---------------------------------------------------------------------

    def _checkers(self) -> list[EventHandler]:
        return [self.checker] + [c.checker for c in self._captures if not c.ended]

    def _checker_for(self, stream: _Stream) -> EventHandler:
        cap = stream.capture
        return cap.checker if cap is not None and not cap.ended else self.checker

    def report(self, kind: str, message: str, detail: Any = None, raise_now: Optional[bool] = None) -> Report:
        rep = Report(kind, message, detail)
        self.reports.append(rep)
        if raise_now if raise_now is not None else self.raise_on_race:
            raise UnsynchronizedAccess([rep])
        return rep

    def take_reports(self, kind: Optional[str] = None) -> list[Report]:
        """The reports so far (of ``kind``, or all), removed from :attr:`reports`."""
        with self.lock:
            taken = [r for r in self.reports if kind is None or r.kind == kind]
            self.reports = [r for r in self.reports if r not in taken]
        return taken

    def _check_reuse(self, checker: EventHandler, stream: _Stream) -> None:
        pending = self._pending.pop((id(checker), stream.skey), None)
        if not pending:
            return
        for what, user, seq, alloc in pending:
            if checker.syncs.is_ordered_after(stream.skey, seq, user.skey):
                continue
            self.report(
                "reuse",
                f"memory of {what} was freed while the {user.name} may still be using it "
                f"(no record_stream({user.name}) and no wait orders that use before the free); "
                f"the allocator may now hand it to new work on the {alloc.name}",
                raise_now=False,
            )

    def launch(
        self,
        stream: _Stream,
        reads: list[_Block],
        writes: list[_Block],
        name: str,
        duration: float = 0.0,
        host_reads: bool = False,
    ) -> None:
        """One kernel on ``stream`` reading and writing these blocks, lasting ``duration``
        simulated microseconds (captured kernels take no time until replayed);
        ``host_reads``: the host waits for its result."""
        if stream.capture is None:
            self.clocks.run(stream.skey, name, stream.name, duration, host_reads)
        checker = self._checker_for(stream)
        if self.work is not None:
            self._host_released(stream)
        self._check_reuse(checker, stream)
        wkeys = {b.key for b in writes if b.key is not None}
        rkeys = {b.key for b in reads if b.key is not None} - wkeys
        aliases: dict[int, list[str]] = {k: [] for k in rkeys | wkeys}
        errors = checker._handle_kernel_launch(stream.skey, rkeys, wkeys, set(), name, aliases)
        seq = checker.seq_num
        cid = id(checker)
        for b in itertools.chain(reads, writes):
            if b.alloc is not stream:
                b.uses[stream.skey] = (cid, seq, stream)
        if errors:
            reps = [self._race(e, stream, reads, writes) for e in errors]
            if self.raise_on_race:
                raise UnsynchronizedAccess(reps)

    def _race(
        self, err: UnsynchronizedAccessError, stream: _Stream, reads: list[_Block], writes: list[_Block]
    ) -> Report:
        by_key = {b.key: b for b in itertools.chain(reads, writes)}
        block = by_key.get(err.data_ptr)
        what = block.describe() if block is not None else f"storage {err.data_ptr:#x}"
        cur, prev = err.current_access, err.previous_access
        names = {s.skey: s.name for s in self._streams.values()}
        message = (
            f"{cur.operator} on the {names.get(cur.stream, cur.stream)} is {cur.type} memory of {what} "
            f"that {prev.operator} on the {names.get(prev.stream, prev.stream)} was {prev.type}, "
            f"and no event, stream wait or synchronisation orders the two"
        )
        rep = Report("race", message, err)
        self.reports.append(rep)
        return rep

    # --- capture legality --------------------------------------------------------------

    def _invalidate(self, cap: _Capture, reason: str) -> None:
        if cap.invalid is None:
            cap.invalid = reason

    def unsafe(self, what: str, streams: tuple = ()) -> None:
        """A call CUDA forbids while a capture could see it (a synchronisation, a host
        allocation): raise like CUDA and invalidate the capture it broke."""
        me = threading.get_ident()
        for cap in list(self._captures):
            if cap.ended:
                continue
            on_capturing = any(s.capture is cap for s in streams)
            if on_capturing or cap.mode == "global" or (cap.mode == "thread_local" and cap.thread == me):
                self._invalidate(cap, f"{what} during capture")
                raise CudaError(f"{_NOT_PERMITTED} ({what} while a graph capture is under way)")

    def _check_valid(self, stream: _Stream) -> Optional[_Capture]:
        cap = stream.capture
        if cap is not None and cap.invalid is not None:
            raise CudaError(_INVALIDATED)
        return cap

    # --- stream and event operations ----------------------------------------------------

    def stream_synchronize(self, stream: _Stream) -> None:
        self.unsafe("cudaStreamSynchronize", (stream,))
        self.run_queued(stream)
        self.checker._handle_stream_synchronization(stream.skey)
        self.clocks.host_waits(self.clocks.at(stream.skey))

    def stream_query(self, stream: _Stream) -> bool:
        self.unsafe("cudaStreamQuery", (stream,))
        work = self.work
        if work is not None:
            with self.lock:
                marks = work.marks(stream)
                if work.busy(marks):
                    work.run_until(marks)  # not done yet; a device polled makes progress
                    return False
        self.checker._handle_stream_synchronization(stream.skey)
        self.clocks.host_waits(self.clocks.at(stream.skey))
        return True

    def run_queued(self, stream: _Stream) -> None:
        """Asynchronous mode: run the queued work ``stream`` is ordered after (a host
        synchronisation with the stream)."""
        work = self.work
        if work is not None:
            with self.lock:
                work.run_until(work.marks(stream))

    def device_synchronize(self, device: int) -> None:
        self.synchronize_calls.append(device)
        streams = tuple(s for s in self._streams.values() if s.device == device)
        self.unsafe("cudaDeviceSynchronize", streams)
        if self.work is not None:
            with self.lock:
                self.work.run_until(self.work.stream_marks(streams))
        for s in streams:
            self.checker.syncs.all_streams_wait_for_stream(s.skey)
            self.clocks.host_waits(self.clocks.at(s.skey))

    def new_event(self, timing: bool) -> _EventState:
        ev = _EventState(next(self._eids), timing)
        self.checker._handle_event_creation(ev.eid)
        return ev

    def event_record(self, ev: _EventState, stream: _Stream) -> None:
        with self.lock:
            if ev.device is not None and ev.device != stream.device:
                raise RuntimeError(
                    f"Event device cuda:{ev.device} does not match recording stream's device cuda:{stream.device}."
                )
            cap = self._check_valid(stream)
            checker = self._checker_for(stream)
            checker._handle_event_record(ev.eid, stream.skey)
            ev.device = stream.device
            ev.recorded = True
            ev.checker = checker
            ev.capture = cap
            ev.frontier = cap.frontier.get(stream.skey, frozenset()) if cap is not None else frozenset()
            ev.time = time.perf_counter()
            ev.sim = self.clocks.at(stream.skey)
            if self.work is not None and cap is None:
                ev.marks = self.work.marks(stream)

    def event_wait(self, ev: _EventState, stream: _Stream) -> None:
        with self.lock:
            if not ev.recorded:
                return  # CUDA: waiting on an event never recorded completes at once
            cap = stream.capture
            ecap = ev.capture
            if ecap is not None:
                if ecap.ended:
                    raise CudaError(
                        "CUDA error: operation not permitted on an event last recorded in a capturing stream "
                        "(the event was recorded during a graph capture that has ended)"
                    )
                if ecap.invalid is not None:
                    raise CudaError(_INVALIDATED)
                if cap is None:
                    self._join(stream, ecap, ev.frontier)
                elif cap is ecap:
                    cap.frontier[stream.skey] = cap.frontier.get(stream.skey, frozenset()) | ev.frontier
                else:
                    reason = "a wait would merge two independent capture sequences"
                    self._invalidate(cap, reason)
                    self._invalidate(ecap, reason)
                    raise CudaError(f"{_NOT_PERMITTED} ({reason}: cudaErrorStreamCaptureIsolation)")
                ecap.checker._handle_event_wait(ev.eid, stream.skey)
                return
            if cap is not None:
                reason = (
                    f"the capturing {stream.name} waits on an event recorded outside the capture "
                    "(CUDA allows that only with cudaEventWaitExternal)"
                )
                self._invalidate(cap, reason)
                raise CudaError(f"{_NOT_PERMITTED} ({reason})")
            self.checker._handle_event_wait(ev.eid, stream.skey)
            self.clocks.wait(stream.skey, ev.sim)
            if self.work is not None:
                self.work.wait(stream, ev.marks)

    def _join(self, stream: _Stream, cap: _Capture, frontier: frozenset) -> None:
        """A stream waits on an event recorded in a capture: it joins that capture."""
        stream.capture = cap
        cap.streams[stream.skey] = stream
        cap.frontier[stream.skey] = frontier
        cap.checker._handle_stream_creation(stream.skey)

    def event_query(self, ev: _EventState) -> bool:
        self._check_captured_event(ev)
        self.unsafe("cudaEventQuery")
        work = self.work
        if work is not None and ev.recorded:
            with self.lock:
                if work.busy(ev.marks):
                    work.run_until(ev.marks)  # not done yet; a device polled makes progress
                    return False
        if ev.recorded:
            self.checker._handle_event_synchronization(ev.eid)
            self.clocks.host_waits(ev.sim)
        return True

    def event_synchronize(self, ev: _EventState) -> None:
        self._check_captured_event(ev)
        self.unsafe("cudaEventSynchronize")
        if self.work is not None and ev.recorded:
            with self.lock:
                self.work.run_until(ev.marks)
        if ev.recorded:
            self.checker._handle_event_synchronization(ev.eid)
            self.clocks.host_waits(ev.sim)

    def _check_captured_event(self, ev: _EventState) -> None:
        if ev.capture is not None:
            if not ev.capture.ended:
                self._invalidate(ev.capture, "query or synchronisation of a captured event")
            raise CudaError("CUDA error: operation not permitted on an event last recorded in a capturing stream")

    def event_deleted(self, ev: _EventState) -> None:
        if ev.checker is not None and ev.checker is self.checker:
            self.checker.syncs.recorded_sync_states.pop(ev.eid, None)

    # --- capture -------------------------------------------------------------------------

    def pool_handle(self) -> tuple:
        return (0, next(self._user_pools))

    def capture_begin(self, pool: Optional[tuple], mode: str) -> _Capture:
        if mode not in ("global", "thread_local", "relaxed"):
            raise RuntimeError(
                f"Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got {mode}"
            )
        with self.lock:
            stream = self.current_stream()
            # capture_prologue of the device's generator comes first in CUDAGraph::capture_begin:
            # a capture that fails from here on leaves the generator capturing.
            self.generators_capturing.add(stream.device)
            if stream.stream_id == 0:
                raise RuntimeError(
                    "CUDA graphs must be captured on a non-default stream. "
                    "(However, after capture, it's ok to replay them on the default stream.)"
                )
            if stream.capture is not None:
                raise CudaError("CUDA error: operation not permitted when stream is capturing (already capturing)")
            pool_id = tuple(pool) if pool is not None and any(pool) else (next(self._private_pools), 0)
            p = self._pools.get(pool_id)
            if p is None:
                p = self._pools[pool_id] = _Pool(pool_id)
            elif p.users == 0:
                # PyTorch's allocator keeps a pool every graph released (until its cache is
                # emptied) and asserts on a capture into it (create_or_incref_pool).
                raise RuntimeError(
                    f"it->second->use_count > 0 INTERNAL ASSERT FAILED at CUDACachingAllocator.cpp (emulated): "
                    f"a capture into graph memory pool {pool_id}, which every graph captured into it has "
                    "released; a pool is shared only with a graph that is alive (CUDAGraph.pool())"
                )
            if p.recording is not None:
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            p.users += 1
            if p.streams and stream.skey not in p.streams:
                self.advisories.append(
                    f"graph memory pool {pool_id} is shared by captures on different streams "
                    f"({len(p.streams) + 1}); PyTorch asks for the same capture stream when a pool is shared"
                )
            p.streams.add(stream.skey)
            cap = _Capture(stream, mode, p)
            p.recording = cap
            stream.capture = cap
            cap.checker._handle_stream_creation(stream.skey)
            self._captures.append(cap)
            return cap

    def _finish(self, cap: _Capture) -> None:
        """End of a capture however it ended: its streams capture no more, nothing it ran
        happened (external memory written at capture time gets its old bytes back)."""
        cap.ended = True
        for s in cap.streams.values():
            if s.capture is cap:
                s.capture = None
        if cap in self._captures:
            self._captures.remove(cap)
        with _quiet():
            for view, saved in cap.snapshots.values():
                view.copy_(saved)
        cap.snapshots.clear()
        cap.aliases.clear()
        for key in [k for k in self._pending if k[0] == id(cap.checker)]:
            del self._pending[key]

    def capture_end(self, cap: _Capture) -> _Graph:
        with self.lock:
            if self.current_stream(cap.device) is not cap.origin:
                raise RuntimeError("Capture must end on the same stream it began on.")
            unjoined = [] if cap.invalid is not None else self._unjoined(cap)
            self._finish(cap)
            if cap.invalid is not None:
                raise CudaError(f"{_INVALIDATED} (the capture was invalidated by: {cap.invalid})")
            if unjoined:
                names = ", ".join(s.name for s in unjoined)
                cap.invalid = f"unjoined work on {names}"
                raise CudaError(
                    "CUDA error: operation would make the capture sequence contain unjoined work "
                    f"(cudaErrorStreamCaptureUnjoined: {names} forked from the capture but never joined back "
                    "into the capturing stream)"
                )
            cap.pool.recording = None
            self.generators_capturing.discard(cap.device)
            graph = _Graph(cap)
            with _quiet():
                for block in cap.allocations:
                    st = block.storage_ref()
                    if st is None or block.cdata not in self._blocks:
                        continue
                    if block.dtype is not None and block.dtype.is_floating_point and block.nbytes:
                        n = block.nbytes // block.dtype.itemsize
                        torch.empty(0, dtype=block.dtype).set_(st, 0, (n,), (1,)).fill_(float("nan"))
            return graph

    def _unjoined(self, cap: _Capture) -> list[_Stream]:
        by_id = {n.nid: n for n in cap.nodes}
        done = set(cap.frontier.get(cap.origin.skey, frozenset()))
        todo = list(done)
        while todo:
            node = by_id[todo.pop()]
            for dep in node.deps:
                if dep not in done:
                    done.add(dep)
                    todo.append(dep)
        return [
            s for k, s in cap.streams.items() if s is not cap.origin and not cap.frontier.get(k, frozenset()) <= done
        ]

    def pool_released(self, cap: _Capture) -> None:
        p = cap.pool
        p.users = max(0, p.users - 1)

    def end_allocate_to_pool(self, pool_id: tuple) -> None:
        p = self._pools.get(tuple(pool_id))
        if p is not None:
            p.recording = None

    def release_pool(self, pool_id: tuple) -> None:
        p = self._pools.get(tuple(pool_id))
        if p is not None:
            p.users = max(0, p.users - 1)

    def leaks(self) -> list[str]:
        """Graph memory pools a failed capture left behind: still recording (the next
        capture into the pool fails, new allocations of its streams could land there) or
        still counted as in use by a graph that does not exist."""
        out = []
        live: dict[tuple, int] = {}
        for g in list(self._graphs):
            if g._graph is not None and g._pool_id is not None:
                live[g._pool_id] = live.get(g._pool_id, 0) + 1
        for p in self._pools.values():
            if p.recording is not None and p.recording.ended:
                out.append(f"graph memory pool {p.pool_id} is still recording for a capture that failed")
            elif p.users > live.get(p.pool_id, 0) + sum(1 for c in self._captures if c.pool is p):
                out.append(
                    f"graph memory pool {p.pool_id} is held by {p.users - live.get(p.pool_id, 0)} dead capture(s)"
                )
        capturing = {c.device for c in self._captures}
        for device in sorted(self.generators_capturing - capturing):
            out.append(
                f"the CUDA generator of cuda:{device} is still in capture mode after a capture that failed: "
                "every random kernel outside a capture now raises"
            )
        return out

    def take_leaks(self) -> list[str]:
        """:meth:`leaks`, after which those pools count as released."""
        found = self.leaks()
        live: dict[tuple, int] = {}
        for g in list(self._graphs):
            if g._graph is not None and g._pool_id is not None:
                live[g._pool_id] = live.get(g._pool_id, 0) + 1
        for p in self._pools.values():
            if p.recording is not None and p.recording.ended:
                p.recording = None
            p.users = min(p.users, live.get(p.pool_id, 0) + sum(1 for c in self._captures if c.pool is p))
        self.generators_capturing &= {c.device for c in self._captures}
        return found

    def record_node(
        self,
        cap: _Capture,
        stream: _Stream,
        func: Any,
        args: tuple,
        kwargs: dict,
        out: Any,
        reads: list[_Block],
        writes: list[_Block],
        fresh: Optional[set],
        duration: float = 0.0,
    ) -> None:
        node = _Node()
        node.nid = len(cap.nodes)
        node.duration = duration
        node.func = func
        node.args = pytree.tree_map(lambda v: self._replay_value(cap, v), args)
        node.kwargs = pytree.tree_map(lambda v: self._replay_value(cap, v), kwargs)
        node.outputs = [self._shadow(t) if i in (fresh or ()) else t for i, t in enumerate(tensors_in(out))]
        node.fresh = fresh or set()
        node.reads = reads
        node.writes = writes
        node.stream = stream.skey
        node.deps = cap.frontier.get(stream.skey, frozenset())
        cap.frontier[stream.skey] = frozenset((node.nid,))
        cap.nodes.append(node)

    def _replay_value(self, cap: _Capture, v: Any) -> Any:
        """What a captured kernel reads at replay: memory of the capture's own pool is held
        (the graph owns it); memory from outside is read by address, as a graph does,
        through a non-owning alias, and checked for liveness before each replay."""
        if not isinstance(v, torch.Tensor):
            return v
        try:
            st = _storage(v)
        except (RuntimeError, NotImplementedError):
            return v
        block = self._blocks.get(st._cdata)
        if block is None or st.nbytes() == 0:
            return v
        if block.capture is cap:
            return self._shadow(v)
        spec = (st._cdata, st.data_ptr(), v.dtype, v.storage_offset(), tuple(v.shape), tuple(v.stride()))
        alias = cap.aliases.get(spec)
        if alias is None:
            raw = torch._C._construct_storage_from_data_pointer(st.data_ptr(), torch.device("cpu"), st.nbytes())
            alias = torch.empty(0, dtype=v.dtype).set_(raw, v.storage_offset(), v.shape, v.stride())
            cap.aliases[spec] = alias
        if st._cdata not in cap.externals:
            cap.externals[st._cdata] = (weakref.ref(st), block.describe())
        return alias

    @staticmethod
    def _shadow(t: torch.Tensor) -> torch.Tensor:
        """The same memory and geometry as ``t`` in a tensor of its own: writes at replay
        (a graph's) do not move ``t``'s version counter, which autograd watches."""
        return torch.empty(0, dtype=t.dtype).set_(_storage(t), t.storage_offset(), t.shape, t.stride())

    def snapshot(self, cap: _Capture, blocks: list[_Block]) -> None:
        """Keep the bytes of outside memory a captured kernel is about to write: capture
        does not run kernels, so the write is undone when the capture ends."""
        for b in blocks:
            if b.capture is cap or b.cdata in cap.snapshots:
                continue
            st = b.storage_ref()
            if st is None or not st.nbytes():
                continue
            with _quiet():
                view = torch.empty(0, dtype=torch.uint8).set_(st, 0, (st.nbytes(),), (1,))
                cap.snapshots[b.cdata] = (view, view.clone())

    def replay(self, graph: _Graph) -> None:
        with self.lock:
            stream = self.current_stream(graph.device)
            if stream.capture is not None:
                raise NotImplementedError("replaying a CUDA graph inside a capture is not emulated")
            dead = [what for ref, what in graph.externals if self._dropped(ref)]
            if dead:
                reps = [
                    self.report(
                        "replay-freed",
                        f"graph replay reads memory freed after the capture: {what}",
                        raise_now=False,
                    )
                    for what in dead
                ]
                raise UnsynchronizedAccess(reps)
            reads = [b for b in graph.reads.values() if b.cdata in self._blocks]
            writes = [b for b in graph.writes.values() if b.cdata in self._blocks]
            span = critical_path({n.nid: n.duration for n in graph.nodes}, {n.nid: n.deps for n in graph.nodes})
            self.launch(stream, reads, writes, "cudaGraphLaunch", duration=span)
            if self.work is not None:
                # Asynchronous mode: the launch is queued on the replaying stream; the
                # order of its kernels is drawn when it runs.
                # Memory from outside the graph stays alive until the replay has run (the
                # graph reads it by address).
                held = [ref() for ref, _ in graph.externals]
                self.work.issue(stream, "cudaGraphLaunch", lambda: self._replay_nodes(graph, held))
                return
        self._replay_nodes(graph)

    def _dropped(self, ref: Any) -> bool:
        """Whether the host has freed the storage ``ref`` (a weak reference) points to; in
        the asynchronous mode, also one that only queued work still holds."""
        st = ref()
        if st is None:
            return True
        if self.work is None:
            return False
        block = self._blocks.get(st._cdata)
        if block is None:
            return True
        held = self.work.holds.get(block.alloc.skey, {}).get(block.cdata, 0)
        return _USE_COUNT(block.cdata) <= held + 1

    def _replay_nodes(self, graph: _Graph, held: Any = None) -> None:
        order = self._random_order(graph.nodes)
        with _quiet():
            for node in order:
                node.run()

    def _random_order(self, nodes: list[_Node]) -> list[_Node]:
        indegree = {n.nid: len(n.deps) for n in nodes}
        users: dict[int, list[_Node]] = {}
        for n in nodes:
            for d in n.deps:
                users.setdefault(d, []).append(n)
        ready = [n for n in nodes if not n.deps]
        order = []
        while ready:
            node = ready.pop(self.rng.randrange(len(ready)))
            order.append(node)
            for u in users.get(node.nid, ()):
                indegree[u.nid] -= 1
                if indegree[u.nid] == 0:
                    ready.append(u)
        return order


class _quiet:
    """Run torch ops with no PyTorch mode and no autograd (the emulator's own work)."""

    def __enter__(self) -> None:
        self._modes = _disable_current_modes()
        self._modes.__enter__()
        self._fn = torch._C.DisableTorchFunction()
        self._fn.__enter__()
        self._grad = torch.no_grad()
        self._grad.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._grad.__exit__(*exc)
        self._fn.__exit__(*exc)
        self._modes.__exit__(*exc)


def quiet() -> _quiet:
    return _quiet()
