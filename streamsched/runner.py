"""How the calls of a ``StreamScheduledModule`` run, once the wrapper knows what to run:
the model as written (with its children nested where they have plans of their own),
under eager dispatch, a compiled plan on its executor or as a CUDA graph, and the
``auto`` trial's timed calls; with the sync log and chaos set up, and the module an
exception was raised in named, in one place each.

The configuration is frozen, so what it decides for every call (which executor, CUDA
graphs, whether the model's own forward may compete) is read once, here."""

from __future__ import annotations

import gc
import logging
import time
import warnings
from typing import Any, Optional

import torch
from torch import nn

from . import _generation
from ._clock import runqueue_wait_ns
from ._rng import restore_generators, save_generators
from .backward_timing import BackwardSample, ParameterEnds, grad_outputs
from .config import SchedulerConfig
from .errors import (
    FusedMembersReshaped,
    HooksWarning,
    TraceError,
    UntraceableWarning,
    first_line,
    raised_in,
    user_stacklevel,
)
from .frontend.checkpointing import in_checkpoint_region
from .frontend.hooks import global_hooks, has_hooks
from .frontend.leafcalls import counting_dispatch
from .frontend.opaque_outputs import OpaqueOutputChanged
from .frontend.trace import Traced, dtypes_same
from .frontend.trace_guard import autocast_state
from .hot_plans import MISS, HotEntry, HotPlans, hot_eligible
from .nesting import NestedPlans
from .nesting_trial import PLAIN, NestingTrial
from .new_signatures import _as_written_plan, baked_value_assigned, new_signature, revalidate, sizeless_key
from .observe.nvtx_ranges import NvtxRanges
from .planning.choice import Trial
from .planning.signatures import RARE_CALLS
from .runtime import dispatch as eager_dispatch
from .runtime.chaos import Chaos
from .runtime.graphs import GraphExecutor
from .runtime.program import Program, annotate_exception, failing_node
from .runtime.synclog import SyncLog
from .settled_calls import SettledCalls, has_free_values, settles, shapes_of
from .state import (
    UNIFORM_SCHEDULE_MARGIN,
    AsWritten,
    Compiled,
    WrapperState,
    alias_pattern,
    all_plain_tensors,
    count_unsettled,
    unsettled_calls,
)

__all__ = ["Runner"]

# Eager-dispatch calls in a row that launch no branch before a call structure runs as written.
_QUIET_CALLS = 3

# State traces read changing this often (re-traces within calls) settles the wrapper to
# run the model as written for a window of calls (``Runner.retrace``): the first window,
# and the longest, doubled each time the churn is found going on when one ends. A trace
# and its recording call, with the re-trace that finds the churn going on, cost about 20
# ms on a small branchy model (200 us a call, 1 thread): one per longest window is about
# 2.5% of its calls' time. Once the state holds still, planning resumes within a window.
CHURN_RETRACES = 3
CHURN_CALLS = 8
CHURN_FIRST_WINDOW = 64
CHURN_MAX_WINDOW = 4096

log = logging.getLogger(__name__)

_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


