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
import inspect
import itertools
import logging
import threading
import time
import warnings
import weakref
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.nn.modules import module as _nn_module
from typing_extensions import Unpack

from . import _generation, _native
from ._lru import LRU
from .backward_timing import BackwardSample
from .config import SchedulerConfig, SchedulerOptions, make_config
from .errors import (
    ConfigError,
    HooksWarning,
    ProfileMismatchError,
    TraceError,
    UntraceableWarning,
    raised_in,
    user_stacklevel,
)
from .frontend.binder import CallBinder, ShapeCachedBinder
from .frontend.effects import EffectRecorder, Effects
from .frontend.hooks import global_hooks, has_hooks
from .frontend.leafcalls import counting_dispatch
from .frontend.meta import run_and_record
from .frontend.nodes import node_label
from .frontend.trace import Traced, dtype_probes, dtypes_same, is_compiled_module, trace_model
from .frontend.trace_guard import autocast_state
from .nesting import NestedPlans
from .observe.nvtx_ranges import NvtxRanges
from .observe.schedule_profiles import check_profile, load_profile, profile_costs
from .optim import fused_parameters
from .passes.fusion import FusionContext
from .planning.choice import Trial
from .planning.plan import Plan
from .planning.planner import Schedule, device_of, make_schedule, signature_text
from .planning.signatures import RARE_CALLS, Decision, Structure, sizes_text
from .runtime import dispatch as eager_dispatch
from .runtime.chaos import Chaos
from .runtime.graphs import GraphExecutor
from .runtime.pool import ExecutorPool
from .runtime.program import Program, ProgramCache, annotate_exception, compile_program, failing_node
from .runtime.synclog import SyncLog
from .settled_calls import SettledCalls, settles, shapes_of

__all__ = ["StreamScheduledModule"]

_module_call = nn.Module.__call__
_is_compiling = torch.compiler.is_compiling
_tracing_state = torch._C._get_tracing_state

log = logging.getLogger(__name__)


# Eager-dispatch calls in a row that launch no branch before a call structure runs as written.
_QUIET_CALLS = 3

# How much faster than the model as written a plan with nothing to run side by side or
# batch must be to be kept (planning.signatures: decided once for every size).
_UNIFORM_SCHEDULE_MARGIN = 0.05

# Calls of any wrapper that were not yet its settled way of running: first calls of a
# signature (trace, record, plan) and trial calls. A trial call of a plan during which
# another one ran (a nested child planning or trying itself) is no measure of the plan.
_unsettled_calls = 0


class _AsWritten:
    """What ``sm.plan`` reports for a call that ran the model as written: a plan, or how
    to make one when asked (these calls are the cheap path: no pydantic model per call)."""

    __slots__ = ("_plan", "_make", "nests", "every_size")

    # Read by the call path like a compiled signature's: it runs the model as written.
    as_written = True
    alias_pattern = None
    trial = None

    def __init__(self, plan: Optional[Plan] = None, make: Any = None, nests: bool = False):
        self._plan = plan
        self._make = make
        # Whether its calls nest the forward's children (nesting.py): a forward run as
        # written because an argument is an object.
        self.nests = nests
        # Whether its call structure runs as written at every size (settled_calls.py).
        self.every_size = False

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = self._make()
            self._make = None
        return self._plan


class _Compiled:
    """One input signature as the wrapper runs it: the planner's schedule, the program
    the runtime compiled from it, and how calls with the signature run."""

    __slots__ = (
        "schedule",
        "program",
        "plan",
        "trial",
        "as_written",
        "rebuild",
        "alias_pattern",
        "structure",
        "sizes",
        "nested_sites",
        "direct",
    )

    # Its calls run as written (``as_written``) without nesting the forward's children; the
    # shortcut for structures run as written at every size starts from an _AsWritten.
    nests = False
    every_size = False

    def __init__(self, schedule: Schedule, program: Program, rebuild: Any):
        self.schedule = schedule
        self.program = program
        # The plan; the ``auto`` trial adds its decision to it.
        self.plan: Plan = schedule.plan
        # With executor="auto": the timing of this plan's executor against serial and
        # the model's own forward, until decided.
        self.trial: Optional[Trial] = None
        # Decided by the trial: calls with this signature run the model's own forward.
        self.as_written = False
        # Builds the model's own output (its container types) from the program's leaves.
        self.rebuild = rebuild
        # Where the graph writes in place: how the inputs shared storage on the planning
        # call (the effect edges hold for that aliasing only).
        self.alias_pattern: Optional[tuple] = None
        # The call structure this signature belongs to, and its sizes: the trial's
        # decision is kept there for the sizes' bucket.
        self.structure: Optional[Structure] = None
        self.sizes: tuple = ()
        # The plan's opaque module calls that are nested (nesting.py): their forwards run
        # as written inside their tasks, and their children get plans of their own.
        self.nested_sites: list = []
        # (plan, function): how _run calls the plan while it is this plan (_direct).
        self.direct: Optional[tuple] = None

    @property
    def graph(self) -> Any:
        return self.schedule.graph

    @property
    def tasks(self) -> Any:
        return self.schedule.tasks


