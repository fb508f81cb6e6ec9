"""What a ``StreamScheduledModule`` keeps: its caches (:class:`WrapperState`) and, per
input signature, how calls with it run (:class:`Compiled`: a planned and compiled
signature; :class:`AsWritten`: one that runs the model as written)."""

from __future__ import annotations

import inspect
import itertools
import threading
import weakref
from typing import Any, Optional

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from . import _generation, _native
from ._lru import LRU
from .config import SchedulerConfig
from .errors import ConfigError
from .frontend.binder import CallBinder, ShapeCachedBinder
from .frontend.hooks import hook_ids
from .frontend.trace import Traced, is_compiled_module
from .nesting import NestedPlans
from .planning.choice import Trial
from .planning.plan import Plan
from .planning.planner import Schedule
from .planning.signatures import Decision, Structure, sizes_text
from .runtime import dispatch as eager_dispatch
from .runtime.pool import ExecutorPool
from .runtime.program import Program
from .runtime.synclog import SyncLog
from .settled_calls import SettledCalls

__all__ = [
    "UNIFORM_SCHEDULE_MARGIN",
    "count_unsettled",
    "unsettled_calls",
    "check_wrappable",
    "AttachedForward",
    "AsWritten",
    "Compiled",
    "WrapperState",
    "alias_pattern",
    "all_plain_tensors",
    "placement_probe",
]

# How much faster than the model as written a plan with nothing to run side by side or
# batch must be to be kept (planning.signatures: decided once for every size).
UNIFORM_SCHEDULE_MARGIN = 0.05

# Calls of any wrapper that were not yet its settled way of running: first calls of a
# signature (trace, record, plan) and trial calls. A trial call of a plan during which
# another one ran (a nested child planning or trying itself) is no measure of the plan.
_unsettled_calls = 0


def count_unsettled() -> int:
    """Count a call that is not a settled one (a first call or a trial call)."""
    global _unsettled_calls
    _unsettled_calls += 1
    return _unsettled_calls


def unsettled_calls() -> int:
    """How many calls were counted by :func:`count_unsettled` so far."""
    return _unsettled_calls


# The fields of a plan the ``auto`` trial's decision sets (``Trial.decide``).
_DECIDED_FIELDS = ("executor", "reason", "notes", "trial")


class AsWritten:
    """What ``sm.plan`` reports for a call that ran the model as written: a plan, or how
    to make one when asked (these calls are the cheap path: no pydantic model per call)."""

    __slots__ = ("_plan", "make", "nests", "every_size")

    # Read by the call path like a compiled signature's: it runs the model as written.
    as_written = True
    alias_pattern = None
    trial = None
    runs_models_code = False

    def __init__(self, plan: Optional[Plan] = None, make: Any = None, nests: bool = False):
        self._plan = plan
        self.make = make
        # Whether its calls nest the forward's children (nesting.py): a forward run as
        # written because an argument is an object.
        self.nests = nests
        # Whether its call structure runs as written at every size (settled_calls.py).
        self.every_size = False

    @property
    def plan(self) -> Plan:
        if self._plan is None:
            self._plan = self.make()
            self.make = None
        return self._plan