class Runner:
    """Runs the calls of one wrapper (``module``, ``config``, its ``WrapperState``): made
    with the wrapper, which enters :meth:`call` under its lock and :meth:`settled` without
    it. Holds no reference to the wrapper (nested children's wrappers are made from
    ``wrapper_class``)."""

    def __init__(self, module: nn.Module, config: SchedulerConfig, st: WrapperState, wrapper_class: type):
        self.module = module
        self.config = config
        self.st = st
        # What nested children are called through (nesting.py): the wrapper's class.
        self.wrapper_class = wrapper_class
        self.auto = config.executor == "auto"
        self.cuda_graph = config.cuda_graph is not False
        # Whether ``executor="auto"`` may pick the model's own forward: not where the
        # schedule itself is what was asked for (``sync_log`` and ``chaos`` exist to
        # exercise it, a CUDA graph replays it, ``grad_handoff="direct"`` is a backward
        # the trial's forward timings do not see).
        self.may_run_as_written = (
            not config.sync_log and config.chaos is None and not self.cuda_graph and config.grad_handoff != "direct"
        )
        # Whether calls may settle to run as written (``automatic`` less the observer).
        self.may_settle = self.auto and self.may_run_as_written
        # Whether calls that vary may run the model as written, under every executor: a
        # churn window (state the traces read changing call after call, ``retrace``) and
        # a plain argument's value new to its call structure (``new_signatures``). A
        # schedule there is traced and recorded anew on (nearly) every call, 30-100x
        # eager's cost, whichever executor was asked for, and a CUDA graph of it is never
        # replayed (the recording call runs node by node). Not under ``sync_log`` or
        # ``chaos``, which exist to check the schedule on every call: a call as written
        # would check nothing (and leave the previous call's sync log in place).
        self.may_vary = not config.sync_log and config.chaos is None
        # Whether an ``auto`` trial may time the calls (sync_log and chaos run the schedule).
        self.trials = not config.sync_log and config.chaos is None
        # Whether this wrapper is a nested child's (nesting.py): its schedule must save
        # what nesting it costs the parent's calls (new_signatures.NESTED_GAIN_S).
        self.nested_child = False

    def automatic(self) -> bool:
        """Whether this call may run the model as written instead of a schedule (``auto``,
        no observer, nothing asking for the schedule itself)."""
        return self.auto and self.st.observer is None and self.may_run_as_written

    def varies(self) -> bool:
        """Whether this call may run as written because what it reads varies (a churn
        window, a new plain value): ``may_vary``, no observer (timelines and profiles look
        at the schedule)."""
        return self.may_vary and self.st.observer is None

    def as_written_because(self, why: str) -> str:
        """``why`` a call that varies ran as written, for ``sm.plan``: where an executor
        was asked for, that it did not run the call and why."""
        if self.auto:
            return why
        return (
            f"{why} (executor={self.config.executor!r} was asked for: these calls run the model as written, since "
            "a schedule would be traced and recorded anew on each, many times the forward's own cost)"
        )

    def say_varying(self) -> None:
        """Where an executor was asked for, say once in the log that calls that vary run
        the model as written (``sm.plan`` says which, and why)."""
        st = self.st
        if self.auto or st.warned_varying:
            return
        st.warned_varying = True
        log.warning(
            "streamsched: %s: executor=%r was asked for, but calls whose state or plain arguments change call after "
            "call run the model as written (a schedule would be traced and recorded anew on each); sm.plan says "
            "which calls and why",
            type(self.module).__name__,
            self.config.executor,
        )

    def annotate(self, exc: BaseException, program: Optional[Program] = None) -> None:
        """Name where ``exc`` was raised: the node of ``program`` that raised it, or, for a
        call that ran the model's own forward (as written, eager dispatch), the submodule,
        from the traceback (not the forward itself: that is the caller's own code)."""
        st = self.st
        if program is not None:
            where = failing_node(program, exc)
            if where is not None:
                annotate_exception(exc, st.where_text(where))
            return
        path = raised_in(exc, self.module)
        if path or (path is not None and st.where[0]):
            annotate_exception(exc, st.where_text(path))

    # --- the call path ------------------------------------------------------------------

    def call(self, args: tuple, kwargs: dict, inside_model_call: bool = False) -> Any:
        """One call, under the lock: bind, find or make the plan, run it. Every call pays
        this path, so its common cases are written out (docs/design.md, "The wrapper's own
        work on each call"). ``inside_model_call``: made by the model's own ``__call__``
        (``sm.attach()``), whose hooks fired already."""
        st = self.st
        # (The hooks are read here first: the common call, with none, pays no frame.)
        if _saved_tensors_hooks(False) is not None and in_checkpoint_region():
            # Its recomputation must save what this call saves: the way every call has.
            return self.as_written(args, kwargs)
        own = self.module.__dict__.get("forward")
        if own is not None and not getattr(own, "enters_wrapper", False):
            return self.own_forward(args, kwargs)
        if st.state_written is not None:
            return self.state_written(args, kwargs, inside_model_call)
        if st.churned_until > st.calls and self.varies():
            return self.churned(args, kwargs, inside_model_call)
        if st.generation != _generation.current():
            self.revalidate()
        probe = st.probe
        if probe is not None and (probe.dtype, probe.device) != st.probed:
            log.info("streamsched: %s was moved or cast; re-tracing", type(self.module).__name__)
            self.retrace()
        elif st.dtype_probes and not dtypes_same(st.dtype_probes):
            log.info("streamsched: state %s's traces read changed; re-tracing", type(self.module).__name__)
            self.retrace()
        if st.churned_until > st.calls and self.varies():
            return self.churned(args, kwargs, inside_model_call)  # a re-trace just now began it
        module = self.module
        if inside_model_call:
            if global_hooks():  # they fire on every submodule call: the forward as written
                return self.as_written(args, kwargs)
        elif (
            module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks
        ) and has_hooks(module):
            return self.with_hooks(args, kwargs)
        elif global_hooks():
            return self.with_hooks(args, kwargs)
        spec = st.tensors_spec
        if spec is not None and not kwargs and len(args) == st.tensors_arity and all_plain_tensors(args):
            tensors = list(args)  # what the binder would return: the same spec, these leaves
        else:
            try:
                leaves, spec = st.bind(args, kwargs)
            except TypeError as exc:
                raise TypeError(
                    f"{type(self.module).__name__}.forward(): {st.binder.bind_error(exc, kwargs)}"
                ) from None
            tensors = [leaves[i] for i in spec.tensor_positions]
            if (
                spec is not st.tensors_spec
                and not kwargs
                and len(args) == st.tensors_arity
                and len(tensors) == len(args)
                and all_plain_tensors(args)
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
            entry = hot[1]  # the previous call's signature: no LRU bookkeeping
            if entry.as_written and entry.alias_pattern is None and st.observer is None:
                st.calls += 1  # settled to run as written: nothing else to decide
                st.last = entry
                if entry.nests:
                    return self.forward_nesting(key, spec, args, kwargs)
                self.settle_as_written(args, kwargs, entry)
                st.last_path = "as-written"
                return type(module).forward(module, *args, **kwargs)
        else:
            entry = st.plans.get_fresh(key)
            if entry is None and st.observer is None:
                entry = st.written.get(key)  # settled to run as written (planning.signatures)
        if entry is not None and entry.alias_pattern is not None:
            # The plan orders in-place effects for the way its inputs alias each
            # other on the call that made it; other aliasing needs another plan.
            pattern = alias_pattern(tensors, entry.held_storages)
            if pattern != entry.alias_pattern:
                entry = entry.variants.get(pattern) if entry.variants is not None else None
        st.calls += 1
        if entry is None:
            return new_signature(self, key, spec, tensors, args, kwargs)
        st.last = entry
        repeated = hot is not None and hot[1] is entry
        st.hot = (key, entry)
        if st.counting and not entry.as_written:
            st.stop_counting()
        if (
            not kwargs
            and spec is st.tensors_spec
            and len(args) == st.tensors_arity
            and not inside_model_call
            and hot_eligible(entry, st.observer)
            and all_plain_tensors(args)
            and self.hot_state_holds(entry)
        ):
            self.make_hot(key, entry, args, repeated)
        if entry.runs_models_code and not entry.as_written:
            # Code of the model's ran inside the call: an attribute the trace baked in
            # assigned by it is read stale from then on (check_written_state).
            assigned = _generation.assignments()
            out = self.run_entry(entry, key, spec, tensors, args, kwargs, inside_model_call)
            if _generation.assignments() != assigned:
                self.check_written_state()
            return out
        return self.run_entry(entry, key, spec, tensors, args, kwargs, inside_model_call)

    def make_hot(self, key: Any, entry: Compiled, args: tuple, repeated: bool) -> None:
        """Let later calls of ``entry``'s layout and shapes take the shortcut
        (``hot_plans``). The table is per layout and generation: one of another layout
        (the grad mode or autocast switched) or made at an older generation (a mode
        switched, ``.train()`` / ``.eval()``) is replaced only when the call repeats the
        previous one's signature, so that layouts or modes alternating call by call do
        not rebuild it on each call."""
        st = self.st
        table = st.hot_plans
        generation = _generation.current()
        if table is None:
            table = st.hot_plans = HotPlans(generation, args)
        elif table.generation != generation or not table.admits(args, {}, None):
            if not repeated:
                return
            table = st.hot_plans = HotPlans(generation, args)
        table.add(args, HotEntry(entry, key))

    def hot_state_holds(self, compiled: Compiled) -> bool:
        """Whether the state the full path reads on every call lets a call of ``compiled``
        run its plan's one function (``Runner.direct``): its verdict unchanged since the
        function was chosen, no state written by an earlier call, no churn window, no
        saved-tensor hooks (activation checkpointing runs the forward as written), no NVTX
        tool listening, the model neither moved nor cast, the dtypes the traces read
        unchanged."""
        st = self.st
        direct = compiled.direct
        probe = st.probe
        return not (
            direct is None
            or direct[0] is not compiled.verdict
            or st.state_written is not None
            or st.churned_until > st.calls
            or _saved_tensors_hooks(False) is not None
            or (direct[2] is not None and direct[2]())
            or (probe is not None and (probe.dtype, probe.device) != st.probed)
            or (st.dtype_probes and not dtypes_same(st.dtype_probes))
        )

    def hot(self, found: HotEntry, args: tuple) -> Any:
        """A call the hot table admitted (``StreamScheduledModule.__call__``): its plan's
        function, as :meth:`call` and :meth:`run` would run it, under the lock, or ``MISS``
        where the state the full path checks has changed (the caller then takes it)."""
        st = self.st
        compiled = found.compiled
        with st.lock:
            direct = compiled.direct
            if direct is not found.direct or not self.hot_state_holds(compiled):
                # Dropped: a lasting change (an NVTX tool listening) would otherwise cost
                # every call this check before the full path; the full path registers the
                # signature again once the state allows (make_hot).
                st.hot_plans = None
                return MISS
            plans = st.plans
            if plans.moves != found.moves:
                # Its recency, as the full path's lookup keeps it (moved last already where
                # no entry moved since).
                try:
                    plans.move_to_end(found.key)
                except KeyError:
                    st.hot_plans = None  # evicted: the full path plans it again
                    return MISS
                found.moves = plans.moves
            guard = compiled.program.stack_guard
            try:
                if guard is not None:
                    guard.check()
                st.calls += 1
                st.last = compiled
                st.hot = found.pair
                st.last_path = "plan:serial"
                try:
                    return compiled.rebuild(direct[1](list(args)))
                except Exception as exc:
                    self.annotate(exc, compiled.program)
                    self.annotate(exc)
                    raise
            except FusedMembersReshaped as exc:
                # As run_entry: the stacks' check raised before any task ran.
                log.info("streamsched: %s; re-planning", exc)
                self.retrace()
                return self.call(args, {}, False)

    def run_entry(
        self,
        entry: Any,
        key: Any,
        spec: Any,
        tensors: list[torch.Tensor],
        args: tuple,
        kwargs: dict,
        inside_model_call: bool,
    ) -> Any:
        """A call of a signature met before: its plan (or trial, or the model as written)."""
        st = self.st
        try:
            if st.observer is None:
                if entry.as_written:
                    return self.run_as_written(entry, key, spec, args, kwargs)
                if entry.checks:
                    return self.checked(entry, tensors, args, kwargs)
                if entry.trial is not None and self.trials:
                    return self.trial(entry, entry.trial, tensors, args, kwargs)
            elif entry.checks:
                return self.checked(entry, tensors, args, kwargs)
            return entry.rebuild(self.run(entry, tensors))
        except FusedMembersReshaped as exc:
            # Raised by the check of the plan's stacks, before any of its tasks ran (a
            # trial's call runs one candidate): the call is planned again.
            log.info("streamsched: %s; re-planning", exc)
            self.retrace()
            return self.call(args, kwargs, inside_model_call)

    def checked(self, compiled: Compiled, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """A call of a plan that reads opaque calls' values through checks of their
        structure (``frontend.opaque_outputs``): a value of another structure (a mask
        builder returning a mask for a padded batch where the trace saw ``None`` for an
        unpadded one of the same shape) stops the plan before the code that reads it.
        Where the plan writes no state (no in-place write to a storage the call did
        not allocate: ``Effects.writes_state``), the partial run left nothing behind but
        the random numbers it drew, which are put back: the call runs the model as
        written, and so do this signature's later calls (its structure changes between
        calls; a plan per structure would re-record at every change). A plan that
        writes state raises."""
        rng = save_generators(compiled.device if compiled.device.startswith("cuda") else None)
        written = compiled.written
        saved = written.save(tensors) if written is not None and written.finders else None
        try:
            if self.st.observer is None and compiled.trial is not None and self.trials:
                return self.trial(compiled, compiled.trial, tensors, args, kwargs)
            return compiled.rebuild(self.run(compiled, tensors))
        except OpaqueOutputChanged as exc:
            if written is not None:
                # The state the plan may have written before the check: put back (every
                # stream of the plan joined the caller's when it stopped).
                written.restore(saved)
            elif compiled.schedule.effects.writes_state:
                raise
            restore_generators(rng)
            why = (
                f"an opaque call's output structure changed between calls of this signature ({exc.changed}): "
                "calls with this signature run the model as written"
            )
            compiled.run_as_written(why)
            self.st.hot = None
            return self.as_written(args, kwargs)

    def revalidate(self) -> None:
        """Some module somewhere was re-wired, switched mode or had a flag set: drop the
        caches that no longer hold (``new_signatures.revalidate``)."""
        if revalidate(self):
            self.retrace()

    def retrace(self) -> None:
        """The state the traces read changed (a flag, a global, a held tensor, the model
        cast): drop every trace and plan, and note when. Where that happens again and
        again (``CHURN_RETRACES`` times within ``CHURN_CALLS`` calls: a temperature
        annealed, a held tensor replaced, an optimizer step on a weight a kept view shows,
        every call), each call would trace and record the model anew: the call structures
        run as written for a window of calls instead (``new_signature``), doubling while
        the churn goes on when the window ends (``CHURN_MAX_WINDOW`` at most); once it
        stops, the next trace is planned and tried as any other."""
        st = self.st
        st.clear(self.module)
        calls = st.calls
        if calls < st.churned_until:
            return  # running as written: nothing was traced
        recent = st.churn
        recent.append(calls)
        del recent[:-CHURN_RETRACES]
        if st.churn_window and calls - st.churned_until <= CHURN_CALLS:
            window = min(2 * st.churn_window, CHURN_MAX_WINDOW)  # it went on after the window
        elif len(recent) == CHURN_RETRACES and calls - recent[0] < CHURN_CALLS:
            window = CHURN_FIRST_WINDOW
        else:
            return
        st.churn_window = window
        st.churned_until = calls + window
        recent.clear()

        def why() -> Any:
            left = max(st.churned_until - st.calls, 0)
            return _as_written_plan(
                self,
                self.as_written_because(
                    "the state the traces read (module attributes, held objects and tensors, globals) changed call "
                    f"after call, each a re-trace: runs as written for {left} more calls, then is traced again"
                ),
            )

        st.churned = AsWritten(make=why)
        if self.varies():
            self.say_varying()
        name = type(self.module).__name__
        log.info("streamsched: %s re-traced call after call; running it as written for %d calls", name, window)

    def check_written_state(self, traced: Any = None) -> None:
        """Watched attributes were assigned during a call: where one of them is baked into
        ``traced`` (or any trace held), code run inside the call assigned it (a hook
        counting calls, an opaque module caching a length), and a traced call reads the
        value the attribute held when traced, where eager reads the value assigned.
        The model runs as written from then on, and says so once."""
        st = self.st
        traces = [traced] if traced is not None else [t for t in st.traces.values() if isinstance(t, Traced)]
        assigned: list[str] = []
        for t in traces:
            assigned = baked_value_assigned(self, t)
            if assigned:
                break
        else:
            return
        name = type(self.module).__name__
        why = (
            f"code run inside a call of {name} (a hook, an opaque module or a @streamsched.branch) assigned "
            f"{', '.join(sorted(set(assigned)))}, which the traced forward reads: a traced call would read the "
            "value from before the call, so the model runs as written from now on (sm.invalidate() traces again). "
            "Return such values from the forward, or keep them in tensors, to keep the schedule"
        )
        st.clear(self.module)
        st.state_written = AsWritten(make=lambda: _as_written_plan(self, why))
        warnings.warn(f"streamsched: {why}", UntraceableWarning, stacklevel=user_stacklevel())

    def state_written(self, args: tuple, kwargs: dict, inside_model_call: bool) -> Any:
        """A call once code inside calls was seen assigning what traces bake in
        (:meth:`check_written_state`): the model as written, hooks firing as on any call."""
        return self._untraced(args, kwargs, inside_model_call, self.st.state_written)

    def churned(self, args: tuple, kwargs: dict, inside_model_call: bool) -> Any:
        """A call while the state the traces read changes call after call
        (:meth:`retrace`): the model as written, with nothing traced, keyed or compared
        (the generation, moved by every flag assigned, is looked at once the window ends;
        no trace is left to check). Hooks fire as on any call."""
        return self._untraced(args, kwargs, inside_model_call, self.st.churned)

    def _untraced(self, args: tuple, kwargs: dict, inside_model_call: bool, record: AsWritten) -> Any:
        """The model as written with nothing traced, keyed or compared, ``record`` saying
        why (hooks of the model's own fire through its ``__call__``)."""
        st = self.st
        st.calls += 1
        module = self.module
        if not inside_model_call and (
            (module._forward_hooks or module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks)
            and has_hooks(module)
            or global_hooks()
        ):
            return self.with_hooks(args, kwargs)
        st.last = record
        return self.as_written(args, kwargs)

    def own_forward(self, args: tuple, kwargs: dict) -> Any:
        """A call of a model given a ``forward`` of its own instance (``model.forward =
        f``, as accelerate's hooks and test doubles do): eager's ``model(x)`` calls that,
        where a trace reads the class's ``forward``. The model as written, through its own
        ``__call__`` (its hooks fire as in eager), until the attribute is deleted."""
        st = self.st
        st.calls += 1
        name = type(self.module).__name__
        st.last = AsWritten(
            make=lambda: _as_written_plan(
                self,
                f"{name} has an instance attribute 'forward' of its own, which eager calls instead of "
                f"{name}.forward (the code a trace reads): runs as written while it is there",
            )
        )
        st.last_path = "as-written"
        return self.module(*args, **kwargs)

    # --- the model as written ---------------------------------------------------------

    def as_written(self, args: tuple, kwargs: dict) -> Any:
        # The class's forward, as the trace calls it: hooks on the model itself run on no
        # path of the wrapper (the wrapper's own hooks run around every call).
        self.st.last_path = "as-written"
        module = self.module
        return type(module).forward(module, *args, **kwargs)

    def settled(self, settled: SettledCalls, found: Any, args: tuple, kwargs: dict) -> Any:
        """A call in the layout of one settled to run as written (passing an object, its
        nested children quiet; or of a structure run as written at every size), at the
        generation it settled at: the forward itself (settled_calls.py). The caller
        checked the hooks, as for any call. (``StreamScheduledModule.__call__`` writes this
        out for its own calls: a frame is a tenth of such a call's budget.)

        Without the lock: the call runs the user's model as written, which two threads may
        do at once as in eager (a nested child another thread's call placed is reached
        through that child's wrapper, which takes its own lock); the counters below are
        hints (a lost decrement only delays the nested children's retry by a call). The
        lock would cost these calls as much as the rest of the wrapper together."""
        st = self.st
        settled.left -= 1
        if settled.left <= 0:
            st.settled = None  # the nested children's retry is due next call
        st.calls += 1
        if settled.nested is not None:
            settled.nested.calls += 1  # counted as NestedPlans.all_quiet counts a call
        st.last = settled.reported if found is True else found  # what admits(...) returned
        st.last_path = "as-written"
        module = self.module
        generation = _generation._generation
        try:
            out = type(module).forward(module, *args, **kwargs)
        except Exception as exc:
            self.annotate(exc)
            raise
        if _generation._generation != generation:
            st.follow_own_writes(generation)
        return out

    def settle_as_written(
        self, args: tuple, kwargs: dict, written: Any, bucket: Any = None, planned: list = ()
    ) -> None:
        """A call of tensors and plain values settled to run as written (``written``): at
        every size of its structure, or at its sizes; ``bucket``: where its size bucket
        settled as a whole (decided for the model as written, or for a schedule that would
        not repay a plan per size: each of its sizes runs as written), what
        ``sm.plan`` reports for a call of another of its sizes (``bucket(shapes)``, the
        shapes as ``shapes_of`` gives them), and ``planned``: the bucket's planned shapes,
        which the bucket does not admit (their plans run as decided). Later calls of its
        layout (at those sizes) skip binding and keys (settled_calls.py)."""
        st = self.st
        if st.observer is not None or not settles(args, kwargs):
            return
        settled = st.settled_layout(args, kwargs)
        if settled is not None and (settled.sizes is None or settled.sizes.holds(shapes_of(args, kwargs))):
            return  # settled already (this call came another way: a hook on the wrapper)
        if written.every_size:
            st.settle(SettledCalls(st.generation, args, kwargs, written, tensors=True))
            return
        shapes = shapes_of(args, kwargs)
        if settled is None:
            settled = SettledCalls(st.generation, args, kwargs, None, tensors=True, sizes={})
        settled.add_size(shapes, written)
        if bucket is not None:
            settled.add_bucket(shapes, bucket, planned)
        st.settle(settled)

    def settle_varying(self, args: tuple, kwargs: dict, written: Any) -> None:
        """A call whose plain arguments hold values new to its call structure ran as
        written (``written``): later calls of its layout whose plain numbers hold values
        not met run as written too, through a varying layout (settled_calls.py) that
        notes their values; a value met comes back to the full path, which plans it.
        Its table forgets values as the full path's does (``values_seen``)."""
        st = self.st
        if st.observer is not None or not settles(args, kwargs) or not has_free_values(args, kwargs):
            return
        settled = st.settled_layout(args, kwargs, varying=True)
        if settled is None:
            settled = SettledCalls(st.generation, args, kwargs, written, values=st.values_seen.maxsize)
        settled.sizes.add(args, kwargs)
        st.settle(settled)

    def run_as_written(self, written: Any, key: Any, spec: Any, args: tuple, kwargs: dict) -> Any:
        """A signature (``key``) settled to run the model as written (a trial's verdict,
        an object argument): its own output types, no rebuild."""
        if written.nests:
            return self.forward_nesting(key, spec, args, kwargs)
        self.settle_as_written(args, kwargs, written)
        generation = _generation._generation
        out = self.as_written(args, kwargs)
        if _generation._generation != generation:
            self.st.follow_own_writes(generation)
        return out

    def with_hooks(self, args: tuple, kwargs: dict) -> Any:
        """Hooks on the wrapped model itself, or global module hooks, fire around (or on)
        every module call eager makes, which no schedule reproduces: run the model as
        written, through its own ``__call__``, and say so once."""
        st = self.st
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

    # --- nested children ----------------------------------------------------------------

    def nesting(self) -> NestedPlans:
        """The model's nested children (nesting.py), made on first need."""
        st = self.st
        if st.nested is None:
            cls = self.wrapper_class
            st.nested = NestedPlans(self.module, self._nested_wrapper, lambda m: isinstance(m, cls), self.leaf_types())
            if self.may_settle and not self.nested_child:
                # The outermost wrapper measures whether nesting pays (nesting_trial.py).
                st.nested.trial = NestingTrial()
        return st.nested

    def leaf_types(self) -> tuple:
        return tuple(t for t in self.config.leaf_modules if isinstance(t, type))

    def _nested_wrapper(self, child: nn.Module) -> Any:
        """The wrapper a child of this untraceable forward is called through (nesting.py):
        this configuration, minus what belongs to the root (its profile of task costs,
        ``strict``: the root already said that the forward runs as written)."""
        wrapper = self.wrapper_class(child, self.config.model_copy(update={"strict": False, "profile": None}))
        # Its errors name the module by its path in this model.
        path = next((p for p, m in self.module.named_modules() if m is child), "")
        prefix, root = self.st.where
        wrapper._ss.where = (f"{prefix}{path}.", root)
        wrapper._runner.nested_child = True
        return wrapper

    def opaque_sites(self, plan: Any) -> list:
        """The nested sites of a traced plan: its opaque module calls that are not fused
        (a fused member's forward runs under vmap, not through a call)."""
        if not plan.opaque:
            return []
        fused = {m for g in plan.fused_groups for m in g.members}
        paths = [o.path for o in plan.opaque if o.path not in fused]
        return self.nesting().sites_at(paths)

    def forward_nesting(self, key: Any, spec: Any, args: tuple, kwargs: dict) -> Any:
        """The forward as written, its children nested (nesting.py), as an untraceable
        forward's as-written calls run: a call passing an object (``key``: the call's
        signature). The first call of each call structure counts the leaf calls
        (``Plan.coverage``), as eager dispatch does."""
        st = self.st
        nested = self.nesting()
        counted = st.dispatch.leaf_calls
        if counted.get(spec.key) is not None:
            if nested.all_quiet():
                if st.observer is None:
                    # Later calls of this layout skip binding and keys (settled_calls.py).
                    st.settle(SettledCalls(st.generation, args, kwargs, st.last, nested, nested.quiet_calls_ahead()))
                return self.as_written(args, kwargs)
            trial = nested.trial
            if trial is not None and trial.verdict is None and st.observer is None:
                # Sizes left out: a decoding step's attention mask grows by a token a call
                # (alternating calls see alike sizes; the drift favours as written).
                way = trial.way(sizeless_key(key))
                if way is not None:
                    return self._nesting_trial_call(nested, trial, way, key, args, kwargs)
        # A child that settles to run as written stops being nested at once: every call
        # passes the object (a decoding step), and a child nested for nothing costs each
        # of them its wrapper (and its parents' down to it).
        with nested.installed(hand_back=True):
            if counted.get_fresh(spec.key) is not None:
                return self.as_written(args, kwargs)
            with counting_dispatch(self.module, self.config.leaf_modules, st._nested_site) as counter:
                out = self.as_written(args, kwargs)
        calls: dict[str, int] = {}
        for hit in counter.hits:
            if type(hit) is str:
                calls[hit] = calls.get(hit, 0) + 1
        counted.put(spec.key, (0, len(counter.hits), calls))
        return out

    def _nesting_trial_call(
        self, nested: NestedPlans, trial: NestingTrial, way: str, key: Any, args: tuple, kwargs: dict
    ) -> Any:
        """One timed call of the nesting trial (nesting_trial.py): the forward as written
        with its children nested, or with nothing nested (``way`` plain)."""
        device = self._call_device(key)
        if way == PLAIN:
            nested.calls += 1  # a call of the parent's, toward the children's retry
            out, seconds = self._clocked(lambda: self.as_written(args, kwargs), device)
            trial.add(way, seconds)
        else:
            unsettled = unsettled_calls()

            def run_nested() -> Any:
                with nested.installed(hand_back=True):
                    return self.as_written(args, kwargs)

            out, seconds = self._clocked(run_nested, device)
            if unsettled == unsettled_calls() or not trial.skip():
                trial.add(way, seconds)
        if trial.verdict is not None:
            if trial.verdict == PLAIN:
                nested.stop_nesting()
            else:
                nested.nesting_pays()
            log.info("streamsched: %s: %s", type(self.module).__name__, trial.reason)
        return out

    def _call_device(self, key: Any) -> str:
        """Where a call's work runs, for timing it: its first CUDA tensor argument's
        device, else (a call passing only objects, a cache holding the tensors) the
        model's own, else the CPU."""
        for _shape, _dtype, device, _grad in key[1]:
            if device.type == "cuda":
                return str(device)
        probed = self.st.probed
        if probed is not None and probed[1] is not None and probed[1].type == "cuda":
            return str(probed[1])
        return "cpu"

    # --- eager dispatch -----------------------------------------------------------------

    def nvtx(self) -> Any:
        """The NVTX range observer, on every executor and device (NVTX tools profile
        CPU-only runs too) and under eager dispatch, while a tool is there to see the
        ranges (Nsight Systems attached, or the torch profiler recording): free otherwise."""
        ranges = self.st.nvtx
        if ranges is None:  # first call: the config is frozen, so this is decided once
            # A nested child's ranges carry its path in the model (nvtx_ranges.range_name).
            where = self.st.where[0].rstrip(".")
            ranges = self.st.nvtx = (NvtxRanges.create(where) if self.config.nvtx else None) or False
        if ranges and ranges.wanted():
            return ranges
        return None

    def eager_dispatch(
        self,
        key: Any,
        spec: Any,
        tensors: list[torch.Tensor],
        reason: TraceError,
        trace_key: Any,
        args: tuple,
        kwargs: dict,
    ) -> Any:
        """A forward that cannot be traced: its ``@streamsched.branch`` calls dispatched
        as it runs, or, once it launched none a few calls in a row, the model as written,
        its children nested, as a call passing an object runs (``key``, the call's
        signature, then goes straight there, and settles once the children are quiet)."""
        st = self.st
        quiet = st.quiet.get_fresh(trace_key)
        automatic = self.automatic()
        nested = self.nesting()
        if automatic and isinstance(quiet, AsWritten):
            quiet.nests = True
            st.last = quiet
            st.written.put(key, quiet)
            st.hot = (key, quiet)
            return self.forward_nesting(key, spec, args, kwargs)
        with nested.installed():
            done = eager_dispatch.run_eager_dispatch(
                st.dispatch.for_call(st.calls, st.observer or self.nvtx()), spec, tensors, reason, args, kwargs
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
            self._count_quiet(done.schedule.plan, quiet, reason, trace_key)
        return out

    def _count_quiet(self, plan: Any, quiet: Any, reason: TraceError, trace_key: Any) -> None:
        """A forward that calls no @streamsched.branch has nothing to dispatch: after a few
        such calls in a row, it runs as written (the same calls, minus the dispatch
        bookkeeping)."""
        count = 0 if plan.tasks else (quiet if isinstance(quiet, int) else 0) + 1
        if count < _QUIET_CALLS:
            self.st.quiet.put(trace_key, count)
            return
        why = first_line(reason)
        update = {
            "executor": "eager",
            "reason": (
                f"eager dispatch: the model cannot be traced ({why}); its forward made no "
                f"@streamsched.branch call in {count} calls with these arguments: it runs as written"
            ),
        }
        self.st.quiet.put(trace_key, AsWritten(plan.model_copy(update=update)))

    # --- a compiled plan ----------------------------------------------------------------

    def _execute(
        self,
        compiled: Compiled,
        executor: Any,
        tensors: list[torch.Tensor],
        sync_log: Optional[SyncLog] = None,
        chaos: Optional[Chaos] = None,
        observer: Any = None,
        nested: bool = True,
    ) -> Any:
        """Run ``compiled``'s program on ``executor`` (a CUDA graph replays it without the
        nested sites installed): its stacked parameters checked first, an exception named
        by the node that raised it."""
        program = compiled.program
        guard = program.stack_guard
        if guard is not None:
            guard.check()
        try:
            if nested and compiled.nested_sites:
                with self.st.nested.installed(compiled.nested_sites):
                    return executor.run(program, tensors, sync_log, chaos, observer)
            return executor.run(program, tensors, sync_log, chaos, observer)
        except Exception as exc:
            self.annotate(exc, program)
            raise

    def executor_for(self, compiled: Compiled, tensors: list[torch.Tensor], name: Optional[str] = None) -> Any:
        """The executor that runs this call of ``compiled`` (``name``: the one a trial
        times), or its CUDA-graph executor where a graph replays the call."""
        if name is not None:
            return self.st.executors.named(name, compiled.device)
        if compiled.graphs and GraphExecutor.captures(tensors):
            graphs = self.st.executors.graphs_for(compiled.device, self.module, self.config)
            # Tensors swapped in (functional_call): streams, the graphs kept; a parameter
            # that requires grad in grad mode: a training call, never captured.
            if not graphs.swapped() and not graphs.parameters_need_grad():
                return graphs
        return self.st.executors.named(compiled.executor, compiled.device)

    def direct(self, compiled: Compiled, executor: Any) -> Optional[tuple]:
        """``(verdict, program.call, nvtx_wanted)`` when every call of ``compiled`` under
        ``verdict`` that no observer or NVTX tool looks at runs the serial program's one
        function and nothing else: the serial executor, no sync log, chaos or nested sites
        (all fixed by the frozen config and the plan), no CUDA graph (a CPU plan, or graphs
        off). ``run`` then checks the stacks, that no observer is installed and, where
        NVTX ranges are on, that nothing would see them (``nvtx_wanted``: ``None`` where
        they are off). The verdict is kept to notice a trial's decision."""
        cfg = self.config
        if (
            executor is not self.st.executors.serial
            or compiled.program.call is None
            or cfg.sync_log
            or cfg.chaos is not None
            or compiled.nested_sites
            or compiled.graphs
        ):
            return None
        ranges = self.st.nvtx
        return (compiled.verdict, compiled.program.call, ranges.wanted if ranges else None)

    def run(self, compiled: Compiled, tensors: list[torch.Tensor]) -> Any:
        """A call of a compiled plan: the program's leaves (``compiled.rebuild`` makes the
        model's output of them)."""
        st = self.st
        direct = compiled.direct
        if (
            direct is not None
            and direct[0] is compiled.verdict
            and st.observer is None
            and (direct[2] is None or not direct[2]())
        ):
            # The serial program's one function, nothing else to decide (see direct).
            guard = compiled.program.stack_guard
            if guard is not None:
                guard.check()
            st.last_path = "plan:serial"
            try:
                return direct[1](tensors)
            except Exception as exc:
                self.annotate(exc, compiled.program)
                raise
        cfg = self.config
        sync_log = None
        if cfg.sync_log:
            program = compiled.program
            sync_log = st.last_sync_log = SyncLog()
            sync_log.input_slots = (
                tuple(program.input_slots) + tuple(s for s, _ in program.attr_slots) + program.location_slots
            )
            sync_log.expected_writers = program.expected_writers
        chaos = Chaos(cfg.chaos, st.calls) if cfg.chaos is not None else None
        executor = self.executor_for(compiled, tensors)
        if isinstance(executor, GraphExecutor):
            st.last_path = "graph"
            out = self._execute(compiled, executor, tensors, sync_log, chaos, st.observer, nested=False)
            if not executor.replayed:
                st.last_path = "plan:streams"  # run on the streams the graph would capture
            return out
        st.last_path = "plan:" + compiled.executor
        observer = st.observer or self.nvtx()
        if direct is None or direct[0] is not compiled.verdict:
            compiled.direct = self.direct(compiled, executor)
        return self._execute(compiled, executor, tensors, sync_log, chaos, observer)

    # --- the auto trial -----------------------------------------------------------------

    def trial(self, compiled: Compiled, trial: Trial, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """A call of a signature under trial: one of the candidates (the plan's executor,
        serial, the model as written), timed as the calls after the trial would run it."""
        if self._trial_decided(compiled, trial):
            return self.decided(compiled, tensors, args, kwargs)
        name = trial.next()
        unsettled = count_unsettled()
        out, forward_s = self._timed(compiled, name, tensors, args, kwargs)
        if unsettled != unsettled_calls() and trial.skip(name):
            return out
        if trial.backward is not False:
            # In training the step is forward and backward: time the backward too, once
            # the caller runs it (backward_timing).
            sample = None
            if grad_outputs(out):  # (the parameters are hooked only for a backward to come)
                ends = self._parameter_ends(trial)
                sample = BackwardSample.attach(out, tensors, torch.device(compiled.device), ends=ends)
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
            compiled.finish(trial)
        return out

    def _parameter_ends(self, trial: Trial) -> Optional[ParameterEnds]:
        """The end hooks on the model's parameters that want a gradient, shared by the
        trial's calls (``None``: none wants one); hooked anew when they changed."""
        params = [p for p in self.module.parameters() if p.requires_grad]
        ends = trial.ends
        if ends is not None and ends.holds(params):
            return ends
        if not params:
            trial.release_ends()
            return None
        ends = ParameterEnds(params)
        trial.keep_ends(ends)
        return ends

    def _trial_decided(self, compiled: Compiled, trial: Trial) -> bool:
        """Whether the trial is over before this call: its bucket was decided meanwhile,
        its size came back too rarely to go on, or its training calls' backwards (run
        since) complete its figures."""
        structure = compiled.structure
        if structure is not None:
            decision = structure.decision(structure.bucket_of(compiled.sizes))
            if decision is not None:
                # The bucket was decided while this trial went on (stalled, or decided
                # at another size): take that verdict.
                compiled.apply(decision)
                return True
        trial.own_calls += 1
        if not trial.rare and trial.began is not None:
            if self.st.calls - trial.began - trial.own_calls >= RARE_CALLS:
                # Its size comes back rarely (planning.signatures): decide on two calls of
                # each candidate, keeping the schedule only where it wins clearly.
                trial.rare = True
                trial.schedule_margin = max(trial.schedule_margin, UNIFORM_SCHEDULE_MARGIN)
                if trial.done():
                    compiled.finish(trial)
                    return True
        if trial.pending:
            # Training calls whose backward has run since count now.
            trial.collect()
            if trial.done():
                compiled.finish(trial)
                return True
        return False

    def _timed(self, compiled: Compiled, name: str, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> tuple:
        """(output, seconds) of one trial call run by ``name``: the schedule with its
        stacked-parameter checks and output rebuild, or the model's forward as it is."""
        executor = self.executor_for(compiled, tensors, name) if name != "eager" else None
        if executor is None:
            return self._clocked(lambda: self.as_written(args, kwargs), compiled.device)

        def scheduled() -> Any:
            self.st.last_path = f"plan:{name}"
            return compiled.rebuild(self._execute(compiled, executor, tensors))

        return self._clocked(scheduled, compiled.device)

    def _clocked(self, run: Any, device: str) -> tuple:
        """(output, seconds) of ``run()``, timed as the trials time a call (``device``:
        where its work runs; a CUDA device is synchronised around it)."""
        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.synchronize(device)
        # A collection landing in a timed call would be timed as the way's (a full one
        # took 4 ms on a loaded machine, twenty times a small model's call, and dropped
        # the schedule on its first call): the cyclic collector waits for the call.
        collecting = gc.isenabled()
        gc.disable()
        try:
            # (A clock with no thread_time is one a caller put in its place: its own.)
            thread_time = None if cuda else getattr(time, "thread_time", None)
            # The run-queue readings lie inside the wall clock's: a wait the system
            # imposed between two readings is one the wall time holds, so the difference
            # never takes off more than the call's own span held (a preemption just before
            # the first reading or after the last one is in neither).
            start = time.perf_counter()
            waited = None if thread_time is None else runqueue_wait_ns()
            cpu_start = thread_time() if waited is not None else 0.0
            out = run()
            if cuda:
                torch.cuda.synchronize(device)
            if waited is None or thread_time is None:
                return out, time.perf_counter() - start
            # The time the system kept this thread off the cores while it was ready to run
            # (other processes on a loaded machine) is no cost of the way: left out. Its
            # waits for lanes, locks or sleeps stay. (UperNet's trial calls took 4-5x
            # their running time at a load of 4 on 2 cores, and a serial plan 15% slower
            # than eager was kept on that noise.) Never less than the thread's CPU time.
            cpu = thread_time() - cpu_start
            after = runqueue_wait_ns()
            wall = time.perf_counter() - start
            if after is None:
                return out, wall
            return out, max(wall - (after - waited) * 1e-9, cpu)
        finally:
            if collecting:
                gc.enable()

    def decided(self, compiled: Compiled, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
        """A call of a signature whose trial has just been decided, run the way decided."""
        if compiled.as_written:
            return self.as_written(args, kwargs)
        return compiled.rebuild(self.run(compiled, tensors))