class _State:
    """Everything the wrapper caches; kept out of nn.Module's attribute machinery."""

    def __init__(self, model: nn.Module, config: SchedulerConfig):
        self.binder = CallBinder(model)
        self.bind = ShapeCachedBinder(self.binder).bind
        # Calls of plain tensors only, as many as ``forward`` has parameters (none with a
        # default): their spec, once one such call was bound (the same for all of them).
        self.tensors_arity: Optional[int] = self.binder._simple_arity
        self.tensors_spec: Any = None
        # What eager dispatch reads of the model, and keeps between its calls.
        self.dispatch = eager_dispatch.DispatchContext.for_model(model, config, self.binder, self._nested_site)
        self.traces: LRU = LRU(config.plan_cache_size)
        # Per traced graph: its latest plan's program, for its plans at other sizes that
        # compile to the same code (runtime.program.ProgramCache).
        self.programs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Eager dispatch, per call structure: calls in a row that launched no branch, or
        # an _AsWritten once there were enough of them.
        self.quiet: LRU = LRU(config.plan_cache_size)
        self.plans: LRU = LRU(config.plan_cache_size)
        # Signatures settled to run the model as written (a size bucket the trial decided
        # for it, churn, an object argument): _AsWritten records, so that their calls
        # skip the size policy. Small entries (sizes, no tensors), so many of them.
        self.written: LRU = LRU(max(256, 16 * config.plan_cache_size))
        # Per call structure (a signature without its sizes): which new sizes get a plan.
        self.structures: LRU = LRU(max(16, config.plan_cache_size))
        self.last: Any = None  # what sm.plan reports: a _Compiled, or an eager-dispatch record
        # Which way the most recent call ran (``streamsched.testing.last_path``): "recorded",
        # "plan:<executor>", "graph", "as-written" or "eager-dispatch".
        self.last_path = ""
        # (key, schedule) of the most recent traced call: the common case skips the LRU.
        self.hot: Optional[tuple] = None
        # Calls settled to run as written whatever their sizes (passing an object, or of
        # a structure run as written at every size): their layout, checked before
        # anything else (settled_calls.py).
        self.settled: Optional[SettledCalls] = None
        self.lock = threading.RLock()
        self.generation = _generation.current()
        # The model's first parameter (or buffer) and its (dtype, device) when traces were
        # made: ``model.to(...)``, ``.half()``, ``.cuda()`` on the model itself (not the
        # wrapper) moves no generation, and traced code may have read them as constants
        # (transformers' ``self.device`` and ``self.dtype``).
        self.probe, self.probed = _placement_probe(model)
        # Traces that relied on the dtypes of parameters (``Traced.dtypes_hold``), and
        # those parameters (``trace.dtype_probes``), compared every call: a submodule
        # cast on its own moves neither the probe nor a generation.
        self.dtype_guarded: list[Traced] = []
        self.dtype_probes: tuple = ()
        self.hook_registrations = _generation.hook_registrations()
        self.calls = 0
        self.executors = ExecutorPool(_native.native())
        self.graphs = self.executors.graphs
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
        # How errors name a module: (path prefix, model name); a nested child's wrapper
        # names its modules by their paths in the outermost model.
        self.where = ("", type(model).__name__)
        self.warned_hooks = False
        # An untraceable forward's children, scheduled by plans of their own (nesting.py).
        self.nested: Optional[NestedPlans] = None

    def _nested_site(self) -> Optional[str]:
        return self.nested.current_path() if self.nested is not None else None

    def mode_of(self, model: nn.Module) -> int:
        flags = tuple(m.training for m in model.modules())
        mode = self.modes.get(flags)
        if mode is None:
            mode = self.modes[flags] = len(self.modes)
        return mode


class _AttachedForward:
    """The ``forward`` an attached model gets (``StreamScheduledModule.attach``)."""

    __slots__ = ("wrapper", "_signature")

    def __init__(self, wrapper: StreamScheduledModule):
        self.wrapper = wrapper
        self._signature: Optional[inspect.Signature] = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.wrapper._entry(args, kwargs, True)

    @property
    def __signature__(self) -> inspect.Signature:
        # Libraries read forward's parameters (transformers filters generate's keyword
        # arguments by them): the class's forward's, bound to the model.
        # (``generate`` asks on every step: computed once, the class's forward is fixed.)
        if self._signature is None:
            model = self.wrapper.module
            self._signature = inspect.signature(type(model).forward.__get__(model))
        return self._signature

    def __reduce__(self) -> Any:
        raise TypeError(
            "a model attached to a StreamScheduledModule cannot be pickled or copied: call sm.detach() first"
        )