class Compiled:
    """One input signature as the wrapper runs it: the planner's schedule (whose ``plan``
    is the signature's one plan), the program the runtime compiled from it, how calls
    with the signature run, and the ``auto`` trial's decision beside the plan
    (``verdict``: the fields it sets on the plan ``sm.plan`` reports)."""

    __slots__ = (
        "schedule",
        "program",
        "verdict",
        "_shown",
        "executor",
        "device",
        "trial",
        "as_written",
        "rebuild",
        "alias_pattern",
        "held_storages",
        "variants",
        "structure",
        "sizes",
        "nested_sites",
        "graphs",
        "direct",
        "checks",
        "written",
        "runs_models_code",
    )

    # Its calls run as written (``as_written``) without nesting the forward's children; the
    # shortcut for structures run as written at every size starts from an AsWritten.
    nests = False
    every_size = False

    def __init__(self, schedule: Schedule, program: Program, rebuild: Any, graphs: bool):
        self.schedule = schedule
        self.program = program
        # The trial's decision (or a decided size bucket's): {field: value} over the plan.
        self.verdict: Optional[dict] = None
        self._shown: Optional[Plan] = None
        # The executor the schedule runs on, and the plan's device.
        self.executor = schedule.plan.schedule_executor
        self.device = schedule.plan.device
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
        # The model's parameter and buffer storages on the planning call, where it has an
        # alias pattern (``state_storages``): an input sharing one is part of the pattern.
        self.held_storages: Optional[dict] = None
        # The plans of this signature by alias pattern, shared by them all: calls whose
        # inputs alias otherwise from call to call each find theirs.
        self.variants: Optional[dict[tuple, Compiled]] = None
        # The call structure this signature belongs to, and its sizes: the trial's
        # decision is kept there for the sizes' bucket.
        self.structure: Optional[Structure] = None
        self.sizes: tuple = ()
        # The plan's opaque module calls that are nested (nesting.py): their forwards run
        # as written inside their tasks, and their children get plans of their own.
        self.nested_sites: list = []
        # Whether a CUDA graph may replay its calls (``cuda_graph`` on, a CUDA plan).
        self.graphs = graphs
        # (verdict, function, nvtx_wanted): how the runner calls the plan while the
        # verdict is this one (runner.Runner.direct).
        self.direct: Optional[tuple] = None
        # Whether the program reads opaque calls' values through structure checks
        # (frontend.opaque_outputs.OutputCheck): its calls run through Runner.checked.
        self.checks = False
        # Whether its calls run code of the model's (``Traced.runs_models_code``): the
        # runner checks after each whether that code assigned what the trace baked in.
        self.runs_models_code = False
        # Where it has checks and writes state: the state a check stopping it may find
        # written (written_state.WrittenState), saved before each call and put back by a
        # stopped one; ``None`` where there is none to save or it cannot be found.
        self.written: Any = None

    @property
    def plan(self) -> Plan:
        """The plan, with the trial's decision once made (what ``sm.plan`` reports)."""
        shown = self._shown
        if shown is None:
            plan = self.schedule.plan
            shown = self._shown = plan if self.verdict is None else plan.model_copy(update=self.verdict)
        return shown

    @plan.setter
    def plan(self, plan: Plan) -> None:
        # A new plan for the same program (no decision on it yet).
        self.schedule.plan, self.verdict, self._shown = plan, None, None
        self.executor = plan.schedule_executor

    @property
    def graph(self) -> Any:
        return self.schedule.graph

    @property
    def tasks(self) -> Any:
        return self.schedule.tasks

    def _decide(self, verdict: dict, as_written: bool) -> None:
        self.verdict, self._shown, self.as_written, self.trial = verdict, None, as_written, None
        self.executor = self.plan.schedule_executor

    def run_as_written(self, why: str) -> None:
        """Calls with this signature run the model's own forward from now on (``why``:
        what ``sm.plan`` says), whatever the trial would have decided."""
        self._decide({"executor": "eager", "reason": why}, True)

    def apply(self, decision: Decision) -> None:
        """A size of a bucket already decided: no trial (or no more of it). A bucket
        decided for the model as written is one whose trial stalled, or ran at another
        size while this one's trial went on (planning.signatures)."""
        plan = self.plan
        why = f"size bucket decided at sizes {sizes_text(decision.sizes)}: {decision.why}"
        if decision.as_written:
            self._decide({"executor": "eager", "reason": why}, True)
            return
        if plan.executor != decision.executor:
            self._decide({"executor": decision.executor, "reason": why}, False)
        else:
            self._decide({"reason": f"{plan.reason}; {why}"}, False)
        if self.structure is not None:
            self.structure.plan = self.plan

    def finish(self, trial: Trial) -> None:
        """The trial has its figures: decide, and keep the verdict for the sizes' bucket."""
        decided, as_written = trial.decide(self.plan)
        self._decide({k: getattr(decided, k) for k in _DECIDED_FIELDS}, as_written)
        structure = self.structure
        if structure is None:
            return
        # Decided once for the sizes' bucket: its other sizes take this verdict.
        plan = structure.plan = self.plan
        measured = plan.trial.best_us if plan.trial is not None else {}
        kept = measured.get(plan.schedule_executor)
        gain_s = None
        if not as_written and kept is not None and "eager" in measured:
            gain_s = (measured["eager"] - kept) * 1e-6
        structure.decide(
            structure.bucket_of(self.sizes),
            Decision(as_written, plan.schedule_executor, plan.reason, self.sizes, gain_s),
        )


