"""Eager dispatch: run a model that cannot be traced, with its branch calls launched side by side.

When ``torch.fx`` cannot trace a model (``if x.sum() > 0:``, ``.item()``, lists whose length
depends on data) and the wrapper was built with ``strict=False``, each call runs the
model's own ``forward`` in the calling thread. Every call of a ``@streamsched.branch``
function or method made during that forward is *launched* instead of run inline, and
returns at once a :class:`PendingValue` that stands for the branch's result:

- CPU: the branch runs on a small pool of worker threads (lanes ``1..k``; the caller is
  lane 0). Grad mode, inference mode and autocast are carried into the lane. The pending
  value waits for the branch the first time it is used. ``executor="threads"`` always
  does this; ``"auto"`` first times a few calls inline and on lanes and keeps the faster
  (see :class:`_AutoHistory`); ``"serial"`` runs every branch inline, as eager does.
- CUDA: the branch is issued at once from the calling thread onto a pool stream that
  first waits for the caller's stream; an event is recorded after it. The first use on
  a stream makes that stream wait on the event and ``record_stream``s the result there.

A pending value is used like the value itself: it speaks the ``__torch_function__``
protocol (``torch.cat([a, b])``, ``self.head(a)``), forwards attributes (``a.shape``,
``a.relu()``), operators, indexing, iteration, ``bool``/``float``/``int``. Indexing a
pending tuple (``out[0]``) stays pending; unpacking one (``a, b = branch(x)``) stays
pending when the branch's result is on CUDA or its return annotation is a fixed-length
``tuple[...]``, and waits for the branch otherwise.

Before the call returns, every pending value in the forward's output is resolved, every
branch launched in the call is joined, and the earliest failing branch's exception
(the one eager execution would have met first) is raised.

Two hazards of running a branch beside the code after its call are handled:

- the forward writing in place to a tensor a running branch reads (``h.relu_()`` after
  ``self.tower(h)``): a ``TorchFunctionMode`` sees the write and waits for that branch
  first, as eager order requires;
- a branch writing in place to one of its own arguments: the code after its call may
  already have read the old value, so this is an :class:`EagerDispatchError` that names
  the branch.

Each call records a :class:`~streamsched.plan.Plan` (``mode="eager-dispatch"``: one task
per launched branch, with its lane or stream) and, with ``sync_log=True``, a
:class:`~streamsched.runtime.synclog.SyncLog` of every fork, launch, record, wait and
join, which :func:`~streamsched.runtime.synclog.check_happens_before` can replay.

Example::

    >>> import torch, streamsched as ss
    >>> from torch import nn
    >>> class Gate(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
    ...     @ss.branch
    ...     def tower(self, layer, x):
    ...         return torch.tanh(layer(x))
    ...     def forward(self, x):
    ...         if x.sum() > 0:                       # fx cannot trace this
    ...             return self.tower(self.a, x) + self.tower(self.b, x)
    ...         return self.tower(self.a, x)
    >>> sm = ss.StreamScheduledModule(Gate(), strict=False)
    >>> y = sm(torch.randn(2, 4).abs())
    >>> sm.plan.mode
    'eager-dispatch'
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import copy
import functools
import operator
import os
import queue
import threading
import time
import typing
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode

from .. import _generation
from ..branch import _eager_launcher
from ..errors import ConfigError, StreamSchedError
from ..plan import Plan, PlannedTask
from ..planner import signature_text
from .chaos import Chaos
from .synclog import SyncLog
from .threads import _TorchState

__all__ = ["run_eager_dispatch", "resolve", "PendingValue", "EagerSchedule", "EagerDispatchError"]

# A branch must save about this much (estimated microseconds, CPU) before lanes are used
# under executor="auto"; a thread hand-off costs some tens of microseconds per branch.
_MIN_SAVING_US = 1000.0
_HANDOFF_US = 40.0
# Calls of one call structure timed in each way of running CPU branches before "auto" decides,
# and how often (in calls) it re-times the way it does not use.
_MEASURED_CALLS = 3
_RETIME_EVERY = 64


class EagerDispatchError(StreamSchedError, RuntimeError):
    """A branch did something that cannot run beside the code after its call."""


# --- walking call arguments ---------------------------------------------------------------
#
# Any attribute probe of a pending value waits for its branch; these walkers look at exact
# types only, so walking a structure never waits.


def _map(value: Any, leaf: Callable[[Any], Any]) -> Any:
    kind = type(value)
    if kind is PendingValue:
        return leaf(value)
    if kind is list:
        return [_map(v, leaf) for v in value]
    if kind is tuple:
        return tuple(_map(v, leaf) for v in value)
    if kind is dict:
        return {k: _map(v, leaf) for k, v in value.items()}
    if issubclass(kind, tuple) and hasattr(kind, "_fields"):
        return kind(*(_map(v, leaf) for v in value))
    if kind is collections.OrderedDict:
        return kind((k, _map(v, leaf)) for k, v in value.items())
    return leaf(value)


def _leaves(value: Any, out: Optional[list] = None) -> list[Any]:
    if out is None:
        out = []
    kind = type(value)
    if kind is list or kind is tuple:
        for v in value:
            _leaves(v, out)
    elif kind is dict or kind is collections.OrderedDict:
        for v in value.values():
            _leaves(v, out)
    elif kind is not PendingValue and issubclass(kind, tuple) and hasattr(kind, "_fields"):
        for v in value:
            _leaves(v, out)
    else:
        out.append(value)
    return out


def _resolve_leaf(value: Any) -> Any:
    return value._ss_resolve() if type(value) is PendingValue else value


def resolve(value: Any) -> Any:
    """``value`` with every pending value in it (also inside lists, tuples, dicts) replaced
    by the branch result it stands for, waiting for the branches as needed."""
    return _map(value, _resolve_leaf)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in _leaves(value) if isinstance(v, torch.Tensor)]


def _storage_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
        return None


def _version(t: torch.Tensor) -> Optional[int]:
    if t.is_inference():
        return None  # inference tensors keep no version counter
    return t._version


# --- the lane pool (CPU) ---------------------------------------------------------------


class _LanePool:
    """Worker threads shared by every eager-dispatch call in the process.

    Each lane runs its jobs in submission order. A job waits only on jobs submitted before
    it, so the earliest unfinished job is always at the head of its lane and can run: lanes
    never deadlock on each other, whichever calls share them. A launch goes to the lane
    with the fewest unfinished jobs (an idle one if there is one).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue] = []
        self._unfinished: list[int] = []
        self._next = 0
        self._local = threading.local()
        # A forked child has none of the parent's threads: it starts a pool of its own.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_workers)

    def _forget_workers(self) -> None:
        self._lock = threading.Lock()
        self._queues = []
        self._unfinished = []

    def current_lane(self) -> int:
        """The lane of the calling thread (0 outside the pool)."""
        return getattr(self._local, "lane", 0)

    def reserve(self, lanes: int) -> int:
        with self._lock:
            while len(self._queues) < lanes:
                self._start_worker()
            start = self._next % lanes
            best = min(range(lanes), key=lambda i: (self._unfinished[i], (i - start) % lanes))
            self._next = best + 1
            self._unfinished[best] += 1
        return best + 1

    def submit(self, lane: int, job: Callable[[], None]) -> None:
        self._queues[lane - 1].put(job)

    def _start_worker(self) -> None:
        index = len(self._queues)
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queues.append(jobs)
        self._unfinished.append(0)

        def loop() -> None:
            self._local.lane = index + 1
            while True:
                job = jobs.get()
                try:
                    job()  # a job never raises: it hands its outcome to a future
                finally:
                    with self._lock:
                        self._unfinished[index] -= 1

        threading.Thread(target=loop, name=f"streamsched-eager-{index + 1}", daemon=True).start()


