"""``StreamScheduledModule``: wrap a model, get the same results with its independent
parts run side by side (and its identical parts batched).

The wrapper *shares* the wrapped model's submodules, parameters and buffers (the very
same dicts), so ``state_dict()`` keys, ``named_parameters()`` and optimizers see exactly
what they would see on the model itself; ``.module`` is the model, which stays the owner
of every parameter.

Per input signature (tensor shapes, dtypes, devices; the values of non-tensor
arguments; train/eval; grad mode; autocast) the first call runs the traced graph node by
node (that is the call's result) while recording shapes, then fuses, plans and compiles a
schedule; later calls with that signature run the compiled schedule directly. Plans live
in a bounded LRU cache.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any, Iterator, Optional

import torch
from torch import nn

from . import _generation, _native
from .config import SchedulerConfig, make_config
from .effects import EffectRecorder, Effects, storage_key
from .errors import ConfigError, TraceError, UntraceableWarning
from .meta import run_and_record
from .nodes import node_label
from .plan import Plan
from .planner import Schedule, make_schedule
from .runtime.chaos import Chaos
from .runtime.program import annotate_exception, failing_node
from .runtime.serial import SerialExecutor
from .runtime.streams import CudaBackend, SimulatedBackend, StreamExecutor
from .runtime.synclog import SyncLog
from .runtime.threads import ThreadExecutor
from .trace import CallBinder, Traced, trace_model

__all__ = ["StreamScheduledModule"]

log = logging.getLogger(__name__)


class _LRU(OrderedDict):
    def __init__(self, maxsize: int):
        super().__init__()
        self.maxsize = maxsize

    def get_fresh(self, key: Any) -> Any:
        value = self.get(key)
        if value is not None:
            self.move_to_end(key)
        return value

    def put(self, key: Any, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.maxsize:
            self.popitem(last=False)


class _State:
    """Everything the wrapper caches; kept out of nn.Module's attribute machinery."""

    def __init__(self, model: nn.Module, config: SchedulerConfig):
        self.binder = CallBinder(model)
        self.traces: _LRU = _LRU(config.plan_cache_size)
        self.plans: _LRU = _LRU(config.plan_cache_size)
        self.last: Optional[Schedule] = None
        # (key, schedule) of the most recent traced call: the common case skips the LRU.
        self.hot: Optional[tuple] = None
        self.lock = threading.RLock()
        self.generation = _generation.current()
        self.calls = 0
        self.serial = SerialExecutor()
        self.threads: Optional[ThreadExecutor] = None
        self.streams: dict[str, StreamExecutor] = {}
        self.graphs: dict[str, Any] = {}
        self.last_sync_log: Optional[SyncLog] = None
        self.fusion: Any = None
        # push(task, stream) / pop(task, stream) around every task, or None (free).
        self.observer: Any = None
        self.nvtx: Any = None
        self.profile: Any = None
        # Every module's training flag, interned as a small int for the plan key;
        # recomputed only when the generation moved (``.train()``, ``.eval()``).
        self.modes: dict[tuple, int] = {}
        self.mode_id = self.mode_of(model)
        self.warned_untraceable = False

    def mode_of(self, model: nn.Module) -> int:
        flags = tuple(m.training for m in model.modules())
        mode = self.modes.get(flags)
        if mode is None:
            mode = self.modes[flags] = len(self.modes)
        return mode


class _Trial:
    """Times a plan's executor against serial on its first scheduled calls (``executor="auto"``).

    The estimate decides whether streams (or CPU lanes) should pay; this checks it on the
    real machine: the two executors alternate for ``rounds`` calls each, and the faster
    one (by its best time) stays. Streams are then never kept where they lose.
    """

    def __init__(self, candidate: str, rounds: int = 3):
        self.candidates = [candidate, "serial"]
        self.rounds = rounds
        self.samples: dict[str, list[float]] = {c: [] for c in self.candidates}
        self.turn = 0

    def next(self) -> str:
        name = self.candidates[self.turn % 2]
        self.turn += 1
        return name

    def add(self, name: str, seconds: float) -> None:
        self.samples[name].append(seconds)

    def done(self) -> bool:
        return all(len(v) >= self.rounds for v in self.samples.values())

    def decide(self, plan: Plan) -> Plan:
        best = {name: min(v) * 1e6 for name, v in self.samples.items()}
        candidate = self.candidates[0]
        keep = candidate if best[candidate] < best["serial"] else "serial"
        measured = (
            f"measured {candidate} {best[candidate]:.0f} us vs serial {best['serial']:.0f} us (best of {self.rounds})"
        )
        if keep == candidate:
            return plan.model_copy(update={"reason": f"{plan.reason}; {measured}"})
        return plan.model_copy(
            update={
                "executor": "serial",
                "reason": f"{candidate} estimated to pay but {measured}: running serially",
                "notes": [*plan.notes, "tasks run in issue order on the caller's stream"],
            }
        )


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def _identity(value: Any) -> Any:
    return value