class WrapperState:
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
        # an AsWritten once there were enough of them.
        self.quiet: LRU = LRU(config.plan_cache_size)
        self.plans: LRU = LRU(config.plan_cache_size)
        # Signatures settled to run the model as written (a size bucket the trial decided
        # for it, churn, an object argument): AsWritten records, so that their calls
        # skip the size policy. Small entries (sizes, no tensors), so many of them.
        self.written: LRU = LRU(max(256, 16 * config.plan_cache_size))
        # Per call structure (a signature without its sizes): which new sizes get a plan.
        self.structures: LRU = LRU(max(16, config.plan_cache_size))
        self.last: Any = None  # what sm.plan reports: a Compiled, or an eager-dispatch record
        # Which way the most recent call ran (``streamsched.testing.last_path``): "recorded",
        # "plan:<executor>", "graph", "as-written" or "eager-dispatch".
        self.last_path = ""
        # (key, schedule) of the most recent traced call: the common case skips the LRU.
        self.hot: Optional[tuple] = None
        # Calls settled to run as written whatever their sizes (passing an object, or of
        # a structure run as written at every size): their layout, checked before
        # anything else (settled_calls.py); the most recently called one first, then up
        # to MAX_SETTLED_LAYOUTS - 1 others (autocast or the grad mode switched around
        # every call, an optional argument passed every other call).
        self.settled: Optional[SettledCalls] = None
        self.settled_more: tuple = ()
        # Shapes of one layout whose plans run as one function (hot_plans.py): checked
        # first on every call.
        self.hot_plans: Any = None
        # Whether a settled layout counts its call structure's new sizes (stop_counting).
        self.counting = False
        self.lock = threading.RLock()
        self.generation = _generation.current()
        self.changes = _generation.changes()  # the same, less modules' modes switched
        self.buffer_replacements = _generation.buffer_replacements()
        # The model's first parameter (or buffer) and its (dtype, device) when traces were
        # made: ``model.to(...)``, ``.half()``, ``.cuda()`` on the model itself (not the
        # wrapper) moves no generation, and traced code may have read them as constants
        # (transformers' ``self.device`` and ``self.dtype``).
        self.probe, self.probed = placement_probe(model)
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
        self.mode_ids = itertools.count()
        # The modes in which a module holds a hook registered after wrapping, and the call
        # structures of such modes met once (``new_signatures``: a hook held for a call or
        # two runs as written).
        self.hooked_modes: set[int] = set()
        self.hooked_seen: LRU = LRU(max(16, config.plan_cache_size))
        # Call structures told apart only by the values of plain arguments: those met
        # (with any value), and the structures with a value met once that then ran as
        # written (``new_signatures``: a temperature or ``p`` new on every call is not
        # traced and recorded on every call).
        self.valued_shapes: LRU = LRU(max(16, config.plan_cache_size))
        self.values_seen: LRU = LRU(max(16, config.plan_cache_size))
        # The hooks the model held when wrapped (planned at once, in every mode).
        self.wrapped_hooks = _hooks_in(_mode_flags(model))
        self.mode_id = self.mode_of(model)
        self.warned_untraceable = False
        # How errors name a module: (path prefix, model name); a nested child's wrapper
        # names its modules by their paths in the outermost model.
        self.where = ("", type(model).__name__)
        self.warned_hooks = False
        # Whether the log said once that calls of an explicit executor ran as written
        # because the state or the plain values they read change call after call.
        self.warned_varying = False
        # An untraceable forward's children, scheduled by plans of their own (nesting.py).
        self.nested: Optional[NestedPlans] = None
        # Re-traces because the state traces read changed (``Runner.retrace``): the calls
        # (``calls``) at the latest few, and, once they came too often, the window of
        # calls that run as written (until ``churned_until``) and its length.
        self.churn: list[int] = []
        self.churned_until = 0
        self.churn_window = 0
        self.churned: Any = None  # what sm.plan reports for those calls
        # Set once the model runs as written from now on (``Runner.check_written_state``):
        # code run inside a call (a hook, an opaque module, a branch) assigned an attribute
        # a trace bakes in, which a traced call would read stale. What sm.plan reports for
        # those calls. Cleared by invalidate().
        self.state_written: Optional[AsWritten] = None

    def call_count(self) -> int:
        """Calls of the wrapper so far (the size policy's clock: ``Structure.clock``)."""
        return self.calls

    def settle(self, record: SettledCalls) -> None:
        """Make ``record`` the settled layout checked first. The one it replaces is kept
        among the others (the most recent first, ``MAX_SETTLED_LAYOUTS`` in all), as long
        as its generation holds (records of an older one never admit a call again); a
        record of ``record``'s own layout is dropped (its check function is shared)."""
        current = self.settled
        generation = record.generation
        more = self.settled_more
        if current is not None or more:
            kept = [r for r in (current, *more) if r is not None and r is not record and r.generation == generation]
            kept = [r for r in kept if r.admits is not record.admits]
            self.settled_more = tuple(kept[: MAX_SETTLED_LAYOUTS - 1])
        self.settled = record

    def follow_own_writes(self, before: int) -> None:
        """The model's forward, run as written, moved the generation from ``before``: it
        assigns an attribute on its calls (NLLB-MoE's router sets ``expert_capacity`` from
        the token count on every call). The settled layouts at ``before`` move with it, so
        that the next call of theirs takes the shortcut again: a call run as written is
        the model's own, whatever it assigned, and a change made between calls still
        moves the generation past them. (The wrapper's own generation stays: a plan's
        trace may bake in what was assigned, and its next call re-validates.) Layouts
        with nested children stay: those children's plans are traces too."""
        moved = _generation._generation
        for record in (self.settled, *self.settled_more):
            if record is not None and record.generation == before and record.nested is None:
                record.generation = moved

    def find_settled(self, args: tuple, kwargs: dict) -> tuple:
        """``(record, found)``: the settled layout that admits this call (at its sizes), at
        the current generation, first or other, and what its check returned
        (``SettledCalls.admits``: falsy where none admits it; ``record`` may then be
        ``None``). ``StreamScheduledModule.__call__`` writes this out for its own calls."""
        settled = self.settled
        generation = _generation._generation
        found = None
        if settled is not None and settled.generation == generation:
            found = settled.admits(args, kwargs, settled.sizes)
        if not found and self.settled_more:
            # Another settled layout (autocast or the grad mode switched around each call).
            settled, found = self.other_settled(args, kwargs, generation)
        return settled, found

    def other_settled(self, args: tuple, kwargs: dict, generation: int) -> tuple:
        """``(record, found)``: the settled layout other than the first that admits this
        call (at its sizes), at ``generation``, and what its check returned
        (``SettledCalls.admits``); it becomes the first. ``(None, None)`` where none does."""
        more = self.settled_more
        for i, record in enumerate(more):
            if record.generation != generation:
                continue
            found = record.admits(args, kwargs, record.sizes)
            if found:
                current = self.settled
                rest = more[:i] + more[i + 1 :]
                self.settled_more = rest if current is None else (current, *rest)
                self.settled = record
                return record, found
        return None, None

    def settled_layout(self, args: tuple, kwargs: dict, varying: bool = False) -> Optional[SettledCalls]:
        """The settled record, first or other, of this call's layout (at any size), at the
        wrapper's generation: a varying one (``SettledCalls(..., values=...)``, its
        numbers read from a table of values) where ``varying``, else one of another kind."""
        generation = self.generation
        for record in (self.settled, *self.settled_more):
            if (
                record is not None
                and record.varying is varying
                and record.generation == generation
                and record.admits(args, kwargs, None)
            ):
                return record
        return None

    def values_met(self, args: tuple, kwargs: dict) -> bool:
        """Whether a varying layout settled for this call's layout met the values of its
        plain numbers (its calls that ran as written noted them there, not in
        ``values_seen``)."""
        record = self.settled_layout(args, kwargs, varying=True)
        return record is not None and record.sizes.met(args, kwargs)

    def stop_counting(self) -> None:
        """A plan of a call structure runs: its settled layouts stop counting its new sizes
        (``SizeTable.structure``; a layout that counted nothing else is dropped). Its calls
        would each pay the layout check before the full path, which runs the plan; a new
        size met on the full path lets the layout count them again."""
        self.counting = False
        kept = []
        for record in (self.settled, *self.settled_more):
            if record is None:
                continue
            sizes = record.sizes
            if sizes is not None and sizes.structure is not None:
                sizes.structure = None
                if not sizes and not sizes.buckets:
                    continue
            kept.append(record)
        self.settled = kept[0] if kept else None
        self.settled_more = tuple(kept[1:])

    def unsettle(self) -> None:
        """Forget every settled layout: the next calls take the full path."""
        self.settled = None
        self.settled_more = ()
        self.hot_plans = None

    def _nested_site(self) -> Optional[str]:
        return self.nested.current_path() if self.nested is not None else None

    def clear(self, model: nn.Module) -> None:
        """Drop every cached trace, plan and stacked parameter (``sm.invalidate()``)."""
        self.traces.clear()
        self.programs.clear()
        self.quiet.clear()
        self.plans.clear()
        self.written.clear()
        self.structures.clear()
        self.hooked_seen.clear()
        self.valued_shapes.clear()
        self.values_seen.clear()
        self.last = None
        self.hot = None
        self.unsettle()
        if self.fusion is not None:
            self.fusion.invalidate()
        self.executors.forget_graphs()
        if self.nested is not None:
            self.nested.invalidate()
        self.generation = _generation.current()
        self.changes = _generation.changes()
        self.buffer_replacements = _generation.buffer_replacements()
        self.probe, self.probed = placement_probe(model)
        self.dtype_guarded = []
        self.dtype_probes = ()

    def where_text(self, path: str) -> str:
        """How an error names the module at ``path`` (of the wrapped model): by its path in
        the outermost wrapped model, for the wrapper of a nested child too."""
        prefix, root = self.where
        full = prefix + path if path else prefix.rstrip(".")
        return f"module '{full}' of {root}" if full else f"the forward of {root}"

    def mode_of(self, model: nn.Module) -> int:
        """Every module's training flag and the hooks it holds (by handle id, never
        reused), interned as a small int for the plan key: a hooked module runs as a
        call of its own, so a trace with a hook differs from one without, and the plans
        without it serve again once it is removed."""
        flags = _mode_flags(model)
        mode = self.modes.get(flags)
        if mode is None:
            if len(self.modes) >= _MAX_MODES:
                # A hook registered afresh every few calls makes a new mode each time:
                # forget the old ones (ids are never handed out twice, so a plan cached
                # under a forgotten id is never taken for another mode's).
                self.modes.clear()
                self.hooked_modes.clear()
            mode = self.modes[flags] = next(self.mode_ids)
            hooks = _hooks_in(flags)
            if hooks and hooks != self.wrapped_hooks:
                self.hooked_modes.add(mode)  # hooks registered since the model was wrapped
        return mode


