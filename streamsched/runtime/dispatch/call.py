"""One eager-dispatch call: the branch launcher installed for one forward.

:class:`_EagerCall` routes each ``@streamsched.branch`` call made during the forward
(inline, onto a CPU lane, onto a stream), gives a pending value's user the result after
the waits it needs, waits before the forward writes what a running branch reads, and at
the end joins every launch and takes the call's record. The work itself is done by
:class:`~.calllog._CallLog` (ids and SyncLog entries), :class:`~.body._BranchRunner`
(a branch's body and its checks), :class:`~.launchers._LaneLauncher` and
:class:`~.launchers._StreamLauncher`.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Optional

import torch

from ... import _generation
from ...errors import ConfigError
from ..chaos import Chaos
from ..synclog import SyncLog
from ..threads import lanes_refused
from .body import _BranchRunner
from .calllog import _CallLog
from .dispatch_context import DispatchContext
from .lane_pool import _LANES
from .launch import _Launch
from .launchers import _LaneLauncher, _StreamLauncher
from .pending import PendingValue, resolve
from .policy import _bound, _Mode
from .reported_plan import _CallRecord
from .stream_backends import _SIMULATED, _cuda_streams
from .values import _leaves, _storage_key
from .writes import _WriteGuard

# The function mode eager dispatch runs the forward under: it need not follow a branch.
_OWN_MODES = (_WriteGuard,)

_MODULE_PATHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _module_paths(model: torch.nn.Module) -> dict[int, str]:
    cached = _MODULE_PATHS.get(model)
    if cached is None or cached[0] != _generation.current():
        cached = (_generation.current(), {id(m): path for path, m in model.named_modules()})
        _MODULE_PATHS[model] = cached
    return cached[1]


def _task_name(model: torch.nn.Module, fn: Callable[..., Any], args: tuple) -> str:
    """A branch's name in the plan: ``<module path>.<method>`` for a method of a submodule."""
    if args and isinstance(args[0], torch.nn.Module):
        owner = args[0]
        path = _module_paths(model).get(id(owner))
        if path is None:
            return f"{type(owner).__name__}.{fn.__name__}"
        return f"{path}.{fn.__name__}" if path else fn.__name__
    return getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))


def _device(plain: list[torch.Tensor], producers: list[_Launch], args: tuple) -> torch.device:
    """Where a branch runs: its first CUDA tensor argument's device, else a CUDA producer's,
    else (no tensors at all) the device of the module it is a method of."""
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


class _EagerCall:
    """The state of one eager-dispatch call; installed as the branch launcher."""

    def __init__(
        self,
        context: DispatchContext,
        tensors: list[torch.Tensor],
        device: torch.device,
        log: Optional[SyncLog],
        mode: _Mode,
    ):
        self.model = context.model
        self.config = context.config
        self.mode = mode
        # Nothing to decide, log or guard per launch: every branch of the call runs inline
        # (a call whose inputs are on the CPU runs even a branch that moves to CUDA inline).
        self.all_inline = mode.cpu == "inline" and log is None and device.type != "cuda"
        chaos = Chaos(self.config.chaos, context.call_number) if self.config.chaos is not None else None
        self.log = _CallLog(log)
        self.launches: list[_Launch] = []
        self.lock = threading.Lock()
        self.open = True
        self.notes: dict[str, None] = {}  # an ordered set
        self.input_slots = tuple(sorted({self.log.slot(t)[0] for t in tensors}))
        self.runner = _BranchRunner(type(self.model).__name__, context.observer, self.log)
        self.lanes = _LaneLauncher(self.runner, self.log, chaos, mode.bound - 1)
        self.streams = _StreamLauncher(self.runner, self.log, chaos)

    # --- launching ---

    def __call__(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        launch = _Launch(self, len(self.launches), _task_name(self.model, fn, args), "inline")
        if self.all_inline:
            self.launches.append(launch)
            return self.runner.run(launch, fn, args, kwargs)
        leaves = _leaves((args, kwargs))
        plain = [v for v in leaves if isinstance(v, torch.Tensor)]
        # Pending values of an earlier call (kept by the model) are finished: no producers.
        roots = (v._ss_root() for v in leaves if type(v) is PendingValue)
        launch.producers = list({id(p): p for p in roots if p.call is self}.values())
        device = _device(plain, launch.producers, args)
        if device.type == "cuda" and self.config.executor == "threads":
            raise ConfigError(
                f"executor='threads' runs CPU tensors, but branch '{launch.name}' of "
                f"{type(self.model).__name__} reads tensors on {device}; use executor='streams' (or 'auto') for CUDA"
            )
        launch.input_slots = self.log.caller_values(plain)
        launch.input_keys = {k for t in plain if (k := _storage_key(t)) is not None}
        self.launches.append(launch)
        if device.type == "cuda" and self.config.executor != "serial" and torch.cuda.is_available():
            lanes = _bound(self.config, "cuda") - 1
            if lanes >= 1:
                return self.streams.launch(launch, _cuda_streams(device), lanes, fn, args, kwargs)
        elif self.mode.cpu == "lanes" and not _LANES.forked_child and not lanes_refused(_OWN_MODES):
            return self.lanes.launch(launch, fn, args, kwargs)
        elif self.mode.cpu == "streams" and self.mode.bound > 1:
            return self.streams.launch(launch, _SIMULATED, self.mode.bound - 1, fn, args, kwargs)
        return self.runner.run(launch, fn, args, kwargs)  # inline

    # --- consuming ---

    def consume(self, launch: _Launch) -> Any:
        """The launch's result for the current thread and stream, after the waits it needs."""
        if launch.kind == "lane":
            value, consumer, key = _LaneLauncher.receive(launch)
        elif launch.kind == "stream":
            value, consumer, key = _StreamLauncher.receive(launch)
        else:
            return launch.value
        if key in launch.consumers:
            return value
        with self.lock:
            first = key not in launch.consumers
            launch.consumers.add(key)
            if first and consumer != launch.stream:
                launch.cross_waits += 1
        if first and self.open and self.log.sync is not None and consumer != launch.stream:
            self.log.consumed(consumer, launch)
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
        """Wait for every launched branch (CPU) or join it into the caller's stream (CUDA);
        the earliest failure of a lane in launch order (a branch on a stream or inline
        raised at once)."""
        failure = self.lanes.join()
        self.streams.join()
        if self.log.sync is not None:
            self.log.sync.join(sorted(self.lanes.used | self.streams.used))
        return failure

    def record(self, tensors: list[torch.Tensor], reason: BaseException, device: torch.device) -> _CallRecord:
        """What the plan needs of the call, taken when it ends."""
        return _CallRecord.of(self.model, self.launches, self.mode, self.notes, tensors, reason, device)

    def log_output(self, output: Any) -> None:
        self.log.output(output)

    def close(self) -> None:
        self.open = False
        self.log.close()