def _placement_probe(model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[tuple]]:
    """The model's first parameter (else buffer) and its (dtype, device) now."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor, (tensor.dtype, tensor.device)
    return None, None


def _identity(value: Any) -> Any:
    return value


_Tensor = torch.Tensor


def _all_plain_tensors(args: tuple) -> bool:
    """Whether every argument is a ``torch.Tensor`` itself (no subclass, no other value)."""
    for a in args:
        if type(a) is not _Tensor:
            return False
    return True


def _alias_pattern(tensors: list[torch.Tensor]) -> tuple:
    """Which inputs share storage: for each input, the index of the first input with its storage."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(t.untyped_storage()._cdata, i) for i, t in enumerate(tensors))


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

    def __init__(
        self, model: nn.Module, config: Optional[SchedulerConfig] = None, **overrides: Unpack[SchedulerOptions]
    ):
        if isinstance(model, StreamScheduledModule):
            raise ConfigError(
                f"{type(model.module).__name__} is already wrapped in a StreamScheduledModule; "
                "wrap its .module instead (to change options, pass a new config)"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(f"StreamScheduledModule wraps an nn.Module, got {type(model).__name__}")
        if is_compiled_module(model):
            # Its forward is dynamo's compiled code: fx cannot trace it, and run as one call
            # it would leave nothing to schedule.
            raise ConfigError(
                f"StreamScheduledModule cannot wrap a torch.compile'd module ({type(model._orig_mod).__name__} in an "
                "OptimizedModule): wrap the model itself and compile the wrapper, "
                "torch.compile(StreamScheduledModule(model)), or compile its branches "
                "(model.towers[i] = torch.compile(tower)) and wrap the model "
                "(its ._orig_mod is the module you compiled)"
            )
        name = type(model).__name__
        cfg = make_config(config, overrides, owner=name)
        super().__init__()
        # Share the model's own dicts: same parameters, same names, same state_dict keys.
        self.__dict__["_modules"] = model._modules
        self.__dict__["_parameters"] = model._parameters
        self.__dict__["_buffers"] = model._buffers
        self.__dict__["module"] = model
        # Re-wiring the model (or the wrapper, which holds the same dicts) moves the
        # generation the wrapper checks on every call; other modules' registrations do not.
        _generation.track(model)
        _generation.track(self)
        self.__dict__["config"] = cfg
        self.__dict__["_ss"] = _State(model, cfg)
        self.training = model.training
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
        st = self._ss
        last = st.last
        if last is None:
            return None
        plan = last.plan
        if plan.nested_leaf_calls and st.nested is not None and (plan.mode != "traced" or plan.executor != "eager"):
            # Nested children ran (their calls were counted as the parent's own, as
            # written): the share their plans schedule.
            plan = plan.model_copy(update={"nested_in_tasks": st.nested.scheduled_calls(plan.nested_leaf_calls)})
        return plan

    @property
    def plans(self) -> list[Plan]:
        """Every cached plan, least recently used first."""
        return [s.plan for s in self._ss.plans.values()]

    @property
    def nested_plans(self) -> dict[str, Plan]:
        """Where the model's forward cannot be traced and runs as written, the plan of
        each child module scheduled on its own (and of theirs), by module path: the most
        recent call's. Empty for a traced model (its plan covers every submodule)::

            >>> sm(x)                                   # doctest: +SKIP
            >>> sm.plan.mode, list(sm.nested_plans)     # doctest: +SKIP
            ('eager-dispatch', ['model.layers.0', 'model.layers.1'])
        """
        nested = self._ss.nested
        return nested.plans() if nested is not None else {}

    @property
    def last_sync_log(self) -> Optional[SyncLog]:
        """The synchronisation log of the last call (with ``sync_log=True``)."""
        return self._ss.last_sync_log

    @contextlib.contextmanager
    def observing(self, observer: Any) -> Iterator[Any]:
        """Call ``observer.push(task, stream)`` and ``observer.pop(task, stream)`` around
        every task of the calls made inside the block (on the task's lane or stream), and,
        if the observer has one, ``observer.ran(schedule)`` with what the most recent call
        ran on entering the block and after each call in it (``schedule.plan``; for a
        traced model also ``.program`` and ``.tasks``).

        Timelines and profiles use this; the first call with a new input signature runs
        unscheduled (it records shapes), so warm up before observing.
        """
        st = self._ss
        ran = getattr(observer, "ran", None)
        if ran is not None and st.last is not None:
            ran(st.last)  # what the most recent call ran, before any observed call
        previous = st.observer
        st.observer = observer
        st.hot = None  # observed calls run schedules: no as-written shortcut
        st.settled = None
        try:
            yield observer
        finally:
            st.observer = previous
            st.hot = None

    def attach(self) -> nn.Module:
        """Route the model's own calls through the wrapper, and return the model.

        After ``sm.attach()``, ``model(x)`` and every method of the model that calls
        ``self(...)`` or ``self.forward(...)`` run their forwards through the wrapper:
        the one line a Hugging Face user needs for ``generate``::

            >>> sm = ss.StreamScheduledModule(model)        # doctest: +SKIP
            >>> sm.attach().generate(ids, max_new_tokens=20)  # doctest: +SKIP

        The model's own hooks fire around each call as in eager. The model gets an
        instance attribute ``forward`` (its class is unchanged); :meth:`detach` removes
        it, and :meth:`detached` removes it for a block. An attached model cannot be
        pickled or deep-copied (detach it first): the copy would call this wrapper.
        """
        model = self.module
        current = model.__dict__.get("forward")
        if isinstance(current, _AttachedForward) and current.wrapper is not self:
            raise ConfigError(f"{type(model).__name__} is attached to another StreamScheduledModule; detach it first")
        if current is not None and not isinstance(current, _AttachedForward):
            raise ConfigError(
                f"{type(model).__name__} has an instance attribute 'forward' of its own; attach() would replace it"
            )
        model.__dict__["forward"] = _AttachedForward(self)
        return model

    def detach(self) -> nn.Module:
        """Undo :meth:`attach`: the model's calls run its class's forward again."""
        model = self.module
        current = model.__dict__.get("forward")
        if isinstance(current, _AttachedForward) and current.wrapper is self:
            del model.__dict__["forward"]
        return model

    @contextlib.contextmanager
    def detached(self) -> Iterator[nn.Module]:
        """A block in which an attached model runs as written (for comparing with eager)."""
        attached = isinstance(self.module.__dict__.get("forward"), _AttachedForward)
        self.detach()
        try:
            yield self.module
        finally:
            if attached:
                self.attach()

    def fused_parameters(self, param_groups: Any = None) -> list:
        """The model's parameters for an optimizer that steps each fused group as one
        stacked tensor: ``torch.optim.SGD(sm.fused_parameters(), lr=...)``. Call the model
        once first (fusion is planned on the first call). See
        :func:`streamsched.optim.fused_parameters`."""
        return fused_parameters(self, param_groups)

    def invalidate(self) -> None:
        """Drop every cached trace, plan and stacked parameter; the next call re-plans."""
        st = self._ss
        with st.lock:
            st.traces.clear()
            st.programs.clear()
            st.quiet.clear()
            st.plans.clear()
            st.written.clear()
            st.structures.clear()
            st.last = None
            st.hot = None
            st.settled = None
            if st.fusion is not None:
                st.fusion.invalidate()
            st.executors.forget_graphs()
            if st.nested is not None:
                st.nested.invalidate()
            st.generation = _generation.current()
            st.probe, st.probed = _placement_probe(self.module)
            st.dtype_guarded = []
            st.dtype_probes = ()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module.__call__ with no hook of the wrapper's own, none global, no jit trace
        # and no compiled call only calls forward: the wrapper goes straight to its entry.
        # Anything else takes nn.Module's own __call__, which fires the hooks around it.
        # (The global hooks are read here, not through frontend.hooks.global_hooks, and the
        # settled call is _settled_call written out: a settled call's whole budget is the
        # microsecond nn.Module.__call__ costs eager, and each frame is a tenth of it.)
        if (
            not _is_compiling()
            and self._compiled_call_impl is None
            and not (
                self._forward_hooks
                or self._forward_pre_hooks
                or self._backward_hooks
                or self._backward_pre_hooks
                or _nn_module._global_forward_hooks
                or _nn_module._global_forward_pre_hooks
                or _nn_module._global_backward_hooks
                or _nn_module._global_backward_pre_hooks
            )
            and self._plain_forward
            and "forward" not in self.__dict__
            and not _tracing_state()
        ):
            st = self._ss
            settled = st.settled
            if (
                settled is not None
                and settled.generation == _generation._generation
                and settled.admits(args, kwargs, settled.sizes)
            ):
                settled.left -= 1
                if settled.left <= 0:
                    st.settled = None  # the nested children's retry is due next call
                st.calls += 1
                nested = settled.nested
                if nested is not None:
                    nested.calls += 1  # counted as NestedPlans.all_quiet counts a call
                sizes = settled.sizes
                st.last = settled.schedule if sizes is None else sizes[shapes_of(args, kwargs)]
                st.last_path = "as-written"
                module = self.module
                try:
                    return type(module).forward(module, *args, **kwargs)
                except Exception as exc:
                    self._annotate(exc)
                    raise
            return self._entry(args, kwargs, False)
        return _module_call(self, *args, **kwargs)

    # Whether this class's forward is the wrapper's own (a subclass may override it; then
    # every call goes through nn.Module.__call__, which calls that forward).
    _plain_forward = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain_forward = cls.forward is StreamScheduledModule.forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._entry_uncompiled(args, kwargs)
        return self._entry(args, kwargs, False)

    # The schedule is plain Python over generated code; dynamo tracing it only finds graph
    # breaks (and replays the fused-parameter re-pointing as an in-place op). To compile,
    # compile the branches: a torch.compile'd submodule runs as one opaque task. (Only
    # this path is excluded from dynamo: the exclusion wrapper costs microseconds on every
    # call, and ``forward`` reaches here only while dynamo traces it.)
    @torch.compiler.disable
    def _entry_uncompiled(self, args: tuple, kwargs: dict) -> Any:
        return self._entry(args, kwargs, False)

    def _entry(self, args: tuple, kwargs: dict, inside_model_call: bool) -> Any:
        st = self._ss
        settled = st.settled
        if (
            inside_model_call
            and settled is not None
            and settled.generation == _generation._generation
            and settled.admits(args, kwargs, settled.sizes)
        ):
            return self._settled_call(settled, args, kwargs)
        with st.lock:
            try:
                if st.observer is None:
                    return self._call(args, kwargs, inside_model_call)
                out = self._call(args, kwargs, inside_model_call)
            except Exception as exc:
                # A plan names the node that raised; a call that ran the model's own
                # forward (as written, eager dispatch) names the submodule here.
                self._annotate(exc)
                raise
            # Observers that ask are told which schedule the call ran (timelines read its
            # program and task graph): the wrapper hands it over, nobody reaches in.
            ran = getattr(st.observer, "ran", None)
            if ran is not None:
                ran(st.last)
            return out

    def _settle_as_written(self, args: tuple, kwargs: dict, schedule: Any) -> None:
        """A call of tensors and plain values settled to run as written (``schedule``): at
        every size of its structure, or at its sizes. Later calls of its layout (at those
        sizes) skip binding and keys (settled_calls.py)."""
        st = self._ss
        if st.observer is not None or not settles(args, kwargs):
            return
        settled = st.settled
        if settled is not None and settled.generation == st.generation and settled.admits(args, kwargs, settled.sizes):
            return  # settled already (this call came another way: a hook on the wrapper)
        if schedule.every_size:
            st.settled = SettledCalls(st.generation, args, kwargs, schedule, tensors=True)
            return
        shapes = shapes_of(args, kwargs)
        if (
            settled is not None
            and settled.sizes is not None
            and settled.generation == st.generation
            and settled.admits(args, kwargs, None)
        ):
            settled.add_size(shapes, schedule)
        else:
            st.settled = SettledCalls(st.generation, args, kwargs, None, tensors=True, sizes={shapes: schedule})

    def _settled_call(self, settled: SettledCalls, args: tuple, kwargs: dict) -> Any:
        """A call in the layout of one settled to run as written (passing an object, its
        nested children quiet; or of a structure run as written at every size), at the
        generation it settled at: the forward itself (settled_calls.py). The caller
        checked the hooks, as for any call.

        Without the lock: the call runs the user's model as written, which two threads may
        do at once as in eager (a nested child another thread's call placed is reached
        through that child's wrapper, which takes its own lock); the counters below are
        hints (a lost decrement only delays the nested children's retry by a call). The
        lock would cost these calls as much as the rest of the wrapper together."""
        st = self._ss
        settled.left -= 1
        if settled.left <= 0:
            st.settled = None  # the nested children's retry is due next call
        st.calls += 1
        if settled.nested is not None:
            settled.nested.calls += 1  # counted as NestedPlans.all_quiet counts a call
        sizes = settled.sizes
        st.last = settled.schedule if sizes is None else sizes[shapes_of(args, kwargs)]
        st.last_path = "as-written"
        module = self.module
        try:
            return type(module).forward(module, *args, **kwargs)
        except Exception as exc:
            self._annotate(exc)
            raise

    def _annotate(self, exc: Exception) -> None:
        """Name the submodule that raised, from the traceback, in ``exc`` (a call that ran
        the model's own forward; not the forward itself: that is the caller's own code)."""
        path = raised_in(exc, self.module)
        if path or (path is not None and self._ss.where[0]):
            annotate_exception(exc, self._where(path))

    def _call(self, args: tuple, kwargs: dict, inside_model_call: bool = False) -> Any:
        """One call, under the lock: bind, find or make the plan, run it.
        ``inside_model_call``: made by the model's own ``__call__`` (see :meth:`attach`),
        whose hooks have fired around it already.

        Every call pays this path before the model's own work, so its common cases are
        written out: a call of plain tensors, as many as ``forward`` has required
        parameters, takes its spec from the previous such call (no bind), and a call with
        the previous call's signature that runs the model as written returns from here."""
        st = self._ss
        if st.generation != _generation.current():
            self._revalidate()
        probe = st.probe
        if probe is not None and (probe.dtype, probe.device) != st.probed:
            log.info("streamsched: %s was moved or cast; re-tracing", type(self.module).__name__)
            self.invalidate()
        elif st.dtype_probes and not dtypes_same(st.dtype_probes):
            log.info("streamsched: a parameter of %s was cast; re-tracing", type(self.module).__name__)
            self.invalidate()
        module = self.module
        if inside_model_call:
            if global_hooks():
                # Global hooks fire on every submodule call: the forward as written.
                return self._forward_as_written(args, kwargs)
        elif (
            module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        ) and has_hooks(module):
            return self._call_with_hooks(args, kwargs)
        elif global_hooks():
            return self._call_with_hooks(args, kwargs)
        spec = st.tensors_spec
        if spec is not None and not kwargs and len(args) == st.tensors_arity and _all_plain_tensors(args):
            # Positional tensors only: the binder would return the same spec and the
            # arguments themselves as leaves.
            tensors = list(args)
        else:
            try:
                leaves, spec = st.bind(args, kwargs)
            except TypeError as exc:
                raise TypeError(f"{type(self.module).__name__}.forward(): {exc}") from None
            tensors = [leaves[i] for i in spec.tensor_positions]
            if (
                spec is not st.tensors_spec
                and not kwargs
                and len(args) == st.tensors_arity
                and len(tensors) == len(args)
                and _all_plain_tensors(args)
            ):
                st.tensors_spec = spec
        key = (
            spec.key,
            tuple([(t.shape, t.dtype, t.device, t.requires_grad) for t in tensors]),
            st.mode_id,
            torch.is_grad_enabled(),
            autocast_state(),
        )
        hot = st.hot
        if hot is not None and hot[0] == key:
            # The same signature as the previous call: no LRU bookkeeping.
            schedule = hot[1]
            if schedule.as_written and schedule.alias_pattern is None and st.observer is None:
                # Settled to run the model as written: nothing else to decide.
                st.calls += 1
                st.last = schedule
                if schedule.nests:
                    return self._forward_nesting(spec, args, kwargs)
                self._settle_as_written(args, kwargs, schedule)
                st.last_path = "as-written"
                return type(module).forward(module, *args, **kwargs)
        else:
            schedule = st.plans.get_fresh(key)
            if schedule is None and st.observer is None:
                # A signature settled to run as written (planning.signatures).
                schedule = st.written.get(key)
        if schedule is not None and schedule.alias_pattern is not None:
            # The plan orders in-place effects for the way its inputs alias each
            # other on the call that made it; other aliasing needs another plan.
            if _alias_pattern(tensors) != schedule.alias_pattern:
                schedule = None
        st.calls += 1
        if schedule is None:
            return self._new_signature(key, spec, tensors, args, kwargs)
        st.last = schedule
        st.hot = (key, schedule)
        if st.observer is None:
            if schedule.as_written:
                # The first calls measured the model's own forward faster: run it as
                # written (its own output types: no rebuild).
                if schedule.nests:
                    return self._forward_nesting(spec, args, kwargs)
                self._settle_as_written(args, kwargs, schedule)
                return self._forward_as_written(args, kwargs)
            if schedule.trial is not None and not self.config.sync_log and self.config.chaos is None:
                return self._run_trial(schedule, schedule.trial, tensors, args, kwargs)
        return schedule.rebuild(self._run(schedule, tensors))

    # --- internals --------------------------------------------------------------------

    def _revalidate(self) -> None:
        """Some module somewhere was re-wired, switched mode or had a flag set: drop traces
        whose modules moved or whose baked-in flags changed the program, and re-key the mode."""
        st = self._ss
        st.mode_id = st.mode_of(self.module)
        st.hot = None
        if st.nested is not None:
            st.nested.refresh()  # a child swapped: nest the new one
        # A module hook registered since: a hooked module runs as a call of its own.
        stale = st.hook_registrations != _generation.hook_registrations()
        st.hook_registrations = _generation.hook_registrations()
        # The first parameter may be another one now (re-wired); a cast or move of the
        # model at the same time must still count.
        probe, probed = _placement_probe(self.module)
        stale = stale or probed != st.probed or not all(t.dtypes_hold() for t in st.dtype_guarded)
        st.dtype_probes = dtype_probes(st.dtype_guarded)  # a parameter may be another one now
        st.probe, st.probed = probe, probed
        for traced in list(st.traces.values()):
            if not isinstance(traced, Traced):
                continue
            if not traced.modules_unchanged() or not (traced.flags_unchanged() or self._retraces_same(traced)):
                stale = True
                break
        if stale:
            log.info("streamsched: %s changed after wrapping; re-tracing", type(self.module).__name__)
            self.invalidate()
        elif st.fusion is not None and not st.fusion.fused_unchanged():
            log.info("streamsched: a fused module of %s was reconfigured; re-planning", type(self.module).__name__)
            self.invalidate()
        elif st.fusion is not None:
            # A parameter may have been re-assigned: re-stack whatever no longer aliases.
            st.fusion.check_all(full=True)
        st.generation = _generation.current()

    def _retraces_same(self, traced: Traced) -> bool:
        """A flag of a traced-through module changed: trace again, and keep the plans
        when the program is the same (the flag was never read by traced code)."""
        try:
            fresh = trace_model(
                self.module,
                self._ss.binder,
                traced.spec,
                tuple(self.config.leaf_modules),
                traced.ranks,
                traced.dtypes,
            )
        except TraceError:
            return False
        if not traced.same_program(fresh):
            return False
        traced.flags = fresh.flags
        return True

    def _trace(self, trace_key: Any, spec: Any, ranks: tuple[int, ...], dtypes: tuple) -> Traced:
        st = self._ss
        traced = st.traces.get_fresh(trace_key)
        if traced is None:
            leaf_types = tuple(self.config.leaf_modules)
            traced = trace_model(self.module, st.binder, spec, leaf_types, ranks, dtypes)
            st.traces.put(trace_key, traced)
        return traced

    def _guard_dtypes(self, traced: Traced) -> None:
        """After a recording call (which may have traced again): compare the dtypes of the
        parameters ``traced`` relied on every call from now on."""
        st = self._ss
        if traced.dtype_guards and not any(t is traced for t in st.dtype_guarded):
            live = {id(t) for t in st.traces.values()}  # those the LRU dropped: not checked
            st.dtype_guarded = [t for t in st.dtype_guarded if id(t) in live] + [traced]
        st.dtype_probes = dtype_probes(st.dtype_guarded)

    def _new_signature(self, key: Any, spec: Any, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """A call with no plan for its signature: plan it, or run the model as written where
        a plan would not pay (``planning.signatures``)."""
        st = self._ss
        automatic = self._automatic()
        if spec.has_objects is not None:
            # An object argument (a KV cache, a config, a dataclass batch) would be baked
            # into a trace, the tensors it holds as constants, that a later call passing
            # another object must not reuse: as written under every executor; keyed by
            # type, never kept. Its children, which are passed tensors (or objects in
            # turn), are nested as an untraceable forward's are (nesting.py).
            kind = spec.has_objects
            why = (
                f"an argument is a {kind} object, which a trace would bake in (a later call passes "
                "another one): calls passing one run the model as written"
            )
            counted = st.dispatch.leaf_calls
            structure = spec.key
            st.last = _AsWritten(make=lambda: self._as_written_plan(why, leaf_calls=counted.get(structure)), nests=True)
            # Later calls with this key (objects key by type) run as written at once.
            st.written.put(key, st.last)
            st.hot = (key, st.last)
            return self._forward_nesting(spec, args, kwargs)
        sizes = key[1]
        structure_key = (spec.key, tuple(m[1:] + (len(m[0]),) for m in sizes), *key[2:])
        structure = st.structures.get_fresh(structure_key)
        shapes = tuple(tuple(m[0]) for m in sizes)
        if structure is not None and automatic:
            verdict = structure.admit(shapes, structure.bucket_of(shapes))
            if verdict is not None:
                like, why = structure.plan, verdict.why
                st.last = _AsWritten(make=lambda: self._as_written_plan(why(), like))
                if verdict.settled:
                    # Later calls with this signature run as written without asking again.
                    st.written.put(key, st.last)
                    st.last.every_size = structure.as_written_at_every_size()
                    self._settle_as_written(args, kwargs, st.last)
                return self._forward_as_written(args, kwargs)
        start = time.perf_counter()
        out = self._first_call(key, spec, tensors, args, kwargs)
        record_s = time.perf_counter() - start
        compiled = st.plans.get(key)
        if isinstance(compiled, _Compiled):
            if structure is None:
                structure = Structure(self.config.plan_cache_size)
                structure.planned.put(shapes, True)
                # Nothing side by side, nothing batched: the trial's verdict holds for
                # every size (planning.signatures).
                plan = compiled.plan
                structure.uniform = plan.num_streams <= 1 and not plan.fused_groups
                st.structures.put(structure_key, structure)
            compiled.structure, compiled.sizes = structure, shapes
            structure.plan = compiled.plan
            # What a plan of a new size costs, against what a decided schedule saves.
            structure.recorded(record_s)
            bucket = structure.bucket_of(shapes)
            decision = structure.decision(bucket)
            if decision is not None and compiled.trial is not None:
                self._apply_decision(compiled, decision)
            elif compiled.trial is not None:
                structure.try_at(bucket, shapes)
                compiled.trial.began = st.calls
                if structure.uniform:
                    # Its verdict holds for every size: a schedule that wins only the
                    # forward's Python must win clearly, or each new size pays a plan
                    # for nothing.
                    compiled.trial.schedule_margin = _UNIFORM_SCHEDULE_MARGIN
        return out

    def _apply_decision(self, compiled: _Compiled, decision: Decision) -> None:
        """A size of a bucket already decided: no trial (or no more of it). A bucket
        decided for the model as written is one whose trial stalled, or ran at another
        size while this one's trial went on (planning.signatures)."""
        compiled.trial = None
        plan = compiled.plan
        why = f"size bucket decided at sizes {sizes_text(decision.sizes)}: {decision.why}"
        if decision.as_written:
            compiled.as_written = True
            compiled.plan = plan.model_copy(update={"executor": "eager", "reason": why})
            return
        if plan.executor != decision.executor:
            plan = plan.model_copy(update={"executor": decision.executor, "reason": why})
        else:
            plan = plan.model_copy(update={"reason": f"{plan.reason}; {why}"})
        compiled.plan = plan
        if compiled.structure is not None:
            compiled.structure.plan = plan

    def _as_written_plan(self, why: str, like: Optional[Plan] = None, leaf_calls: Optional[tuple] = None) -> Plan:
        """What ``sm.plan`` reports for a call that ran the model as written (``leaf_calls``:
        its forward's, counted with the nested children's share, ``_forward_nesting``)."""
        if like is None:
            plan = Plan.as_written(type(self.module).__name__, why)
            if leaf_calls is not None:
                plan = plan.model_copy(update={"leaf_calls": leaf_calls[1], "nested_leaf_calls": dict(leaf_calls[2])})
            return plan
        return like.model_copy(update={"executor": "eager", "reason": why, "trial": None})

    def _first_call(self, key: Any, spec: Any, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        global _unsettled_calls
        _unsettled_calls += 1
        st = self._ss
        # A trace bakes in the training flags of the modules it traced through, and is
        # made under one autocast state: a forward's own autocast block shows as a change
        # of that state only against the state the trace started in (frontend.trace).
        # The inputs' ranks too: a traced shape's length is its value's rank (frontend.ranks).
        # And their dtypes: the dtypes of its values follow from them (and the parameters').
        ranks = tuple(t.dim() for t in tensors)
        dtypes = tuple(t.dtype for t in tensors)
        trace_key = (spec.key, st.mode_id, autocast_state(), ranks, dtypes)
        if not self.config.strict and isinstance(st.traces.get_fresh(trace_key), TraceError):
            return self._eager_dispatch(spec, tensors, st.traces[trace_key], trace_key, args, kwargs)
        try:
            traced = self._trace(trace_key, spec, ranks, dtypes)
        except TraceError as exc:
            if self.config.strict:
                raise
            # Remember that this call structure cannot be traced: later calls go
            # straight to eager dispatch instead of failing to trace again.
            st.traces.put(trace_key, exc)
            return self._eager_dispatch(spec, tensors, exc, trace_key, args, kwargs)
        metas: dict = {}

        def on_error(exc: BaseException, node: Any) -> None:
            annotate_exception(exc, self._where(node_label(node)))

        recorder = EffectRecorder()
        with recorder:
            result = run_and_record(traced.graph, traced.root, tensors, on_error, metas, recorder)
        self._guard_dtypes(traced)
        input_keys = frozenset(recorder.key_of(t) for t in tensors)
        effects = Effects.from_accesses(recorder.accesses, input_keys, traced.graph)
        del recorder
        rebuild = traced.output_tree.rebuilder() if traced.output_tree is not None else _identity
        measured = self._measured_costs(tensors)
        planned = make_schedule(
            traced, metas, self.config, tensors, fusion=st.fusion, measured=measured, effects=effects
        )
        programs = st.programs.get(traced.graph)
        if programs is None:
            programs = st.programs[traced.graph] = ProgramCache()
        schedule = _Compiled(planned, compile_program(planned, programs), rebuild)
        schedule.nested_sites = self._opaque_sites(schedule.plan)
        if effects.writes_inputs:
            schedule.alias_pattern = _alias_pattern(tensors)
        if measured:
            schedule.plan = schedule.plan.model_copy(
                update={"notes": [*schedule.plan.notes, f"task costs measured: profile {self.config.profile}"]}
            )
        if self.config.executor == "auto":
            eager = self._may_run_as_written()
            if eager or schedule.plan.executor != "serial":
                schedule.trial = Trial(schedule.plan.executor, as_written=eager)
                if self.config.grad_handoff == "direct":
                    # Member gradients are written natively, past the hooks a backward
                    # timer waits for; and eager is no candidate there.
                    schedule.trial.backward = False
        st.plans.put(key, schedule)
        st.last = schedule
        st.last_path = "recorded"
        return rebuild(result)

    def _eager_dispatch(
        self, spec: Any, tensors: list[torch.Tensor], reason: TraceError, trace_key: Any, args: tuple, kwargs: dict
    ) -> Any:
        st = self._ss
        quiet = st.quiet.get_fresh(trace_key)
        automatic = self._automatic()
        nested = self._nesting()
        if automatic and isinstance(quiet, _AsWritten):
            st.last = quiet
            with nested.installed():
                return self._forward_as_written(args, kwargs)
        with nested.installed():
            done = eager_dispatch.run_eager_dispatch(
                st.dispatch.for_call(st.calls, st.observer or self._nvtx()), spec, tensors, reason
            )
        st.last = done.schedule
        st.last_path = "eager-dispatch"
        if done.sync_log is not None:
            st.last_sync_log = done.sync_log
        out = done.result()  # the call's exception, if any, raised once the call is recorded
        # Said once, after a call that worked: an exception eager raises too is the user's
        # own, not a tracing matter; and only to users who did not ask with strict=False.
        if not st.warned_untraceable and "strict" not in self.config.model_fields_set:
            st.warned_untraceable = True
            warnings.warn(
                f"{reason}\n[streamsched] {type(self.module).__name__} runs its own forward (eager dispatch: only "
                "@streamsched.branch calls are scheduled); pass strict=True to raise this error instead.",
                UntraceableWarning,
                stacklevel=user_stacklevel(),
            )
        if automatic:
            # A forward that calls no @streamsched.branch has nothing to dispatch: after
            # a few such calls in a row, it runs as written (the same calls, minus the
            # dispatch bookkeeping).
            plan = done.schedule.plan
            count = 0 if plan.tasks else (quiet if isinstance(quiet, int) else 0) + 1
            if count < _QUIET_CALLS:
                st.quiet.put(trace_key, count)
            else:
                why = (str(reason).strip().splitlines() or [type(reason).__name__])[0]
                update = {
                    "executor": "eager",
                    "reason": (
                        f"eager dispatch: the model cannot be traced ({why}); its forward made no "
                        f"@streamsched.branch call in {count} calls with these arguments: it runs as written"
                    ),
                }
                st.quiet.put(trace_key, _AsWritten(plan.model_copy(update=update)))
        return out

    def _opaque_sites(self, plan: Plan) -> list:
        """The nested sites of a traced plan: its opaque module calls that are not fused
        (a fused member's forward runs under vmap, not through a call)."""
        if not plan.opaque:
            return []
        fused = {m for g in plan.fused_groups for m in g.members}
        paths = [o.path for o in plan.opaque if o.path not in fused]
        return self._nesting().sites_at(paths)

    def _nesting(self) -> NestedPlans:
        """The model's nested children (nesting.py), made on first need."""
        st = self._ss
        if st.nested is None:
            st.nested = NestedPlans(
                self.module, self._nested_wrapper, lambda m: isinstance(m, StreamScheduledModule), self._leaf_types()
            )
        return st.nested

    def _nested_wrapper(self, child: nn.Module) -> StreamScheduledModule:
        """The wrapper a child of this untraceable forward is called through (nesting.py):
        this configuration, minus what belongs to the root (its profile of task costs,
        ``strict``: the root already said that the forward runs as written)."""
        wrapper = StreamScheduledModule(child, self.config.model_copy(update={"strict": False, "profile": None}))
        # Its errors name the module by its path in this model.
        path = next((p for p, m in self.module.named_modules() if m is child), "")
        prefix, root = self._ss.where
        wrapper._ss.where = (f"{prefix}{path}.", root)
        return wrapper

    def _where(self, path: str) -> str:
        """How an error names the module at ``path`` (of the wrapped model): by its path in
        the outermost wrapped model, for the wrapper of a nested child too."""
        prefix, root = self._ss.where
        full = prefix + path if path else prefix.rstrip(".")
        return f"module '{full}' of {root}" if full else f"the forward of {root}"

    def _leaf_types(self) -> tuple:
        return tuple(t for t in self.config.leaf_modules if isinstance(t, type))

    def _automatic(self) -> bool:
        """Whether this call may run the model as written instead of a schedule (``auto``,
        no observer, nothing asking for the schedule itself)."""
        return self.config.executor == "auto" and self._ss.observer is None and self._may_run_as_written()

    def _may_run_as_written(self) -> bool:
        """Whether ``executor="auto"`` may pick the model's own forward: not where the
        schedule itself is what was asked for (``sync_log`` and ``chaos`` exist to exercise
        it, a CUDA graph replays it, ``grad_handoff="direct"`` is a backward the trial's
        forward timings do not see)."""
        cfg = self.config
        return not cfg.sync_log and cfg.chaos is None and cfg.cuda_graph is False and cfg.grad_handoff != "direct"

    def _call_with_hooks(self, args: tuple, kwargs: dict) -> Any:
        """Hooks on the wrapped model itself, or global module hooks, fire around (or on)
        every module call eager makes, which no schedule reproduces: run the model as
        written, through its own ``__call__``, and say so once."""
        st = self._ss
        if not st.warned_hooks:
            st.warned_hooks = True
            where = "global module hooks are" if global_hooks() else f"{type(self.module).__name__} has hooks"
            warnings.warn(
                f"streamsched: {where} registered, so the wrapped model runs as written (its hooks fire as in "
                "eager; nothing is scheduled). Hooks on the StreamScheduledModule itself, or on a submodule, "
                "keep the schedule.",
                HooksWarning,
                stacklevel=user_stacklevel(),
            )
        st.last_path = "as-written"
        return self.module(*args, **kwargs)

    def _forward_nesting(self, spec: Any, args: tuple, kwargs: dict) -> Any:
        """The forward as written, its children nested (nesting.py), as an untraceable
        forward's as-written calls run: a call passing an object. The first call of each
        call structure counts the leaf calls (``Plan.coverage``), as eager dispatch does."""
        st = self._ss
        nested = self._nesting()
        counted = st.dispatch.leaf_calls
        if counted.get(spec.key) is not None and nested.all_quiet():
            if st.observer is None:
                # Later calls of this layout skip binding and keys (settled_calls.py).
                st.settled = SettledCalls(st.generation, args, kwargs, st.last, nested, nested.quiet_calls_ahead())
            return self._forward_as_written(args, kwargs)
        # A child that settles to run as written stops being nested at once: every call
        # passes the object (a decoding step), and a child nested for nothing costs each
        # of them its wrapper (and its parents' down to it).
        with nested.installed(hand_back=True):
            if counted.get_fresh(spec.key) is not None:
                return self._forward_as_written(args, kwargs)
            with counting_dispatch(self.module, self.config.leaf_modules, self._ss._nested_site) as counter:
                out = self._forward_as_written(args, kwargs)
        calls: dict[str, int] = {}
        for hit in counter.hits:
            if type(hit) is str:
                calls[hit] = calls.get(hit, 0) + 1
        counted.put(spec.key, (0, len(counter.hits), calls))
        return out

    def _forward_as_written(self, args: tuple, kwargs: dict) -> Any:
        # The class's forward, as the trace calls it: hooks on the model itself run on no
        # path of the wrapper (the wrapper's own hooks run around every call).
        self._ss.last_path = "as-written"
        module = self.module
        return type(module).forward(module, *args, **kwargs)

    def _run_trial(
        self, schedule: _Compiled, trial: Trial, tensors: list[torch.Tensor], args: tuple, kwargs: dict
    ) -> Any:
        structure = schedule.structure
        if structure is not None:
            decision = structure.decision(structure.bucket_of(schedule.sizes))
            if decision is not None:
                # The bucket was decided while this trial went on (stalled, or decided
                # at another size): take that verdict.
                self._apply_decision(schedule, decision)
                return self._run_decided(schedule, tensors, args, kwargs)
        trial.own_calls += 1
        if not trial.rare and trial.began is not None:
            if self._ss.calls - trial.began - trial.own_calls >= RARE_CALLS:
                # Its size comes back rarely (planning.signatures): decide on two calls of
                # each candidate, keeping the schedule only where it wins clearly.
                trial.rare = True
                trial.schedule_margin = max(trial.schedule_margin, _UNIFORM_SCHEDULE_MARGIN)
                if trial.done():
                    self._finish_trial(schedule, trial)
                    return self._run_decided(schedule, tensors, args, kwargs)
        if trial.pending:
            # Training calls whose backward has run since count now.
            trial.collect()
            if trial.done():
                self._finish_trial(schedule, trial)
                return self._run_decided(schedule, tensors, args, kwargs)
        name = trial.next()
        device = schedule.plan.device
        cuda = device.startswith("cuda")
        if name != "eager":
            executor = self._ss.executors.named(name, device)
        if cuda:
            torch.cuda.synchronize(device)
        # Each way timed as the calls after the trial would run it: the schedule with its
        # stacked-parameter checks and output rebuild, the model's forward as it is.
        global _unsettled_calls
        _unsettled_calls += 1
        unsettled = _unsettled_calls
        start = time.perf_counter()
        try:
            if name == "eager":
                out = self._forward_as_written(args, kwargs)
            else:
                self._ss.last_path = f"plan:{name}"
                guard = schedule.program.stack_guard
                if guard is not None:
                    guard.check()
                if schedule.nested_sites:
                    with self._ss.nested.installed(schedule.nested_sites):
                        out = schedule.rebuild(executor.run(schedule.program, tensors))
                else:
                    out = schedule.rebuild(executor.run(schedule.program, tensors))
        except Exception as exc:
            if name != "eager":
                where = failing_node(schedule.program, exc)
                if where is not None:
                    annotate_exception(exc, self._where(where))
            raise
        if cuda:
            torch.cuda.synchronize(device)
        forward_s = time.perf_counter() - start
        if unsettled != _unsettled_calls and trial.skip(name):
            return out
        if trial.backward is not False:
            # In training the step is forward and backward: time the backward too, once
            # the caller runs it (backward_timing).
            reads = [*tensors, *(p for p in self.module.parameters() if p.requires_grad)]
            sample = BackwardSample.attach(out, reads, torch.device(device))
            if trial.backward is None:
                trial.backward = sample is not None
            if sample is not None:
                trial.add_pending(name, forward_s, sample)
                return out
            if trial.backward:
                trial.missed()  # no gradient this time: nothing comparable to time
                return out
        trial.add(name, forward_s)
        if trial.done():
            self._finish_trial(schedule, trial)
        return out

    def _run_decided(self, schedule: _Compiled, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """A call of a signature whose trial has just been decided, run the way decided."""
        if schedule.as_written:
            return self._forward_as_written(args, kwargs)
        return schedule.rebuild(self._run(schedule, tensors))

    def _finish_trial(self, schedule: _Compiled, trial: Trial) -> None:
        schedule.plan, schedule.as_written = trial.decide(schedule.plan)
        schedule.trial = None
        if schedule.structure is not None:
            # Decided once for the sizes' bucket: its other sizes take this verdict.
            schedule.structure.plan = schedule.plan
            measured = schedule.plan.trial.best_us if schedule.plan.trial is not None else {}
            kept = measured.get(schedule.plan.schedule_executor)
            gain_s = None
            if not schedule.as_written and kept is not None and "eager" in measured:
                gain_s = (measured["eager"] - kept) * 1e-6
            schedule.structure.decide(
                schedule.structure.bucket_of(schedule.sizes),
                Decision(
                    schedule.as_written, schedule.plan.schedule_executor, schedule.plan.reason, schedule.sizes, gain_s
                ),
            )

    def _measured_costs(self, tensors: list[torch.Tensor]) -> Optional[dict[str, float]]:
        """Task costs from ``config.profile`` (checked against this model, input and device)."""
        if self.config.profile is None:
            return None
        st = self._ss
        if st.profile is None:
            st.profile = load_profile(self.config.profile)
        device = device_of(tensors, self.module)
        try:
            check_profile(st.profile, type(self.module).__name__, signature_text(tensors), str(device))
        except ProfileMismatchError as exc:
            raise ProfileMismatchError(f"{exc} (profile {self.config.profile})") from None
        return profile_costs(st.profile)

    def _nvtx(self, schedule: Optional[_Compiled] = None) -> Any:
        """The NVTX range observer, on every executor and device (NVTX tools profile
        CPU-only runs too) and under eager dispatch, while a tool is there to see the
        ranges (Nsight Systems attached, or the torch profiler recording): free otherwise."""
        ranges = self._ss.nvtx
        if ranges is None:  # first call: the config is frozen, so this is decided once
            ranges = self._ss.nvtx = (NvtxRanges.create() if self.config.nvtx else None) or False
        if ranges and ranges.wanted():
            return ranges
        return None

    def _direct(self, schedule: _Compiled, executor: Any) -> Optional[tuple]:
        """``(plan, program.call, nvtx_wanted)`` when every call of ``schedule`` under
        ``plan`` that no observer or NVTX tool looks at runs the serial program's one
        function and nothing else: the serial executor, no sync log, chaos or nested sites
        (all fixed by the frozen config and the plan), no CUDA graph (a CPU plan, or graphs
        off). ``_run`` then checks the stacks, that no observer is installed and, where
        NVTX ranges are on, that nothing would see them (``nvtx_wanted``: ``None`` where
        they are off). The plan is kept to notice a trial's decision."""
        cfg = self.config
        if (
            executor is not self._ss.executors.serial
            or schedule.program.call is None
            or cfg.sync_log
            or cfg.chaos is not None
            or schedule.nested_sites
            or (cfg.cuda_graph is not False and schedule.plan.device.startswith("cuda"))
        ):
            return None
        ranges = self._ss.nvtx
        return (schedule.plan, schedule.program.call, ranges.wanted if ranges else None)

    def _graph_executor(self, schedule: _Compiled, tensors: list[torch.Tensor]) -> Optional[GraphExecutor]:
        """The CUDA-graph executor for this call, or None when graphs do not apply."""
        if self.config.cuda_graph is False or not schedule.plan.device.startswith("cuda"):
            return None
        if not GraphExecutor.captures(tensors):
            return None
        graphs = self._ss.executors.graphs_for(schedule.plan.device, self.module, self.config)
        if graphs.swapped():
            return None  # tensors swapped in (functional_call): streams, the graphs kept
        return graphs

    def _run(self, schedule: _Compiled, tensors: list[torch.Tensor]) -> Any:
        st = self._ss
        direct = schedule.direct
        if (
            direct is not None
            and direct[0] is schedule.plan
            and st.observer is None
            and (direct[2] is None or not direct[2]())
        ):
            # The serial program's one function, nothing else to decide (see _direct).
            guard = schedule.program.stack_guard
            if guard is not None:
                guard.check()
            st.last_path = "plan:serial"
            try:
                return direct[1](tensors)
            except Exception as exc:
                where = failing_node(schedule.program, exc)
                if where is not None:
                    annotate_exception(exc, self._where(where))
                raise
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
        guard = schedule.program.stack_guard
        if guard is not None:
            guard.check()
        graphs = self._graph_executor(schedule, tensors)
        try:
            if graphs is not None:
                st.last_path = "graph"
                return graphs.run(schedule.program, tensors, sync_log, chaos, st.observer)
            st.last_path = "plan:" + schedule.plan.schedule_executor
            executor = st.executors.for_plan(schedule.plan)
            observer = st.observer or self._nvtx(schedule)
            if schedule.direct is None or schedule.direct[0] is not schedule.plan:
                schedule.direct = self._direct(schedule, executor)
            if schedule.nested_sites:
                with st.nested.installed(schedule.nested_sites):
                    return executor.run(schedule.program, tensors, sync_log, chaos, observer)
            return executor.run(schedule.program, tensors, sync_log, chaos, observer)
        except Exception as exc:
            where = failing_node(schedule.program, exc)
            if where is not None:
                annotate_exception(exc, self._where(where))
            raise