# How many settled layouts a wrapper keeps (``WrapperState.settle``): a call that misses
# the first checks the others in turn, so a few: as many as the states real code switches
# between around its calls (three grad modes, autocast on and off, an optional mask).
MAX_SETTLED_LAYOUTS = 4

# How many modes (train/eval and hook states) a wrapper keeps ids for at most.
_MAX_MODES = 1024


def _mode_flags(model: nn.Module) -> tuple:
    """Per module, its training flag, or (flag, hook ids) where it holds hooks."""
    return tuple(
        (m.training, hook_ids(m))
        if (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) and hook_ids(m)
        else m.training
        for m in model.modules()
    )


def _hooks_in(flags: tuple) -> tuple:
    """The hooks part of :func:`_mode_flags`: (module index, hook ids) where any."""
    return tuple((i, f[1]) for i, f in enumerate(flags) if type(f) is tuple)


class AttachedForward:
    """The ``forward`` an attached model gets (``StreamScheduledModule.attach``)."""

    __slots__ = ("wrapper", "_signature")
    # A forward that enters a wrapper, not one of the user's (Runner.call, trace flags).
    enters_wrapper = True

    def __init__(self, wrapper: Any):
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

    @staticmethod
    def attach(model: nn.Module, wrapper: Any) -> nn.Module:
        """Give ``model`` an instance attribute ``forward`` that enters ``wrapper``."""
        current = model.__dict__.get("forward")
        if isinstance(current, AttachedForward) and current.wrapper is not wrapper:
            raise ConfigError(f"{type(model).__name__} is attached to another StreamScheduledModule; detach it first")
        if current is not None and not isinstance(current, AttachedForward):
            raise ConfigError(
                f"{type(model).__name__} has an instance attribute 'forward' of its own; attach() would replace it"
            )
        model.__dict__["forward"] = AttachedForward(wrapper)
        return model

    @staticmethod
    def detach(model: nn.Module, wrapper: Any) -> nn.Module:
        """Remove the ``forward`` that :meth:`attach` gave ``model`` for ``wrapper``."""
        current = model.__dict__.get("forward")
        if isinstance(current, AttachedForward) and current.wrapper is wrapper:
            del model.__dict__["forward"]
        return model

    @staticmethod
    def attached(model: nn.Module) -> bool:
        return isinstance(model.__dict__.get("forward"), AttachedForward)

    def __reduce__(self) -> Any:
        raise TypeError(
            "a model attached to a StreamScheduledModule cannot be pickled or copied: call sm.detach() first"
        )