_LANES = _LanePool()


# --- stream backends (CUDA, and its simulation on CPU) ------------------------------------


class _CudaStreams:
    """A pool of CUDA streams on one device, shared by every eager-dispatch call."""

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: list[torch.cuda.Stream] = []
        self._lane_of: dict[int, int] = {}

    def stream(self, lane: int) -> torch.cuda.Stream:
        while len(self._pool) < lane:
            s = torch.cuda.Stream(device=self.device)
            self._pool.append(s)
            self._lane_of[s.cuda_stream] = len(self._pool)
        return self._pool[lane - 1]

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def key(self, stream: torch.cuda.Stream) -> int:
        return stream.cuda_stream

    def lane_of(self, stream: torch.cuda.Stream) -> int:
        # The caller's stream, or any stream the user made current, is stream 0 of the log.
        return self._lane_of.get(stream.cuda_stream, 0)

    def fork(self, side: torch.cuda.Stream, caller: torch.cuda.Stream) -> None:
        side.wait_stream(caller)

    def use(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # Memory on other devices is not allocated through this device's streams.
        if tensor.is_cuda and tensor.device == self.device:
            tensor.record_stream(stream)

    def join(self, caller: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
        caller.wait_stream(side)

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.gpu_delay(lane)


class _SimulatedStreams:
    """Streams as lane numbers: work runs at once in the calling thread while every
    decision is still taken and logged, so the CUDA logic is exercised on CPU."""

    is_cuda = False

    def __init__(self) -> None:
        self._local = threading.local()

    def stream(self, lane: int) -> int:
        return lane

    def current(self) -> int:
        current = getattr(self._local, "stream", None)
        return _LANES.current_lane() if current is None else current

    def key(self, stream: int) -> int:
        return stream

    def lane_of(self, stream: int) -> int:
        return stream

    def fork(self, side: int, caller: int) -> None:
        pass

    @contextlib.contextmanager
    def use(self, stream: int) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: int) -> None:
        return None

    def wait(self, stream: int, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        pass

    def join(self, caller: int, side: int) -> None:
        pass

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.delay(lane)


_SIMULATED = _SimulatedStreams()
_CUDA_STREAMS: dict[torch.device, _CudaStreams] = {}
_CUDA_LOCK = threading.Lock()


def _cuda_streams(device: torch.device) -> _CudaStreams:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _CUDA_LOCK:
        backend = _CUDA_STREAMS.get(device)
        if backend is None:
            backend = _CUDA_STREAMS[device] = _CudaStreams(device)
    return backend


# --- one launched branch ------------------------------------------------------------------


class _Launch:
    """Book-keeping of one branch call: where it ran, what it read and wrote, its outcome."""

    def __init__(self, call: _EagerCall, task_id: int, name: str, kind: str):
        self.call = call
        self.id = task_id
        self.name = name
        self.kind = kind  # "lane", "stream" or "inline"
        self.stream = 0
        self.backend: Any = None
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
            return self.backend.key(self.backend.current()) in self.consumers
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


# --- the pending value ---------------------------------------------------------------------

_METADATA = frozenset(
    {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "size", "dim", "numel", "requires_grad"}
)
_LAZY_INDEX = (int, str, slice, type(None), type(Ellipsis))


def _lazy_key(key: Any) -> bool:
    kind = type(key)
    if kind is tuple:
        return all(type(k) in _LAZY_INDEX for k in key)
    return kind in _LAZY_INDEX


class PendingValue:
    """Stands for a launched branch's result until it is first used.

    Any use (a torch function, an attribute, an operator, ``bool()``, ``len()``...) waits
    for the branch (CPU) or makes the current stream wait for it (CUDA) and then acts on
    the result; a branch's exception is raised there. Indexing with constants
    (``out[0]``, ``out["logits"]``, ``out[:, :4]``) gives another pending value.

    What a pending value cannot imitate: ``type(v)``, ``isinstance(v, torch.Tensor)``
    and identity (``v is None``) see the pending value itself. ``streamsched.runtime.eager.resolve(v)``
    gives the result.
    """

    __slots__ = ("_ss_launch", "_ss_parent", "_ss_key", "_ss_cached", "__weakref__")

    def __init__(self, launch: Optional[_Launch], parent: Optional[PendingValue] = None, key: Any = None):
        object.__setattr__(self, "_ss_launch", launch)
        object.__setattr__(self, "_ss_parent", parent)
        object.__setattr__(self, "_ss_key", key)
        object.__setattr__(self, "_ss_cached", _UNSET)

    # --- internals (the _ss_ prefix keeps them out of the forwarded namespace) ---

    def _ss_root(self) -> _Launch:
        node = self
        while node._ss_launch is None:
            node = node._ss_parent
        return node._ss_launch

    def _ss_resolve(self) -> Any:
        launch = self._ss_launch
        if launch is not None:
            return launch.call.consume(launch)
        value = self._ss_parent._ss_resolve()  # the parent's waits, for this stream
        cached = self._ss_cached
        if cached is _UNSET:
            cached = value[self._ss_key]
            object.__setattr__(self, "_ss_cached", cached)
        return cached

    def _ss_peek(self) -> tuple[bool, Any]:
        launch = self._ss_launch
        if launch is not None:
            return launch.peek()
        known, parent = self._ss_parent._ss_peek()
        return (True, parent[self._ss_key]) if known else (False, None)

    def _ss_length(self) -> Optional[int]:
        """The result's length when it is known without waiting for the branch."""
        known, raw = self._ss_peek()
        if known and isinstance(raw, (tuple, list)):
            return len(raw)
        if self._ss_launch is not None and not known:
            return self._ss_launch.expected_len
        return None

    # --- the protocols that make it usable as the value ---

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        return func(*resolve(args), **(resolve(kwargs) if kwargs else {}))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_ss_"):
            raise AttributeError(name)
        if name in _METADATA:
            # Shapes and dtypes need no synchronisation: keep the stream free to overlap.
            known, raw = self._ss_peek()
            if known and isinstance(raw, torch.Tensor):
                return getattr(raw, name)
        return getattr(self._ss_resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._ss_resolve(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._ss_resolve(), name)

    def __getitem__(self, key: Any) -> Any:
        if _lazy_key(key):
            return PendingValue(None, self, key)
        return self._ss_resolve()[resolve(key)]

    def __setitem__(self, key: Any, value: Any) -> None:
        self._ss_resolve()[resolve(key)] = resolve(value)

    def __delitem__(self, key: Any) -> None:
        del self._ss_resolve()[resolve(key)]

    def __len__(self) -> int:
        length = self._ss_length()
        return length if length is not None else len(self._ss_resolve())

    def __iter__(self) -> Iterator[Any]:
        length = self._ss_length()
        if length is not None:
            return iter([PendingValue(None, self, i) for i in range(length)])
        return iter(self._ss_resolve())

    def __reversed__(self) -> Iterator[Any]:
        return reversed(self._ss_resolve())

    def __contains__(self, item: Any) -> bool:
        return resolve(item) in self._ss_resolve()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._ss_resolve()(*args, **kwargs)

    def __bool__(self) -> bool:
        return bool(self._ss_resolve())

    def __float__(self) -> float:
        return float(self._ss_resolve())

    def __int__(self) -> int:
        return int(self._ss_resolve())

    def __index__(self) -> int:
        return operator.index(self._ss_resolve())

    def __complex__(self) -> complex:
        return complex(self._ss_resolve())

    def __round__(self, ndigits: Optional[int] = None) -> Any:
        return round(self._ss_resolve(), ndigits)

    def __hash__(self) -> int:
        return hash(self._ss_resolve())

    def __repr__(self) -> str:
        return repr(self._ss_resolve())

    def __str__(self) -> str:
        return str(self._ss_resolve())

    def __format__(self, spec: str) -> str:
        return format(self._ss_resolve(), spec)

    def __dir__(self) -> list[str]:
        return dir(self._ss_resolve())

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        import numpy

        return numpy.asarray(self._ss_resolve(), *args, **kwargs)

    def __copy__(self) -> Any:
        return copy.copy(self._ss_resolve())

    def __deepcopy__(self, memo: dict) -> Any:
        return copy.deepcopy(self._ss_resolve(), memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self._ss_resolve().__reduce_ex__(protocol)


_UNSET = object()


def _forward_binary(op: Callable[[Any, Any], Any]) -> Callable[[PendingValue, Any], Any]:
    def method(self: PendingValue, other: Any) -> Any:
        return op(self._ss_resolve(), _resolve_leaf(other))

    return method


def _forward_reflected(op: Callable[[Any, Any], Any]) -> Callable[[PendingValue, Any], Any]:
    def method(self: PendingValue, other: Any) -> Any:
        return op(_resolve_leaf(other), self._ss_resolve())

    return method


def _forward_unary(op: Callable[[Any], Any]) -> Callable[[PendingValue], Any]:
    def method(self: PendingValue) -> Any:
        return op(self._ss_resolve())

    return method


_BINARY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "matmul": operator.matmul,
    "truediv": operator.truediv,
    "floordiv": operator.floordiv,
    "mod": operator.mod,
    "divmod": divmod,
    "pow": operator.pow,
    "lshift": operator.lshift,
    "rshift": operator.rshift,
    "and": operator.and_,
    "xor": operator.xor,
    "or": operator.or_,
}
_IN_PLACE = {
    "iadd": operator.iadd,
    "isub": operator.isub,
    "imul": operator.imul,
    "imatmul": operator.imatmul,
    "itruediv": operator.itruediv,
    "ifloordiv": operator.ifloordiv,
    "imod": operator.imod,
    "ipow": operator.ipow,
    "ilshift": operator.ilshift,
    "irshift": operator.irshift,
    "iand": operator.iand,
    "ixor": operator.ixor,
    "ior": operator.ior,
}
_COMPARE = {
    "lt": operator.lt,
    "le": operator.le,
    "eq": operator.eq,
    "ne": operator.ne,
    "gt": operator.gt,
    "ge": operator.ge,
}
_UNARY = {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs, "invert": operator.invert}

for _name, _op in {**_BINARY, **_COMPARE, **_IN_PLACE}.items():
    setattr(PendingValue, f"__{_name}__", _forward_binary(_op))
for _name, _op in _BINARY.items():
    setattr(PendingValue, f"__r{_name}__", _forward_reflected(_op))
for _name, _op in _UNARY.items():
    setattr(PendingValue, f"__{_name}__", _forward_unary(_op))
del _name, _op


# --- the write guard --------------------------------------------------------------------

_INPLACE_DUNDERS = frozenset(f"__{name}__" for name in (*_IN_PLACE, "setitem", "delitem"))


def _writes(func: Any, kwargs: dict) -> bool:
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
        return True
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return False
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


class _WriteGuard(TorchFunctionMode):
    """Sees every torch call of the forward (in the calling thread only: modes are
    thread-local) and, before one that writes in place to a tensor some running branch
    reads, waits for that branch, as eager order requires."""

    def __init__(self, call: _EagerCall):
        super().__init__()
        self.call = call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        call = self.call
        if call.launches and _writes(func, kwargs):
            written = _tensors(resolve(args[:1])) + _tensors(resolve(kwargs.get("out")))
            if written:
                call.before_write(written)
        return func(*args, **kwargs)


# --- one call ----------------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _annotated_length(fn: Callable[..., Any]) -> Optional[int]:
    """The length a branch's return annotation promises (``-> tuple[Tensor, Tensor]``)."""
    try:
        returns = typing.get_type_hints(fn).get("return")
    except Exception:  # noqa: BLE001 - an annotation we cannot evaluate promises nothing
        return None
    if typing.get_origin(returns) is not tuple:
        return None
    items = typing.get_args(returns)
    if not items or Ellipsis in items or items == ((),):
        return None
    return len(items)


def _handoff_event(task_id: int) -> int:
    """The SyncLog event of handing task ``task_id`` to its lane (task events are >= 0)."""
    return -2 - task_id


def _bound(config: Any, device_type: str) -> int:
    """Streams (the caller's included) one call may use, as ``num_streams`` counts them."""
    if config.num_streams != "auto":
        return int(config.num_streams)
    if device_type == "cuda":
        return 8
    return max(1, min(8, (os.cpu_count() or 1) + 1))


_MODULE_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module state -> call structure -> _AutoHistory


def _module_paths(model: torch.nn.Module) -> dict[int, str]:
    cached = _MODULE_PATHS.get(model)
    if cached is None or cached[0] != _generation.current():
        cached = (_generation.current(), {id(m): path for path, m in model.named_modules()})
        _MODULE_PATHS[model] = cached
    return cached[1]


class _EagerCall:
    """The state of one eager-dispatch call; installed as the branch launcher."""

    def __init__(self, sm: Any, tensors: list[torch.Tensor], device: torch.device, log: Optional[SyncLog], mode: _Mode):
        self.model = sm.module
        self.config = sm.config
        self.log = log
        self.mode = mode
        # Nothing to decide, log or guard per launch: every branch of the call runs inline
        # (a call whose inputs are on the CPU runs even a branch that moves to CUDA inline).
        self.all_inline = mode.cpu == "inline" and log is None and device.type != "cuda"
        self.chaos = Chaos(self.config.chaos, sm._ss.calls) if self.config.chaos is not None else None
        self.observer = sm._ss.observer
        self.launches: list[_Launch] = []
        self.lock = threading.Lock()
        self.open = True
        self.stream_lane = 0
        self.used: set[int] = set()  # lanes and streams this call launched on
        self.forked: set[int] = set()  # lanes whose fork this call has logged
        self.backends: dict[int, tuple[Any, set[int]]] = {}  # id(stream backend) -> (backend, streams used)
        self.notes: dict[str, None] = {}  # an ordered set
        # Small integer ids for the values the log talks about; the objects are held so
        # that no id() is reused during the call.
        self.slots: dict[int, tuple[int, Any]] = {}
        self.input_slots = tuple(sorted({self.new_slot(t)[0] for t in tensors}))

    # --- ids and log ---

    def new_slot(self, value: Any) -> tuple[int, bool]:
        with self.lock:
            entry = self.slots.get(id(value))
            if entry is not None:
                return entry[0], False
            entry = self.slots[id(value)] = (len(self.slots), value)
            return entry[0], True

    def _log_caller_values(self, tensors: list[torch.Tensor]) -> list[int]:
        """Ids of a launch's tensor arguments; a tensor the forward made is logged as
        written on the caller's stream (0) before the launch forks from it."""
        slots = []
        for t in tensors:
            slot, new = self.new_slot(t)
            if new and self.log is not None:
                self.log.launch(0, -1, (), (slot,))
            slots.append(slot)
        return slots

    # --- launching ---

    def __call__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        launch = _Launch(self, len(self.launches), self._task_name(fn, args), "inline")
        if self.all_inline:
            self.launches.append(launch)
            return self._run_branch(launch, fn, args, kwargs)
        leaves = _leaves((args, kwargs))
        plain = [v for v in leaves if isinstance(v, torch.Tensor)]
        # Pending values of an earlier call (kept by the model) are finished: no producers.
        roots = (v._ss_root() for v in leaves if type(v) is PendingValue)
        launch.producers = list({id(p): p for p in roots if p.call is self}.values())
        device = self._device(plain, launch.producers, args)
        if device.type == "cuda" and self.config.executor == "threads":
            raise ConfigError(
                f"executor='threads' runs CPU tensors, but branch '{launch.name}' of "
                f"{type(self.model).__name__} reads tensors on {device}; use executor='streams' (or 'auto') for CUDA"
            )
        launch.input_slots = self._log_caller_values(plain)
        launch.input_keys = {k for t in plain if (k := _storage_key(t)) is not None}
        self.launches.append(launch)
        if device.type == "cuda" and self.config.executor != "serial" and torch.cuda.is_available():
            lanes = _bound(self.config, "cuda") - 1
            if lanes >= 1:
                return self._launch_on_stream(launch, _cuda_streams(device), lanes, fn, args, kwargs)
        elif self.mode.cpu == "lanes":
            return self._launch_on_lane(launch, fn, args, kwargs)
        elif self.mode.cpu == "streams":
            return self._launch_on_stream(launch, _SIMULATED, self.mode.bound - 1, fn, args, kwargs)
        return self._run_inline(launch, fn, args, kwargs)

    def _device(self, plain: list[torch.Tensor], producers: list[_Launch], args: tuple) -> torch.device:
        for t in plain:
            if t.is_cuda:
                return t.device
        for p in producers:
            if p.kind == "stream" and p.backend.is_cuda:
                return p.backend.device
        if plain or producers:
            return torch.device("cpu")
        if args and isinstance(args[0], torch.nn.Module):
            for t in args[0].parameters():
                return t.device
            for t in args[0].buffers():
                return t.device
        return torch.device("cpu")

    def _task_name(self, fn: Callable[..., Any], args: tuple) -> str:
        if args and isinstance(args[0], torch.nn.Module):
            owner = args[0]
            path = _module_paths(self.model).get(id(owner))
            if path is None:
                return f"{type(owner).__name__}.{fn.__name__}"
            return f"{path}.{fn.__name__}" if path else fn.__name__
        return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))

    def _observe(self, launch: _Launch, stream: int) -> Any:
        observer = self.observer
        if observer is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def bracket() -> Iterator[None]:
            task = _TaskInfo(launch.id, launch.name, stream)
            observer.push(task, stream)
            try:
                yield
            finally:
                observer.pop(task, stream)

        return bracket()

    def _run_branch(self, launch: _Launch, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run the body on the current lane or stream, with the checks every kind of launch
        makes; log its launch."""
        if launch.producers:
            args, kwargs = resolve(args), resolve(kwargs)
            launch.waits = sorted(p.id for p in launch.producers if p.kind != "inline" and p.stream != launch.stream)
        # Run inline, a branch may write to its arguments as in eager; launched, it may not.
        launched = launch.kind != "inline"
        versions = [(t, _version(t)) for t in _tensors((args, kwargs))] if launched else []
        start = time.perf_counter_ns()
        try:
            with self._observe(launch, launch.stream):
                result = fn(*args, **kwargs)
        finally:
            launch.cost_us = (time.perf_counter_ns() - start) / 1e3
        if launched:
            self._check_untouched(launch, versions)
            self._check_length(launch, result)
        if self.log is not None:
            outputs = _tensors(result)
            writes = [self.new_slot(t)[0] for t in outputs] if outputs else [self.new_slot(result)[0]]
            launch.write_slots = tuple(writes)
            reads = list(launch.input_slots)
            for p in launch.producers:
                reads.extend(p.write_slots)
            self.log.launch(launch.stream, launch.id, tuple(reads), launch.write_slots)
        return result

    def _check_untouched(self, launch: _Launch, versions: list[tuple[torch.Tensor, Optional[int]]]) -> None:
        for i, (t, before) in enumerate(versions):
            if before is not None and t._version != before:
                raise EagerDispatchError(
                    f"streamsched eager dispatch: branch '{launch.name}' of {type(self.model).__name__} wrote in "
                    f"place to its tensor argument #{i} ({tuple(t.shape)}, {t.dtype}). A launched branch runs beside "
                    "the code after its call, which may already have read that tensor; write to a copy inside the "
                    "branch (x = x.clone()) or return the new value instead."
                )

    def _check_length(self, launch: _Launch, result: Any) -> None:
        n = launch.expected_len
        if n is not None and not (isinstance(result, tuple) and len(result) == n):
            got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
            raise EagerDispatchError(
                f"streamsched eager dispatch: branch '{launch.name}' of {type(self.model).__name__} is annotated "
                f"to return a tuple of {n} values but returned {got}; its result was unpacked by that promise"
            )

    def _run_inline(self, launch: _Launch, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        launch.kind = "inline"
        return self._run_branch(launch, fn, args, kwargs)

    def _launch_on_lane(self, launch: _Launch, fn: Callable[..., Any], args: tuple, kwargs: dict) -> PendingValue:
        launch.kind = "lane"
        launch.future = concurrent.futures.Future()
        launch.expected_len = _annotated_length(fn)
        lane = _LANES.reserve(self.mode.bound - 1)
        launch.stream = lane
        state = _TorchState()
        handoff = None
        if self.log is not None:
            # A lane's entries must appear in the lane's own order, but this thread logs
            # ahead of the lane: the first job of the call forks the lane (nothing of the
            # call ran there yet); each later job's hand-off is an event recorded here and
            # waited on by the lane when the job starts.
            if lane not in self.forked:
                self.forked.add(lane)
                self.log.fork([lane])
            else:
                handoff = _handoff_event(launch.id)
                self.log.record(0, handoff)
        self.used.add(lane)

        def job() -> None:
            try:
                if handoff is not None:
                    self.log.wait(lane, handoff)
                with contextlib.ExitStack() as stack:
                    state.enter(stack)
                    if self.chaos is not None:
                        self.chaos.delay(lane)
                    result = self._run_branch(launch, fn, args, kwargs)
                    if self.log is not None:
                        self.log.record(lane, launch.id)
            except BaseException as exc:  # noqa: BLE001 - handed to whoever uses the value
                launch.future.set_exception(exc)
            else:
                launch.future.set_result(result)

        _LANES.submit(lane, job)
        return PendingValue(launch)

    def _launch_on_stream(
        self, launch: _Launch, backend: Any, lanes: int, fn: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        if lanes < 1:
            return self._run_inline(launch, fn, args, kwargs)
        launch.kind = "stream"
        launch.backend = backend
        self.stream_lane = self.stream_lane % lanes + 1
        lane = launch.stream = self.stream_lane
        side = backend.stream(lane)
        self.used.add(lane)
        self.backends.setdefault(id(backend), (backend, set()))[1].add(lane)
        backend.fork(side, backend.current())
        if self.log is not None:
            self.log.fork([lane])
        with backend.use(side):
            if self.chaos is not None:
                backend.chaos(self.chaos, lane)
            # Inputs made on the caller's stream: their memory must outlive this stream's reads.
            for t, slot in zip(_tensors((args, kwargs)), launch.input_slots):
                backend.record_stream(t, side)
                if self.log is not None:
                    self.log.record_stream(lane, slot)
            try:
                launch.value = self._run_branch(launch, fn, args, kwargs)
            finally:
                # Recorded also when the branch raised (at once, as in eager): the join and
                # any later wait on this launch then have an event to wait on.
                launch.event = backend.record(side)
            if self.log is not None:
                self.log.record(lane, launch.id)
        return PendingValue(launch)

    # --- consuming ---

    def consume(self, launch: _Launch) -> Any:
        """The launch's result for the current thread and stream, after the waits it needs."""
        if launch.kind == "lane":
            value = launch.future.result()  # the branch's own exception, if it raised
            consumer = _LANES.current_lane()
            key = consumer
        elif launch.kind == "stream":
            backend = launch.backend
            stream = backend.current()
            key = backend.key(stream)
            consumer = backend.lane_of(stream)
            value = launch.value
            if key not in launch.consumers:
                backend.wait(stream, launch.event)
                for t in _tensors(value):
                    backend.record_stream(t, stream)
        else:
            return launch.value
        if key in launch.consumers:
            return value
        with self.lock:
            first = key not in launch.consumers
            launch.consumers.add(key)
            if first and consumer != launch.stream:
                launch.cross_waits += 1
        if first and self.open and self.log is not None and consumer != launch.stream:
            # On a CPU lane the consumer's reference keeps the memory alive; the entry
            # stands for that, as record_stream does on CUDA.
            self.log.wait(consumer, launch.id)
            for slot in launch.write_slots:
                self.log.record_stream(consumer, slot)
            self.log.launch(consumer, -1, launch.write_slots, ())
        return value

    def before_write(self, written: list[torch.Tensor]) -> None:
        """The forward is about to write ``written`` in place: first wait for every
        branch still reading their memory."""
        keys = {k for t in written if (k := _storage_key(t)) is not None}
        if not keys:
            return
        for launch in list(self.launches):
            if launch.kind != "inline" and not launch.settled_for_caller() and launch.reads_storage(keys):
                note = (
                    f"the forward wrote in place to a tensor branch '{launch.name}' (task {launch.id}) was "
                    "reading: it waited for that branch first"
                )
                self.notes[note] = None
                self.consume(launch)

    # --- finishing ---

    def finish(self, output: Any) -> Any:
        """Resolve the pending values in ``output``."""
        return resolve(output)

    def join(self) -> Optional[BaseException]:
        """Wait for every launched branch; the earliest failure in launch order."""
        failure: Optional[BaseException] = None
        for launch in self.launches:
            if launch.kind == "lane":
                exc = launch.future.exception()  # waits
                if exc is not None and failure is None:
                    failure = exc
        for backend, streams in self.backends.values():
            caller = backend.current()
            for lane in sorted(streams):
                backend.join(caller, backend.stream(lane))
        if self.log is not None:
            self.log.join(sorted(self.used))
        return failure

    def log_output(self, output: Any) -> None:
        if self.log is None:
            return
        slots = []
        for t in _tensors(output):
            entry = self.slots.get(id(t))
            if entry is not None and entry[1] is t:
                slots.append(entry[0])
        self.log.output(slots)

    def close(self) -> None:
        self.open = False
        self.slots.clear()


# --- the plan ------------------------------------------------------------------------------


class _TaskRecord(NamedTuple):
    """What the plan needs of one launch (no tensors: a record outlives its call)."""

    id: int
    name: str
    kind: str
    stream: int
    waits: tuple[int, ...]
    producers: tuple[int, ...]
    cost_us: float
    cross_waits: int
    cuda: bool


class _CallRecord(NamedTuple):
    """What the plan needs of one call, taken when the call ends."""

    model: str
    signature: str
    device: str
    reason: str
    mode: _Mode
    notes: tuple[str, ...]
    tasks: tuple[_TaskRecord, ...]

    @classmethod
    def of(
        cls, call: _EagerCall, tensors: list[torch.Tensor], reason: BaseException, device: torch.device
    ) -> _CallRecord:
        first_line = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
        tasks = tuple(
            _TaskRecord(
                launch.id,
                launch.name,
                launch.kind,
                launch.stream,
                tuple(launch.waits),
                tuple(p.id for p in launch.producers),
                launch.cost_us,
                launch.cross_waits,
                launch.kind == "stream" and launch.backend.is_cuda,
            )
            for launch in call.launches
        )
        return cls(
            type(call.model).__name__,
            signature_text(tensors),
            str(device),
            first_line,
            call.mode,
            tuple(call.notes),
            tasks,
        )


class EagerSchedule:
    """What ``StreamScheduledModule.plan`` reports for a call run by eager dispatch.

    Every call makes one; its :class:`~streamsched.plan.Plan` is built when first asked for.
    """

    def __init__(self, record: _CallRecord):
        self._record = record

    @functools.cached_property
    def plan(self) -> Plan:
        return _build_plan(self._record)


def _critical_path(tasks: tuple[_TaskRecord, ...]) -> list[int]:
    best: dict[int, tuple[float, list[int]]] = {}
    for task in tasks:
        before = max((best[p] for p in task.producers if p in best), default=(0.0, []), key=lambda b: b[0])
        best[task.id] = (before[0] + task.cost_us, before[1] + [task.id])
    return max(best.values(), key=lambda b: b[0], default=(0.0, []))[1]


def _executor_name(tasks: tuple[_TaskRecord, ...], cpu_mode: str) -> str:
    if not tasks:
        return {"lanes": "threads", "streams": "streams"}.get(cpu_mode, "serial")
    names = {"lane": "threads", "stream": "streams"}
    return "+".join(sorted({names[t.kind] for t in tasks if t.kind in names})) or "serial"


def _build_plan(record: _CallRecord) -> Plan:
    tasks = record.tasks
    critical = _critical_path(tasks)
    per_stream: dict[int, float] = {}
    for task in tasks:
        per_stream[task.stream] = per_stream.get(task.stream, 0.0) + task.cost_us
    critical_us = sum(tasks[i].cost_us for i in critical)
    notes = [
        "eager dispatch plans describe the most recent call: another call may take another path through the "
        "forward and launch other branches",
        *record.notes,
    ]
    if any(task.cuda for task in tasks):
        notes.append("cost_us of a CUDA branch is the host time to issue it")
    return Plan(
        model=record.model,
        signature=record.signature,
        device=record.device,
        mode="eager-dispatch",
        executor=_executor_name(tasks, record.mode.cpu),
        reason=f"eager dispatch: the model cannot be traced ({record.reason}); {record.mode.why}",
        stream_bound=record.mode.bound,
        num_streams=len({0} | {task.stream for task in tasks}),
        order=[task.id for task in tasks],
        tasks=[
            PlannedTask(
                id=task.id,
                name=task.name,
                nodes=[],
                stream=task.stream,
                waits=list(task.waits),
                records=task.kind != "inline",
                cost_us=round(task.cost_us, 3),
            )
            for task in tasks
        ],
        critical_path=critical,
        critical_path_us=round(critical_us, 3),
        est_serial_us=round(sum(per_stream.values()), 3),
        est_parallel_us=round(max([critical_us, *per_stream.values()], default=0.0), 3),
        cross_stream_waits=sum(task.cross_waits for task in tasks),
        notes=notes,
    )


class _Mode(NamedTuple):
    """How one call runs its branches."""

    cpu: str  # CPU branches: "lanes", "streams" (simulated) or "inline"
    why: str  # the second half of the plan's reason
    bound: int  # streams the call may use, the caller's included
    history: Optional[_AutoHistory] = None  # where executor="auto" records this call's timing


class _AutoHistory:
    """Recent timings of one call structure, for ``executor="auto"`` on CPU.

    Whether CPU lanes pay cannot be told in advance: PyTorch may already spread each
    kernel over every core, and a hand-off costs tens of microseconds. So "auto" measures:
    the first calls run their branches inline and time them (uncontended); if running them
    side by side could save a millisecond, the next calls try lanes; from then on the mode
    whose fastest recent call was faster is used (lanes must win by 10%). The first calls
    of each path through a forward pay for warm-up, so now and then one call re-times the
    mode not in use: a decision taken on cold timings does not stick.
    """

    def __init__(self) -> None:
        self.wall_us: dict[str, collections.deque] = {m: collections.deque(maxlen=4) for m in ("inline", "lanes")}
        self.branch_us: collections.deque = collections.deque(maxlen=4)  # (count, total) of inline calls
        self.settled_calls = 0

    def record(self, mode: str, wall_us: float, launches: list[_Launch]) -> None:
        if not launches:
            return  # nothing ran aside: the mode made no difference
        self.wall_us[mode].append(wall_us)
        if mode == "inline":
            self.branch_us.append((len(launches), sum(launch.cost_us for launch in launches)))

    def decide(self, lanes: int) -> tuple[str, str]:
        """``("inline" | "lanes", why)`` for the next call."""
        inline, launched = self.wall_us["inline"], self.wall_us["lanes"]
        if len(inline) < _MEASURED_CALLS:
            return "inline", "the first calls with this call structure run their branches inline, timed"
        # The cheapest recent call: early calls pay for warm-up, and any call for noise.
        count, total_us = min(self.branch_us, key=lambda b: b[1])
        parallel_us = total_us / max(1, min(lanes, count)) + _HANDOFF_US * count
        if total_us - parallel_us <= _MIN_SAVING_US:
            return "inline", (
                f"CPU lanes would not pay: {count} branch(es) take {total_us:.0f} us in all "
                f"(estimated {parallel_us:.0f} us on {lanes} lane(s), with hand-offs)"
            )
        if len(launched) < _MEASURED_CALLS:
            return "lanes", (
                f"trying {lanes} CPU lane(s): {count} branch(es) take {total_us:.0f} us in all inline "
                f"(estimated {parallel_us:.0f} us side by side)"
            )
        best_inline, best_lanes = min(inline), min(launched)
        timings = f"{best_lanes / 1e3:.2f} ms per call on {lanes} lane(s) vs {best_inline / 1e3:.2f} ms inline"
        mode, why = ("lanes", "faster") if best_lanes < 0.9 * best_inline else ("inline", "no faster")
        self.settled_calls += 1
        if self.settled_calls % _RETIME_EVERY == 0:
            other = "inline" if mode == "lanes" else "lanes"
            return other, f"re-timing {other} (one call in {_RETIME_EVERY}): so far {timings}"
        return mode, f"CPU lanes measured {why}: {timings}"


def _auto_history(sm: Any, spec: Any) -> _AutoHistory:
    per_module = _AUTO.get(sm._ss)
    if per_module is None:
        per_module = _AUTO[sm._ss] = collections.OrderedDict()
    history = per_module.get(spec.key)
    if history is None:
        history = per_module[spec.key] = _AutoHistory()
    per_module.move_to_end(spec.key)
    while len(per_module) > sm.config.plan_cache_size:
        per_module.popitem(last=False)
    return history


def _choose_mode(sm: Any, spec: Any, device: torch.device) -> _Mode:
    config = sm.config
    cuda_bound = _bound(config, "cuda")
    if _LANES.current_lane() != 0:
        return _Mode("inline", "called from inside a launched branch: its own branches run inline there", 1)
    if config.executor == "serial":
        return _Mode("inline", "branches run inline (executor='serial')", 1)
    if device.type == "cuda":
        return _Mode("streams", f"branches issued onto up to {cuda_bound - 1} pool CUDA stream(s)", cuda_bound)
    if config.executor == "streams":
        why = (
            "executor='streams' on CPU: streams are simulated, each branch runs at once in the calling thread while "
            "every synchronisation is still decided and logged"
        )
        return _Mode("streams", why, cuda_bound)
    bound = _bound(config, "cpu")
    lanes = bound - 1
    if lanes < 1:
        return _Mode("inline", "num_streams=1: branches run inline", 1)
    if config.executor == "threads":
        return _Mode("lanes", f"branches launched on {lanes} CPU lane(s) (executor='threads')", bound)
    history = _auto_history(sm, spec)
    mode, why = history.decide(lanes)
    return _Mode(mode, why, bound, history)


# --- entry point ---------------------------------------------------------------------------


def run_eager_dispatch(sm: Any, spec: Any, tensors: list[torch.Tensor], reason: BaseException) -> Any:
    """Run one call of ``sm`` (a ``StreamScheduledModule``) by eager dispatch.

    ``spec`` and ``tensors`` describe the call's arguments as ``CallBinder.bind`` split
    them; ``reason`` is the ``TraceError`` that ruled tracing out. Runs the model's own
    ``forward`` in the calling thread with every ``@streamsched.branch`` call launched
    (see the module docstring), and returns its output with every pending value resolved.
    Every launched branch has finished (CPU) or been joined into the caller's stream
    (CUDA) when this returns or raises; ``sm.plan`` then describes the call.
    """
    st = sm._ss
    leaves: list[Any] = [None] * spec.treedef.num_leaves
    for pos, value in spec.static_leaves:
        leaves[pos] = value
    for pos, value in zip(spec.tensor_positions, tensors):
        leaves[pos] = value
    args, kwargs = st.binder.rebuild(leaves, spec)

    device = next((t.device for t in tensors), torch.device("cpu"))
    mode = _choose_mode(sm, spec, device)
    log: Optional[SyncLog] = None
    if sm.config.sync_log:
        log = SyncLog()
        st.last_sync_log = log
    call = _EagerCall(sm, tensors, device, log, mode)
    if log is not None:
        log.input_slots = call.input_slots
    # Nothing runs beside the forward when every branch runs inline: no writes to guard.
    guard = contextlib.nullcontext() if call.all_inline else _WriteGuard(call)

    model = sm.module
    output: Any = None
    error: Optional[BaseException] = None
    start = time.perf_counter_ns()
    token = _eager_launcher.set(call)
    try:
        with guard:
            output = call.finish(type(model).forward(model, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the join
        error = exc
    finally:
        _eager_launcher.reset(token)
        failure = call.join()
        call.open = False
        if mode.history is not None and error is None and failure is None:
            mode.history.record(mode.cpu, (time.perf_counter_ns() - start) / 1e3, call.launches)
        st.last = EagerSchedule(_CallRecord.of(call, tensors, reason, device))
    try:
        # Eager execution would have stopped at the earliest failing branch, before
        # anything the forward did after it: that is the exception to raise (unless the
        # caller was interrupted).
        if failure is not None and (error is None or isinstance(error, Exception)):
            raise failure
        if error is not None:
            raise error
        call.log_output(output)
        return output
    finally:
        call.close()
