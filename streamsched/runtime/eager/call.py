"""One eager-dispatch call: the branch launcher that runs, launches, consumes and joins
the branch calls made during one forward."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import time
import typing
import weakref
from typing import Any, Callable, Iterator, Optional

import torch

from ... import _generation
from ...errors import ConfigError
from ..chaos import Chaos
from ..synclog import SyncLog
from ..threads import _TorchState
from .errors import EagerDispatchError
from .lanes import _LANES
from .launch import _Launch, _TaskInfo
from .pending import PendingValue, _leaves, _tensors, resolve
from .policy import _bound, _Mode
from .streams import _SIMULATED, _cuda_streams
from .writes import _storage_key, _version


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


_MODULE_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
        elif self.mode.cpu == "lanes" and not _LANES.forked_child:
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