def check_wrappable(model: Any, wrapper_class: type) -> None:
    """Raise where ``model`` is no module a ``StreamScheduledModule`` can wrap."""
    if isinstance(model, wrapper_class):
        raise ConfigError(
            f"{type(model.module).__name__} is already wrapped in a StreamScheduledModule; "
            "wrap its .module instead (to change options, pass a new config)"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(_not_a_module(model))
    if isinstance(model, torch.jit.ScriptModule):
        # TorchScript: its forward is no Python fx can trace, and run as one call it
        # would leave nothing to schedule.
        name = getattr(model, "original_name", None) or type(model).__name__
        raise ConfigError(
            f"StreamScheduledModule cannot wrap a TorchScript module ({name}, from torch.jit.script or "
            "torch.jit.trace): fx cannot trace TorchScript, and run as one call it leaves nothing to schedule. "
            "Wrap the Python model itself, or script its branches (model.towers[i] = torch.jit.script(tower)) "
            "and wrap the model: each scripted branch runs as one task"
        )
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


def _not_a_module(model: Any) -> str:
    """What was passed instead of an ``nn.Module`` instance, and what to pass."""
    if isinstance(model, type) and issubclass(model, nn.Module):
        return (
            f"StreamScheduledModule wraps an nn.Module instance, got the class {model.__name__} itself: "
            f"create the model first, StreamScheduledModule({model.__name__}(...))"
        )
    if callable(model):
        name = getattr(model, "__qualname__", None) or type(model).__name__
        return (
            f"StreamScheduledModule wraps an nn.Module, got the {type(model).__name__} {name}: put the code in the "
            "forward of an nn.Module whose branches are submodules (or @streamsched.branch functions it calls) "
            "and wrap an instance of it"
        )
    return (
        f"StreamScheduledModule wraps an nn.Module, got {type(model).__name__} {_short_repr(model)}: "
        "pass the model itself (an nn.Module instance)"
    )


def _short_repr(value: Any) -> str:
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a repr that fails says nothing more
        return ""
    return text if len(text) <= 60 else text[:57] + "..."


def placement_probe(model: nn.Module) -> tuple[Optional[torch.Tensor], Optional[tuple]]:
    """The model's first parameter (else buffer) and its (dtype, device) now."""
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        return tensor, (tensor.dtype, tensor.device)
    return None, None


_Tensor = torch.Tensor


def all_plain_tensors(args: tuple) -> bool:
    """Whether every argument is a ``torch.Tensor`` itself (no subclass, no other value)."""
    for a in args:
        if type(a) is not _Tensor:
            return False
    return True


def alias_pattern(tensors: list[torch.Tensor], state: Optional[dict[int, tuple[int, Any]]] = None) -> tuple:
    """Which inputs share storage: for each input, the index of the first input with its
    storage; with ``state`` (:func:`state_storages`), then for each input the index of
    the model's parameter or buffer whose storage it shares (-1: none), and the inputs'
    strides. A plan orders the in-place writes of the call that recorded it: an input
    that becomes the storage of a buffer the forward writes (``sm(x, model.buf)``) needs
    another plan, and so does one laid out otherwise (``x.reshape(-1).add_(1)`` writes
    ``x`` where ``x`` is contiguous and a copy where it is not)."""
    first: dict[int, int] = {}
    storages = [t.untyped_storage()._cdata for t in tensors]
    pattern = tuple([first.setdefault(s, i) for i, s in enumerate(storages)])
    if state is None:
        return pattern
    shared = []
    for s in storages:
        held = state.get(s)
        # (A storage freed since, whose address an input's storage now has, is none.)
        shared.append(-1 if held is None or held[1].expired() else held[0])
    return pattern + tuple(shared) + tuple([t.stride() for t in tensors])


def state_storages(module: nn.Module) -> dict[int, tuple[int, Any]]:
    """The storages of ``module``'s parameters and buffers now (by address), each to the
    index of the first tensor holding it and a weak reference to it (:func:`alias_pattern`;
    a plan holding it does not keep a storage alive that the module let go)."""
    out: dict[int, tuple[int, Any]] = {}
    for i, t in enumerate(itertools.chain(module.parameters(), module.buffers())):
        storage = t.untyped_storage()
        if storage._cdata not in out:
            out[storage._cdata] = (i, StorageWeakRef(storage))
    return out