def _alias_pattern(tensors: list[torch.Tensor]) -> tuple:
    """Which inputs share storage: for each input, the index of the first input with its storage."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(t.untyped_storage()._cdata, i) for i, t in enumerate(tensors))


def _autocast_key() -> tuple:
    if _any_autocast is not None and not _any_autocast():
        return ()
    key = []
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            key.append((device, torch.get_autocast_dtype(device)))
    return tuple(key)


class StreamScheduledModule(nn.Module):
    """Run ``model`` with its independent branches on separate streams and its identical
    branches batched, with outputs and gradients equal to ``model``'s own.

    Args:
        model: the ``nn.Module`` to run. It stays the owner of its parameters.
        config: a :class:`~streamsched.SchedulerConfig`; defaults suit most models.
        **overrides: individual config fields (``num_streams=4``, ``executor="streams"``),
            applied on top of ``config``.

    Example::

        >>> import torch, streamsched as ss
        >>> from torch import nn
        >>> class Heads(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.heads = nn.ModuleList(nn.Linear(8, 2) for _ in range(4))
        ...     def forward(self, x):
        ...         return torch.cat([h(x) for h in self.heads], dim=1)
        >>> model = Heads()
        >>> sm = ss.StreamScheduledModule(model)
        >>> x = torch.randn(3, 8)
        >>> torch.allclose(sm(x), model(x), atol=1e-6)
        True
        >>> sm.plan.fused_groups[0].size
        4
    """

    def __init__(self, model: nn.Module, config: Optional[SchedulerConfig] = None, **overrides: Any):
        if isinstance(model, StreamScheduledModule):
            raise ConfigError(
                f"{type(model.module).__name__} is already wrapped in a StreamScheduledModule; "
                "wrap its .module instead (to change options, pass a new config)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"StreamScheduledModule wraps an nn.Module, got {type(model).__name__}")
        name = type(model).__name__
        cfg = make_config(config, overrides, owner=name)
        super().__init__()
        # Share the model's own dicts: same parameters, same names, same state_dict keys.
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["module"] = model
        self.__dict__["config"] = cfg
        self.__dict__["_ss"] = _State(model, cfg)
        self.training = model.training
        from .fusion import FusionContext

        self._ss.fusion = FusionContext(model)

    # --- nn.Module plumbing ---------------------------------------------------------

    def train(self, mode: bool = True) -> StreamScheduledModule:
        self.module.train(mode)
        self.training = mode
        return self

    def _apply(self, fn: Any, recurse: bool = True) -> StreamScheduledModule:
        # Conversions (.to, .half, .cuda) replace parameter storage: plans and stacked
        # parameters built from the old tensors must go.
        self.module._apply(fn, recurse)
        self.invalidate()
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = self.module.load_state_dict(state_dict, strict=strict, assign=assign)
        if assign:
            self.invalidate()
        return result

    def extra_repr(self) -> str:
        changed = {k: getattr(self.config, k) for k in sorted(self.config.model_fields_set)}
        opts = ", ".join(f"{k}={v!r}" for k, v in changed.items())
        return f"model={type(self.module).__name__}" + (f", {opts}" if opts else "")

    def __getstate__(self) -> dict:
        return {"module": self.module, "config": self.config}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["module"], state["config"])

    def __deepcopy__(self, memo: dict) -> StreamScheduledModule:
        return StreamScheduledModule(copy.deepcopy(self.module, memo), self.config)

    # --- public API -------------------------------------------------------------------

    @property
    def plan(self) -> Optional[Plan]:
        """The plan of the most recent call (``None`` before the first call)."""
        last = self._ss.last
        return last.plan if last is not None else None

    @property
    def plans(self) -> list[Plan]:
        """Every cached plan, least recently used first."""
        return [s.plan for s in self._ss.plans.values()]

    @property
    def last_sync_log(self) -> Optional[SyncLog]:
        """The synchronisation log of the last call (with ``sync_log=True``)."""
        return self._ss.last_sync_log

    @contextlib.contextmanager
    def observing(self, observer: Any) -> Iterator[Any]:
        """Call ``observer.push(task, stream)`` and ``observer.pop(task, stream)`` around
        every task of the calls made inside the block (on the task's lane or stream).

        Timelines and profiles use this; the first call with a new input signature runs
        unscheduled (it records shapes), so warm up before observing.
        """
        st = self._ss
        previous = st.observer
        st.observer = observer
        try:
            yield observer
        finally:
            st.observer = previous

    def fused_parameters(self, param_groups: Any = None) -> list:
        """The model's parameters for an optimizer that steps each fused group as one
        stacked tensor: ``torch.optim.SGD(sm.fused_parameters(), lr=...)``. Call the model
        once first (fusion is planned on the first call). See
        :func:`streamsched.optim.fused_parameters`."""
        from .optim import fused_parameters

        return fused_parameters(self, param_groups)

    def invalidate(self) -> None:
        """Drop every cached trace, plan and stacked parameter; the next call re-plans."""
        st = self._ss
        with st.lock:
            st.traces.clear()
            st.plans.clear()
            st.last = None
            st.hot = None
            if st.fusion is not None:
                st.fusion.invalidate()
            for graphs in st.graphs.values():
                graphs.forget()
            st.generation = _generation.current()

    # The schedule is plain Python over generated code; dynamo tracing it only finds graph
    # breaks (and replays the fused-parameter re-pointing as an in-place op). To compile,
    # compile the branches: a torch.compile'd submodule runs as one opaque task.
    @torch.compiler.disable
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._ss
        with st.lock:
            if st.generation != _generation.current():
                self._revalidate()
            try:
                leaves, spec = st.binder.bind(args, kwargs)
            except TypeError as exc:
                raise TypeError(f"{type(self.module).__name__}.forward(): {exc}") from None
            tensors = [leaves[i] for i in spec.tensor_positions]
            key = (
                spec.key,
                tuple((t.shape, t.dtype, t.device, t.requires_grad) for t in tensors),
                st.mode_id,
                torch.is_grad_enabled(),
                _autocast_key(),
            )
            hot = st.hot
            if hot is not None and hot[0] == key:
                # The same signature as the previous call: no LRU bookkeeping.
                schedule = hot[1]
            else:
                schedule = st.plans.get_fresh(key)
            if schedule is not None and schedule.alias_pattern is not None:
                # The plan orders in-place effects for the way its inputs alias each
                # other on the call that made it; other aliasing needs another plan.
                if _alias_pattern(tensors) != schedule.alias_pattern:
                    schedule = None
            st.calls += 1
            if schedule is None:
                return self._first_call(key, spec, tensors)
            st.last = schedule
            st.hot = (key, schedule)
            return schedule.rebuild(self._run(schedule, tensors))

    # --- internals --------------------------------------------------------------------

    def _revalidate(self) -> None:
        """Some module somewhere was re-wired, switched mode or had a flag set: drop traces
        whose modules moved or whose baked-in flags changed the program, and re-key the mode."""
        st = self._ss
        st.mode_id = st.mode_of(self.module)
        st.hot = None
        stale = False
        for traced in list(st.traces.values()):
            if not isinstance(traced, Traced):
                continue
            if not traced.modules_unchanged() or not (traced.flags_unchanged() or self._retraces_same(traced)):
                stale = True
                break
        if stale:
            log.info("streamsched: %s changed after wrapping; re-tracing", type(self.module).__name__)
            self.invalidate()
        elif st.fusion is not None:
            # A parameter may have been re-assigned: re-stack whatever no longer aliases.
            st.fusion.check_all(full=True)
        st.generation = _generation.current()

    def _retraces_same(self, traced: Traced) -> bool:
        """A flag of a traced-through module changed: trace again, and keep the plans
        when the program is the same (the flag was never read by traced code)."""
        try:
            fresh = trace_model(self.module, self._ss.binder, traced.spec, tuple(self.config.leaf_modules))
        except TraceError:
            return False
        if not traced.same_program(fresh):
            return False
        traced.flags = fresh.flags
        return True

    def _trace(self, trace_key: Any, spec: Any) -> Traced:
        st = self._ss
        traced = st.traces.get_fresh(trace_key)
        if traced is None:
            leaf_types = tuple(self.config.leaf_modules)
            traced = trace_model(self.module, st.binder, spec, leaf_types)
            st.traces.put(trace_key, traced)
        return traced

    def _first_call(self, key: Any, spec: Any, tensors: list[torch.Tensor]) -> Any:
        st = self._ss
        # A trace bakes in the training flags of the modules it traced through.
        trace_key = (spec.key, st.mode_id)
        if not self.config.strict and isinstance(st.traces.get_fresh(trace_key), TraceError):
            return self._eager_dispatch(spec, tensors, st.traces[trace_key])
        try:
            traced = self._trace(trace_key, spec)
        except TraceError as exc:
            if self.config.strict:
                raise
            # Remember that this call structure cannot be traced: later calls go
            # straight to eager dispatch instead of failing to trace again.
            st.traces.put(trace_key, exc)
            # Said once, and only to users who did not ask for this with strict=False.
            if not st.warned_untraceable and "strict" not in self.config.model_fields_set:
                st.warned_untraceable = True
                warnings.warn(
                    f"{exc}\n[streamsched] {type(self.module).__name__} runs its own forward (eager dispatch: only "
                    "@streamsched.branch calls are scheduled); pass strict=True to raise this error instead.",
                    UntraceableWarning,
                    stacklevel=3,
                )
            return self._eager_dispatch(spec, tensors, exc)
        metas: dict = {}
        name = type(self.module).__name__

        def on_error(exc: BaseException, node: Any) -> None:
            annotate_exception(exc, f"module '{node_label(node)}' of {name}")

        recorder = EffectRecorder()
        with recorder:
            result = run_and_record(traced.graph, traced.root, tensors, on_error, metas, recorder)
        effects = Effects.from_accesses(recorder.accesses, frozenset(storage_key(t) for t in tensors), traced.graph)
        del recorder
        rebuild = traced.output_tree.rebuilder() if traced.output_tree is not None else _identity
        measured = self._measured_costs(tensors)
        schedule = make_schedule(
            traced, metas, self.config, tensors, fusion=st.fusion, measured=measured, effects=effects
        )
        schedule.rebuild = rebuild
        if effects.writes_inputs:
            schedule.alias_pattern = _alias_pattern(tensors)
        if measured:
            schedule.plan = schedule.plan.model_copy(
                update={"notes": [*schedule.plan.notes, f"task costs measured: profile {self.config.profile}"]}
            )
        if self.config.executor == "auto" and schedule.plan.executor != "serial":
            schedule.trial = _Trial(schedule.plan.executor)
        st.plans.put(key, schedule)
        st.last = schedule
        return rebuild(result)

    def _eager_dispatch(self, spec: Any, tensors: list[torch.Tensor], reason: TraceError) -> Any:
        from .runtime.eager import run_eager_dispatch

        return run_eager_dispatch(self, spec, tensors, reason)

    def _run_trial(self, schedule: Schedule, trial: _Trial, tensors: list[torch.Tensor]) -> Any:
        name = trial.next()
        executor = self._ss.serial if name == "serial" else self._executor(schedule)
        cuda = schedule.plan.device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize(schedule.plan.device)
        start = time.perf_counter()
        try:
            out = executor.run(schedule.program, tensors)
        except Exception as exc:
            where = failing_node(schedule.program, exc)
            if where is not None:
                annotate_exception(exc, f"module '{where}' of {type(self.module).__name__}")
            raise
        if cuda:
            torch.cuda.synchronize(schedule.plan.device)
        trial.add(name, time.perf_counter() - start)
        if trial.done():
            schedule.plan = trial.decide(schedule.plan)
            schedule.trial = None
        return out

    def _measured_costs(self, tensors: list[torch.Tensor]) -> Optional[dict[str, float]]:
        """Task costs from ``config.profile`` (checked against this model, input and device)."""
        if self.config.profile is None:
            return None
        from .errors import ProfileMismatchError
        from .planner import _device_of, signature_text
        from .profiles import check_profile, load_profile, profile_costs

        st = self._ss
        if st.profile is None:
            st.profile = load_profile(self.config.profile)
        device = _device_of(tensors, self.module)
        try:
            check_profile(st.profile, type(self.module).__name__, signature_text(tensors), str(device))
        except ProfileMismatchError as exc:
            raise ProfileMismatchError(f"{exc} (profile {self.config.profile})") from None
        return profile_costs(st.profile)

    def _executor(self, schedule: Schedule) -> Any:
        st = self._ss
        name = schedule.plan.executor
        if name == "serial":
            return st.serial
        if name == "threads":
            if st.threads is None:
                st.threads = ThreadExecutor()
            return st.threads
        device = schedule.plan.device
        executor = st.streams.get(device)
        if executor is None:
            dev = torch.device(device)
            backend = CudaBackend(dev) if dev.type == "cuda" else SimulatedBackend()
            executor = StreamExecutor(backend, native=_native.native())
            st.streams[device] = executor
        return executor

    def _nvtx(self, schedule: Schedule) -> Any:
        """The NVTX range observer, on CUDA plans, while a tool is there to see the ranges
        (Nsight Systems attached, or the torch profiler recording): free otherwise."""
        if not self.config.nvtx or not schedule.plan.device.startswith("cuda"):
            return None
        st = self._ss
        if st.nvtx is None:
            from .observe.nvtx_ranges import NvtxRanges

            st.nvtx = NvtxRanges.create() or False
        if st.nvtx and st.nvtx.wanted():
            return st.nvtx
        return None

    def _graph_executor(self, schedule: Schedule, tensors: list[torch.Tensor]) -> Any:
        """The CUDA-graph executor for this call, or None when graphs do not apply."""
        cfg = self.config
        if cfg.cuda_graph is False or not schedule.plan.device.startswith("cuda"):
            return None
        from .runtime.graphs import GraphExecutor

        if not GraphExecutor.captures(tensors):
            return None
        st = self._ss
        device = schedule.plan.device
        graphs = st.graphs.get(device)
        if graphs is None:
            streams = st.streams.get(device)
            if streams is None:
                streams = StreamExecutor(CudaBackend(torch.device(device)), native=_native.native())
                st.streams[device] = streams
            graphs = GraphExecutor(
                streams, self.module, cfg.graph_cache_size, cfg.clone_outputs, strict=cfg.cuda_graph is True
            )
            st.graphs[device] = graphs
        return graphs

    def _run(self, schedule: Schedule, tensors: list[torch.Tensor]) -> Any:
        st = self._ss
        cfg = self.config
        sync_log = None
        if cfg.sync_log:
            sync_log = SyncLog()
            program = schedule.program
            sync_log.input_slots = (
                tuple(program.input_slots) + tuple(s for s, _ in program.attr_slots) + program.location_slots
            )
            sync_log.expected_writers = program.expected_writers
            st.last_sync_log = sync_log
        chaos = Chaos(cfg.chaos, st.calls) if cfg.chaos is not None else None
        for stack in schedule.stacks:
            stack.check()
        trial = schedule.trial
        if trial is not None and sync_log is None and chaos is None and st.observer is None:
            return self._run_trial(schedule, trial, tensors)
        graphs = self._graph_executor(schedule, tensors)
        executor = graphs if graphs is not None else self._executor(schedule)
        try:
            if graphs is not None:
                return graphs.run(schedule.program, tensors, sync_log, chaos, st.observer, schedule.stacks)
            return executor.run(schedule.program, tensors, sync_log, chaos, st.observer or self._nvtx(schedule))
        except Exception as exc:
            where = failing_node(schedule.program, exc)
            if where is not None:
                annotate_exception(exc, f"module '{where}' of {type(self.module).__name__}")
            raise
