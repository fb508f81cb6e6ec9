"""What a wrapper does with a call whose signature it has no plan for: the size policy
(``planning.signatures``: plan it, or run the model as written where a plan would not
pay), and the pipeline that plans it: trace (cached per call structure) -> record the
call's shapes and in-place effects (the recording run is the call's result) -> task
costs of a profile -> ``make_schedule`` -> ``compile_program`` -> the ``auto`` trial's
setup. :func:`compile_signature` is the pipeline's one entry; it returns the compiled
signature. Also here: whether the caches still hold after the model changed
(:func:`revalidate`)."""

from __future__ import annotations

import logging
import operator
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from . import _generation
from ._rng import restore_generators, save_generators
from .errors import FusedMembersReshaped, ProfileMismatchError, StreamSchedError, TraceError, first_line
from .frontend.effects import EffectRecorder, Effects, parameter_writers, reads_only
from .frontend.meta import fetch_attr, run_and_record
from .frontend.nodes import node_label, resolving_submodules, submodule_resolver
from .frontend.opaque_outputs import OutputCheck, check_recorded_structures
from .frontend.rank_checks import RankAssumptionError
from .frontend.trace import Traced, dtype_probes, trace_model
from .frontend.trace_guard import autocast_state
from .observe.schedule_profiles import check_profile, load_profile, profile_costs
from .planning import signatures
from .planning.choice import Trial
from .planning.plan import Plan, signature_text_of
from .planning.planner import device_of, make_schedule, signature_text
from .planning.signatures import Structure, sizes_text
from .runtime.program import ProgramCache, annotate_exception, compile_program
from .settled_calls import SettledCalls, settles, tensors_of
from .state import (
    UNIFORM_SCHEDULE_MARGIN,
    AsWritten,
    Compiled,
    alias_pattern,
    count_unsettled,
    placement_probe,
    state_storages,
)
from .written_state import WrittenState

if TYPE_CHECKING:
    from .runner import Runner

__all__ = ["compile_signature", "new_signature", "revalidate"]

log = logging.getLogger(__name__)

# What nesting a child costs each call of its parent (nesting.py), on one CPU thread: the
# parent's call takes the full path and installs the child's wrapper, whose call goes
# through it (15-25 us measured). A nested child's schedule that saves less a call is no
# gain: the child runs as written and stops being nested, and the parent's calls settle.
NESTED_GAIN_S = 20e-6


def _identity(value: Any) -> Any:
    return value


def sizeless_key(key: tuple) -> tuple:
    """A call's signature (``Runner.call``'s key) less its tensors' sizes: each tensor's
    dtype, device, grad flag and rank, the call structure, mode, grad mode and autocast."""
    return (key[0], tuple([m[1:] + (len(m[0]),) for m in key[1]]), *key[2:])


def new_signature(runner: Runner, key: Any, spec: Any, tensors: list[torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """A call with no plan for its signature: plan it, or run the model as written where
    a plan would not pay (``planning.signatures``). Returns the call's output."""
    st = runner.st
    if spec.has_objects is not None:
        return _object_call(runner, key, spec, args, kwargs)
    sizes = key[1]
    structure_key = sizeless_key(key)
    structure = st.structures.get_fresh(structure_key)
    shapes = tuple([tuple(m[0]) for m in sizes])
    valued = None
    if structure is None and spec.static_leaves and runner.varies():
        valued = _value_met(runner, spec, structure_key, args, kwargs)
        if valued is NEW_VALUE:
            # A plain argument (a temperature, a dropout ``p``, a timestep) with a value
            # this call structure has not met, where it has met others: the model as
            # written, as for a size not met before; traced and planned if the value comes
            # back. Under every executor (``Runner.may_vary``): a value new on every call
            # would be traced and recorded on every call. Later calls of its layout with
            # values not met take the settled shortcut (a varying layout,
            # settled_calls.py): binding and keying each would cost as much again.
            why = runner.as_written_because(
                "a plain argument has a value this call structure has not met: planned if it comes back"
            )
            runner.say_varying()
            written = st.last = AsWritten(make=lambda: _as_written_plan(runner, why))
            runner.settle_varying(args, kwargs, written)
            return runner.as_written(args, kwargs)
    if (
        structure is None
        and valued is not VALUE_BACK
        and not key[3]
        and not runner.module.training
        and signatures.FIRST_CALL_AS_WRITTEN
        and runner.automatic()
        and not isinstance(st.traces.get(_trace_key(st, spec, tensors)[0]), TraceError)
    ):
        # In inference (the model in eval(), no gradients), a call structure's first call
        # runs as written too (planning.signatures): what it costs to trace, record and
        # plan is paid only where one of its sizes comes back. A decoding loop, a new size
        # every call, never pays it.
        structure = _new_structure(runner, structure_key)
    if structure is not None and runner.automatic():
        # (On the CPU a call's time as written is its work: a size that comes back rarely
        # may be judged on it, Structure._too_rare.)
        timeable = all(t.device.type == "cpu" for t in tensors)
        verdict = structure.admit(shapes, structure.bucket_of(shapes), timeable)
        if verdict is not None:
            like, why = structure.plan, verdict.why
            if verdict.fresh or verdict.rare:
                _count_new_sizes(runner, structure, sizes, tensors, args, kwargs)
            written = st.last = AsWritten()
            # Made when asked: by then ``every_size`` says whether it stands for this
            # call's sizes or for every size of the structure.
            written.make = lambda: _as_written_plan(
                runner, why(), like, signature_text_of(sizes, any_size=written.every_size)
            )
            if structure.nests and verdict.settled:
                # A chain around untraceable modules: as written, their children nested
                # (``_nested_chain_reason``); it settles once the children are quiet.
                written.nests = written.every_size = True
                st.written.put(key, written)
                return runner.forward_nesting(key, spec, args, kwargs)
            if verdict.settled:
                # Later calls with this signature run as written without asking again.
                st.written.put(key, written)
                written.every_size = structure.as_written_at_every_size()
                bucket = None
                if verdict.whole_bucket and not written.every_size:
                    # And so do the bucket's other sizes, which its verdict stands for, but
                    # those planned (whose plans run as decided).
                    bucket = _bucket_plans(runner, why, like, sizes, tensors, args, kwargs)
                if bucket is not None:
                    plan_for, order = bucket
                    planned = [order(s) for s in structure.planned_in(structure.bucket_of(shapes))]
                    runner.settle_as_written(args, kwargs, written, plan_for, planned)
                else:
                    runner.settle_as_written(args, kwargs, written)
            if verdict.timed:
                return _timed_as_written(runner, structure, shapes, tensors, args, kwargs)
            return runner.as_written(args, kwargs)
    if structure is None and st.mode_id in st.hooked_modes and runner.automatic():
        # Modules hold hooks this structure has not met (a hook held for one call to log
        # activations): the model as written, hooks firing as in eager; the structure is
        # traced and planned if it comes back with the same hooks.
        if st.hooked_seen.get_fresh(structure_key) is None:
            st.hooked_seen.put(structure_key, True)
            why = "modules hold hooks this call structure has not met: planned if it comes back with them"
            st.last = AsWritten(make=lambda: _as_written_plan(runner, why))
            return runner.as_written(args, kwargs)
    count_unsettled()
    # A trace bakes in the training flags of the modules it traced through, and is
    # made under one autocast state: a forward's own autocast block shows as a change
    # of that state only against the state the trace started in (frontend.trace).
    # The inputs' ranks too: a traced shape's length is its value's rank (frontend.ranks).
    # And their dtypes: the dtypes of its values follow from them (and the parameters').
    trace_key, ranks, dtypes = _trace_key(st, spec, tensors)
    traced = _trace(runner, trace_key, spec, ranks, dtypes)
    if isinstance(traced, TraceError):
        if structure is not None and structure.plan is None:
            # Made by the structure's first call, run as written: an untraceable structure
            # has no sizes to decide (eager dispatch, as its first call would have run).
            st.structures.pop(structure_key, None)
        return runner.eager_dispatch(key, spec, tensors, traced, trace_key, args, kwargs)
    if (
        (structure is None or structure.plan is None)
        and not key[3]
        and not runner.module.training
        and signatures.CHAIN_AS_WRITTEN
        and runner.automatic()
        and a_chain(traced)
    ):
        # In inference, nothing to run side by side or batch: a plan could win only the
        # forward's Python, which its recording call and trial cost far more than (a
        # small language model's 5-6 ms recording call and plan, and its trial, in a 37
        # ms decoding pass). Decided for the model as written at every size, with nothing recorded.
        # (In training the first call is planned at once, as before: its cost is paid
        # once in a loop of many steps, and the trial times the backward too.)
        why = (
            "the traced forward is a chain (each operation reads the one before it): nothing to run side by "
            "side or batch, and a plan would win only the forward's Python, less than its recording call costs"
        )
        _as_written_at_every_size(runner, structure, structure_key, shapes, why)
        return new_signature(runner, key, spec, tensors, args, kwargs)
    if (
        (structure is None or structure.plan is None)
        and traced.opaque
        and signatures.CHAIN_AS_WRITTEN
        and runner.automatic()
        and a_chain(traced, opaque_modules=True)
    ):
        _as_written_at_every_size(runner, structure, structure_key, shapes, _nested_chain_reason(traced), nests=True)
        return new_signature(runner, key, spec, tensors, args, kwargs)
    assigned = _generation.assignments()
    # What a plan of a new size costs (Structure.record_s): the recording call, planning
    # and compiling; not the trace, made once for the structure's sizes.
    start = time.perf_counter()
    try:
        compiled, out = compile_signature(runner, traced, key, tensors)
    except _RecordingAbandoned as abandoned:
        if abandoned.proven:
            _untraceable(runner, trace_key, structure, structure_key, abandoned.error)
            return runner.eager_dispatch(key, spec, tensors, abandoned.error, trace_key, args, kwargs)
        # The model as written decides: its error (if it raises too) is the call's, and the
        # next call traces again; if it runs, the trace is to blame.
        try:
            out = runner.eager_dispatch(key, spec, tensors, abandoned.error, trace_key, args, kwargs)
        except Exception:
            # Raised as written too (a wrong shape or dtype, say): nothing was learnt
            # about the trace, and ``sm.plan`` says so rather than call it untraceable.
            _call_raised_as_written(runner, tensors)
            raise
        _untraceable(runner, trace_key, structure, structure_key, abandoned.error)
        return out
    _join_structure(runner, compiled, structure_key, structure, shapes, time.perf_counter() - start)
    if _generation.assignments() != assigned:
        runner.check_written_state(traced)
    return out


def _call_raised_as_written(runner: Runner, tensors: list[torch.Tensor]) -> None:
    """What ``sm.plan`` and the path report for a first call of a signature that raised
    in the traced forward and again in the model's own: the call ran as written and its
    error is the call's; nothing is kept for the signature."""
    why = (
        "this call raised in the model's own forward as well as in its trace: the error is the call's (an input "
        "the model does not take, say); nothing was planned, and the next call with these sizes is traced again"
    )
    signature = signature_text(tensors)
    st = runner.st
    st.last = AsWritten(make=lambda: _as_written_plan(runner, why, signature=signature))
    st.last_path = "as-written"


def _untraceable(
    runner: Runner, trace_key: Any, structure: Optional[Structure], structure_key: Any, error: TraceError
) -> None:
    """Later calls of ``trace_key`` go to eager dispatch at once; a structure that never
    had a plan is dropped with it (it has no sizes to decide)."""
    runner.st.traces.put(trace_key, error)
    if structure is not None and structure.plan is None:
        runner.st.structures.pop(structure_key, None)


def _timed_as_written(
    runner: Runner, structure: Structure, shapes: tuple, tensors: list[torch.Tensor], args: tuple, kwargs: dict
) -> Any:
    """The model as written, its seconds handed to ``structure`` (what a plan of these
    sizes could save at most: ``Structure._too_rare``), times ``signatures.GRAD_BOUND``
    where autograd may record the call (its backward a plan may shorten too)."""
    start = time.perf_counter()
    out = runner.as_written(args, kwargs)
    seconds = time.perf_counter() - start
    if torch.is_grad_enabled() and (
        any(t.requires_grad for t in tensors) or any(p.requires_grad for p in runner.module.parameters())
    ):
        seconds *= signatures.GRAD_BOUND
    structure.note_as_written(shapes, seconds)
    return out


def _new_structure(runner: Runner, structure_key: tuple) -> Structure:
    """A new call structure's size policy, kept under ``structure_key``; its clock is the
    wrapper's count of calls."""
    structure = Structure(runner.config.plan_cache_size, runner.st.call_count)
    runner.st.structures.put(structure_key, structure)
    return structure


def _as_written_at_every_size(
    runner: Runner,
    structure: Optional[Structure],
    structure_key: tuple,
    shapes: tuple,
    why: str,
    nests: bool = False,
) -> None:
    """Decide the call structure (made now where it has none) for the model as written at
    every size (``ANY_SIZE``), ``why`` at ``shapes``; ``nests``: with the children of its
    untraceable modules nested (:func:`_nested_chain_reason`)."""
    if structure is None:
        structure = _new_structure(runner, structure_key)
    structure.uniform = True
    structure.nests = nests
    structure.decide(signatures.ANY_SIZE, signatures.Decision(True, "serial", why, shapes))


def _nested_chain_reason(traced: Traced) -> str:
    """Why a traced forward that is a chain around modules that could not be traced (a
    language model's head around its untraceable decoder) runs as written. Its plan would
    run the same chain, those modules as written with their children nested, and could
    win only the forward's Python; each of its sizes and modes would still pay a recording
    call and a trial, and the trial's calls of the plan, which are the only ones to reach
    the children, would wait on the children's own first calls and trials. So it runs as
    an untraceable forward does, for every size and grad mode: as written, its children
    nested (``Runner.forward_nesting``, whose trial of nesting decides whether they pay),
    with nothing recorded or planned at this level."""
    opaque = "; ".join(f"{name}: {first_line(reason)}" for name, reason in sorted(traced.opaque.items()))
    return (
        f"the traced forward is a chain around modules that cannot be traced ({opaque}): nothing to run side by "
        "side or batch at this level, so it runs as written, the children of those modules nested"
    )


def baked_value_assigned(runner: Runner, traced: Traced) -> list[str]:
    """The attributes (``Class.name``) that ``traced`` baked in and that hold other values
    now (a re-trace makes another program): assigned by code run inside a call. Empty
    where there are none."""
    if traced.flags_unchanged():
        return []
    changed = traced.changed_flags()
    return [] if _retraces_same(runner, traced) else changed


# Nodes that only take a value apart or read its metadata: no work to place.
_GLUE_FUNCTIONS = frozenset({operator.getitem, getattr, len})
_GLUE_METHODS = frozenset({"size", "dim", "numel", "stride", "type_as"})


def a_chain(traced: Traced, opaque_modules: bool = False) -> bool:
    """Whether ``traced``'s forward is a chain: every operation (but the glue that takes
    a value apart or reads its shape) reads, directly or not, the one before it, so no
    two could run side by side and none could be batched with another (fusion batches
    independent calls). Not where a module was made opaque because it could not be
    traced (its children may get plans of their own, nesting.py), unless
    ``opaque_modules``: then the chain is of the traced forward alone."""
    if traced.opaque and not opaque_modules:
        return False
    ancestors: dict[Any, int] = {}
    bit: dict[Any, int] = {}
    previous = None
    for i, node in enumerate(traced.graph.nodes):
        bit[node] = 1 << i
        anc = 0
        for inp in node.all_input_nodes:
            anc |= ancestors[inp] | bit[inp]
        ancestors[node] = anc
        if node.op not in ("call_module", "call_function", "call_method"):
            continue
        if node.op == "call_function" and node.target in _GLUE_FUNCTIONS:
            continue
        if node.op == "call_method" and node.target in _GLUE_METHODS:
            continue
        if previous is not None and not anc & bit[previous]:
            return False
        previous = node
    return True


# What ``_value_met`` says of a call structure with plain arguments: the first of its shape
# (its values met now), one that differs from a structure met before only in the values of
# plain arguments and is met for the first time, or such a one met before (it came back).
FIRST_OF_SHAPE = "first of its shape"
NEW_VALUE = "a new value"
VALUE_BACK = "a value met before"


def _value_met(runner: Runner, spec: Any, structure_key: tuple, args: tuple, kwargs: dict) -> str:
    """Whether ``structure_key`` differs from a call structure met before only in the
    values of plain arguments (``NEW_VALUE``, noted: the next time it is planned;
    ``VALUE_BACK`` where it was met before, here or by a varying layout's calls), or is
    the first of its shape (``FIRST_OF_SHAPE``)."""
    st = runner.st
    shape = (
        str(spec.treedef),
        spec.tensor_positions,
        tuple([(i, type(v)) for i, v in spec.static_leaves]),
        spec.positional,
        structure_key[1:],
    )
    if st.valued_shapes.get_fresh(shape) is None:
        # The first structure of its shape: its values are met now (a model that makes
        # no Structure, untraceable or as written, is asked again on its next call).
        st.valued_shapes.put(shape, True)
        st.values_seen.put(structure_key, True)
        return FIRST_OF_SHAPE
    if st.values_seen.get_fresh(structure_key) is not None or st.values_met(args, kwargs):
        st.values_seen.put(structure_key, True)
        return VALUE_BACK
    st.values_seen.put(structure_key, True)
    return NEW_VALUE


def _trace_key(st: Any, spec: Any, tensors: list) -> tuple:
    """``(trace key, ranks, dtypes)`` of a call: its traces are cached under that key.
    Grad mode and inference mode are part of it: traced code may ask for them
    (``torch.is_grad_enabled()``), which bakes the answer into the trace."""
    ranks = tuple(t.dim() for t in tensors)
    dtypes = tuple(t.dtype for t in tensors)
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    return (spec.key, st.mode_id, autocast_state(), modes, ranks, dtypes), ranks, dtypes


def _count_new_sizes(
    runner: Runner, structure: Structure, sizes: tuple, tensors: list, args: tuple, kwargs: dict
) -> None:
    """A new size ran as written: let the call's settled layout count the structure's next
    new sizes and run them as written itself (``SizeTable.structure``), where the layout
    reads the call's tensors in the plan key's order (both count in ``structure.seen``)."""
    st = runner.st
    if st.observer is not None or not settles(args, kwargs):
        return
    settled = st.settled_layout(args, kwargs)
    if settled is not None and (settled.sizes is None or settled.sizes.structure is structure):
        return
    ordered = tensors_of(args, kwargs)
    if len(ordered) != len(tensors) or any(a is not t for a, t in zip(ordered, tensors)):
        return
    metas = [m[1:] for m in sizes]

    def rare_plan(shapes: tuple, why: str) -> Plan:
        signature = signature_text_of([(tuple(s), *m) for s, m in zip(shapes, metas)])
        return _as_written_plan(runner, why, structure.plan, signature)

    def plan_for(shapes: tuple) -> Plan:
        return rare_plan(
            shapes, f"sizes {sizes_text(shapes)} are new to this call structure: they are planned if they come back"
        )

    if settled is None:
        settled = SettledCalls(st.generation, args, kwargs, None, tensors=True, sizes={})
        st.settle(settled)
    settled.count_new_sizes(structure, plan_for, rare_plan)
    st.counting = True


def _bucket_plans(
    runner: Runner, why: Any, like: Any, sizes: tuple, tensors: list, args: tuple, kwargs: dict
) -> Optional[tuple[Callable[[tuple], Plan], Callable[[tuple], tuple]]]:
    """What ``sm.plan`` reports for a call of another size of a size bucket settled to run
    as written, given its shapes in ``settled_calls.shapes_of``'s order: this call's plan
    at those shapes (the signature names the plan key's tensors in its order); and how
    shapes in the plan key's order are written in that order. ``None`` where a tensor is
    not an argument itself (no layout settles there)."""
    ordered = [a for a in args if type(a) is torch.Tensor]
    ordered += [kwargs[k] for k in sorted(kwargs) if type(kwargs[k]) is torch.Tensor]
    first = {id(t): i for i, t in reversed(list(enumerate(ordered)))}
    where = [first.get(id(t)) for t in tensors]
    if None in where:
        return None
    metas = [m[1:] for m in sizes]

    def plan_for(shapes: tuple) -> Plan:
        signature = signature_text_of([(tuple(shapes[i]), *meta) for i, meta in zip(where, metas)])
        return _as_written_plan(runner, why(), like, signature)

    def order(key_shapes: tuple) -> tuple:
        ordered_shapes: list = [()] * len(ordered)
        for i, shape in zip(where, key_shapes):
            ordered_shapes[i] = tuple(shape)
        return tuple(ordered_shapes)

    return plan_for, order


def _object_call(runner: Runner, key: Any, spec: Any, args: tuple, kwargs: dict) -> Any:
    """An object argument (a KV cache, a config, a dataclass batch) would be baked into a
    trace, the tensors it holds as constants, that a later call passing another object
    must not reuse: as written under every executor; keyed by type, never kept. Its
    children, which are passed tensors (or objects in turn), are nested as an
    untraceable forward's are (nesting.py)."""
    st = runner.st
    kind = spec.has_objects
    why = (
        f"an argument is a {kind} object, which a trace would bake in (a later call passes "
        "another one): calls passing one run the model as written"
    )
    counted = st.dispatch.leaf_calls
    structure = spec.key
    st.last = AsWritten(make=lambda: _as_written_plan(runner, why, leaf_calls=counted.get(structure)), nests=True)
    # Later calls with this key (objects key by type) run as written at once.
    st.written.put(key, st.last)
    st.hot = (key, st.last)
    return runner.forward_nesting(key, spec, args, kwargs)


def _trace(runner: Runner, trace_key: Any, spec: Any, ranks: tuple, dtypes: tuple) -> Any:
    """The call structure's trace (cached), or, without ``strict``, the ``TraceError`` it
    failed with (cached too: later calls go straight to eager dispatch instead of failing
    to trace again)."""
    st, config = runner.st, runner.config
    traced = st.traces.get_fresh(trace_key)
    if isinstance(traced, TraceError) and not config.strict:
        return traced
    if traced is None:
        try:
            traced = trace_model(runner.module, st.binder, spec, tuple(config.leaf_modules), ranks, dtypes)
        except TraceError as exc:
            if config.strict:
                raise
            st.traces.put(trace_key, exc)
            return exc
        st.traces.put(trace_key, traced)
    return traced


def compile_signature(runner: Runner, traced: Traced, key: Any, tensors: list[torch.Tensor]) -> tuple[Compiled, Any]:
    """The pipeline, for one input signature of a traced call structure: run the trace
    node by node recording shapes and in-place effects (that run is the call's output),
    plan, compile, and set up the ``auto`` trial. The compiled signature is cached
    (``st.plans``) and is what ``sm.plan`` reports; returns it and the call's output."""
    st, config = runner.st, runner.config
    metas: dict = {}

    def on_error(exc: BaseException, node: Any) -> None:
        annotate_exception(exc, st.where_text(node_label(node)))

    graph, root = traced.graph, traced.root
    # The module paths are resolved once for the whole pipeline (the trace's own
    # resolutions where this call made the trace), for as long as no module is re-wired.
    generation = _generation.current()
    held, traced.resolver = traced.resolver, None
    if held is not None and held[0] == generation and held[1].root is root:
        resolve = held[1]
    else:
        resolve = submodule_resolver(root)
    rng = save_generators(next((t.device for t in tensors if t.is_cuda), None))
    if reads_only(graph, resolve, tensors):
        # No op of this call can write a storage: the recorder would record no write, and
        # the effects of its recording are none whatever it read (``reads_only``); its
        # dispatch mode, through which every op of the call went, is left out.
        recorder = None
        try:
            result = run_and_record(graph, traced.root, tensors, on_error, metas, resolve=resolve, reads_only=True)
        except Exception as exc:
            _recording_failed(config, exc, rng)
        if traced.graph is not graph:  # pragma: no cover - a call of such nodes misleads no trace
            raise RuntimeError("streamsched: the trace changed during a call of reading modules only")
    else:
        regions = st.fusion.stack_regions() if st.fusion is not None else None
        recorder = EffectRecorder(regions)
        try:
            with recorder:
                result = run_and_record(graph, traced.root, tensors, on_error, metas, recorder, resolve)
        except Exception as exc:
            # The call runs as written instead (below), where the nodes run so far wrote no
            # state (the random numbers they drew are put back); otherwise it cannot be run
            # again, and the error is the call's.
            recorder.merge_spanning()
            inputs = frozenset(recorder.key_of(t) for t in tensors)
            if Effects.from_accesses(recorder.accesses, inputs).writes_state:
                raise
            _recording_failed(config, exc, rng)
    _guard_dtypes(runner, traced)
    # A leaf call that returned a tensor here may return None on a later call (the
    # reverse of what the recording call's re-trace learns): read it through a check.
    resolved = resolve if traced.root is root and _generation.current() == generation else None
    check_recorded_structures(traced, metas, resolved)
    if st.fusion is not None:
        # (Before anything is stacked for this plan.)
        outputs = result if isinstance(result, (tuple, list)) else ()
        st.fusion.views_held([*outputs, *_attributes_read(traced), *traced.baked])
    checks = any(isinstance(n.target, OutputCheck) for n in traced.graph.nodes)
    written = None
    if recorder is None:
        effects = Effects()
    else:
        recorder.merge_spanning()
        input_keys = frozenset(recorder.key_of(t) for t in tensors)
        effects = Effects.from_accesses(recorder.accesses, input_keys, traced.graph)
        if effects:
            effects.parameter_writers = parameter_writers(
                recorder.accesses, recorder.key_of, runner.module.parameters()
            )
        if checks and effects.writes_state:
            # What a check stopping a call may find written: saved before each call
            # (written_state), put back by a stopped one, which then runs as written.
            constants = [*_attributes_read(traced), *traced.baked]
            written = WrittenState.of(
                traced.graph, recorder.accesses, recorder.key_of, runner.module, tensors, constants
            )
        del recorder
    rebuild = traced.output_tree.rebuilder() if traced.output_tree is not None else _identity
    measured = _measured_costs(runner, tensors)
    with resolving_submodules(traced.root, resolved):
        planned = make_schedule(traced, metas, config, tensors, fusion=st.fusion, measured=measured, effects=effects)
        runs_models_code = traced.runs_models_code  # (each module path resolved once, as above)
    programs = st.programs.get(traced.graph)
    if programs is None:
        programs = st.programs[traced.graph] = ProgramCache()
    program = compile_program(planned, programs)
    if measured:
        notes = [*planned.plan.notes, f"task costs measured: profile {config.profile}"]
        planned.plan = planned.plan.model_copy(update={"notes": notes})
    compiled = Compiled(planned, program, rebuild, runner.cuda_graph and planned.plan.device.startswith("cuda"))
    compiled.nested_sites = runner.opaque_sites(planned.plan)
    compiled.checks = checks
    compiled.runs_models_code = runs_models_code
    compiled.written = written
    if effects.writes_inputs or effects.writes_state or _layout_decides_writes(effects, traced.graph):
        # Its order of in-place writes holds for the way the inputs alias each other and
        # the model's parameters and buffers on this call, and for their layout, which
        # decides whether a view or a copy is written (``state.alias_pattern``).
        compiled.held_storages = state_storages(runner.module)
        compiled.alias_pattern = alias_pattern(tensors, compiled.held_storages)
        _keep_variant(st.plans.get_fresh(key), compiled)
    if runner.auto:
        eager = runner.may_run_as_written
        if eager or planned.plan.executor != "serial":
            compiled.trial = Trial(planned.plan.executor, as_written=eager)
            if runner.nested_child:
                compiled.trial.min_gain_s = NESTED_GAIN_S
            if config.grad_handoff == "direct":
                # Member gradients are written natively, past the hooks a backward
                # timer waits for; and eager is no candidate there.
                compiled.trial.backward = False
    st.plans.put(key, compiled)
    st.last = compiled
    st.last_path = "recorded"
    return compiled, rebuild(result)


# Operations that return a view of their input or a copy, as its layout, dtype or device
# decide (``x.reshape(-1)`` views a contiguous ``x`` and copies a strided one).
_VIEW_OR_COPY_METHODS = frozenset(
    {
        "reshape",
        "reshape_as",
        "flatten",
        "contiguous",
        "to",
        "type",
        "type_as",
        "float",
        "double",
        "half",
        "bfloat16",
        "int",
        "long",
        "cpu",
        "cuda",
    }
)
_VIEW_OR_COPY_FUNCTIONS = frozenset({torch.reshape, torch.flatten, torch.Tensor.contiguous, torch.Tensor.to})


def _layout_decides_writes(effects: Effects, graph: Any) -> bool:
    """Whether the recording wrote in place into the output of an operation that returns
    a view or a copy as the input's layout decides: with another layout the same write
    would reach the input (``Compiled.alias_pattern`` then holds the strides)."""
    written = effects.outputs_written
    if not written:
        return False
    for node in graph.nodes:
        if node.name in written:
            if node.op == "call_method" and node.target in _VIEW_OR_COPY_METHODS:
                return True
            if node.op == "call_function" and node.target in _VIEW_OR_COPY_FUNCTIONS:
                return True
    return False


# Plans kept per signature for the ways its inputs alias (Compiled.variants).
MAX_ALIAS_VARIANTS = 4


def _keep_variant(previous: Any, compiled: Compiled) -> None:
    """Keep ``compiled`` beside the plans its signature has for other alias patterns
    (``previous``: the signature's plan until now), so that inputs aliasing one way and
    then another each find theirs instead of re-recording on every call."""
    variants = previous.variants if isinstance(previous, Compiled) and previous.variants is not None else {}
    variants.pop(compiled.alias_pattern, None)
    variants[compiled.alias_pattern] = compiled
    while len(variants) > MAX_ALIAS_VARIANTS:
        del variants[next(iter(variants))]
    compiled.variants = variants


def refused(exc: Exception) -> bool:
    """Whether ``exc``, raised by a recording call, is streamsched's own refusal (a rank
    the trace relied on, a profile that does not fit, ...): raised as it is, never
    retried as written. A ``TraceError`` is not: what no trace can follow runs as written."""
    return isinstance(exc, (RankAssumptionError, StreamSchedError)) and not isinstance(exc, TraceError)


class _RecordingAbandoned(Exception):
    """A recording call stopped having written no state; the call runs as written.

    ``proven``: by a ``TraceError`` (a leaf call returned what no trace can follow, a
    value a type test took for a tensor was not one): the call structure is untraceable
    (``error``). Otherwise the traced code raised, and the trace is to blame only if the
    model as written runs (a trace can take a path the code does not: an attribute test
    of an opaque value the trace made a node, which the real value lacks); if it raises
    too, its error is the call's."""

    def __init__(self, error: TraceError, proven: bool = True):
        super().__init__(str(error))
        self.error = error
        self.proven = proven


def _recording_failed(config: Any, exc: Exception, rng: tuple) -> None:
    """Raise what a recording call that raised ``exc`` (having written no state) ends in:
    ``exc`` itself under ``strict``, else :class:`_RecordingAbandoned` (the call to run as
    written, the random numbers drawn so far put back)."""
    if config.strict or refused(exc):
        raise exc
    restore_generators(rng)
    if isinstance(exc, TraceError):
        raise _RecordingAbandoned(exc) from exc
    where = getattr(exc, "_streamsched_where", None)  # (runtime.program.annotate_exception)
    where = f" in {where}" if where else ""
    reason = TraceError(
        f"the traced forward raised {type(exc).__name__} ({first_line(str(exc))}){where}, where the forward as "
        "written runs: the trace took a path the code does not (an attribute or type test of a value it could "
        "not tell, say)"
    )
    raise _RecordingAbandoned(reason, proven=False) from exc


def _attributes_read(traced: Traced) -> list[Any]:
    """The tensors ``traced``'s graph reads as attributes (``get_attr``: parameters,
    buffers, tensor attributes, the constants the trace made of held tensors)."""
    out = []
    for node in traced.graph.nodes:
        if node.op == "get_attr":
            try:
                value = fetch_attr(traced.root, node.target)
            except AttributeError:
                continue
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def _join_structure(
    runner: Runner,
    compiled: Compiled,
    structure_key: Any,
    structure: Optional[Structure],
    shapes: tuple,
    record_s: float,
) -> None:
    """Keep the compiled signature with its call structure (the signature without its
    sizes), which decides its sizes' buckets once: take a bucket's verdict, or try it."""
    st = runner.st
    if structure is None or structure.plan is None:
        if structure is None:
            structure = _new_structure(runner, structure_key)
        structure.planned.put(shapes, True)
        # Nothing side by side, nothing batched: the trial's verdict holds for
        # every size (planning.signatures).
        plan = compiled.plan
        structure.uniform = plan.num_streams <= 1 and not plan.fused_groups
    compiled.structure, compiled.sizes = structure, shapes
    structure.plan = compiled.plan
    # What a plan of a new size costs, against what a decided schedule saves.
    structure.recorded(record_s)
    bucket = structure.bucket_of(shapes)
    decision = structure.decision(bucket)
    if decision is not None and compiled.trial is not None:
        compiled.apply(decision)
    elif compiled.trial is not None:
        structure.try_at(bucket, shapes)
        compiled.trial.began = st.calls
        if structure.uniform:
            # Its verdict holds for every size: a schedule that wins only the
            # forward's Python must win clearly, or each new size pays a plan
            # for nothing.
            compiled.trial.schedule_margin = UNIFORM_SCHEDULE_MARGIN


def _as_written_plan(
    runner: Runner,
    why: str,
    like: Optional[Plan] = None,
    signature: str = "",
    leaf_calls: Optional[tuple] = None,
) -> Plan:
    """What ``sm.plan`` reports for a call that ran the model as written: ``like`` (a plan
    of the same call structure at other sizes) for this call's ``signature``, run as
    written. ``leaf_calls``: its forward's, counted with the nested children's share
    (``Runner.forward_nesting``)."""
    if like is None:
        probed = runner.st.probed  # (where the model's first parameter is: its device)
        device = str(probed[1]) if probed is not None and probed[1] is not None else ""
        plan = Plan.as_written(type(runner.module).__name__, why, signature, device)
        if leaf_calls is not None:
            plan = plan.model_copy(update={"leaf_calls": leaf_calls[1], "nested_leaf_calls": dict(leaf_calls[2])})
        return plan
    return like.model_copy(update={"executor": "eager", "reason": why, "trial": None, "signature": signature})


def _guard_dtypes(runner: Runner, traced: Traced) -> None:
    """After a recording call (which may have traced again): compare the dtypes of the
    parameters ``traced`` relied on every call from now on."""
    st = runner.st
    if traced.dtype_guards and not any(t is traced for t in st.dtype_guarded):
        live = {id(t) for t in st.traces.values()}  # those the LRU dropped: not checked
        st.dtype_guarded = [t for t in st.dtype_guarded if id(t) in live] + [traced]
    st.dtype_probes = dtype_probes(st.dtype_guarded)


def _measured_costs(runner: Runner, tensors: list[torch.Tensor]) -> Optional[dict[str, float]]:
    """Task costs from ``config.profile`` (checked against this model, input and device)."""
    profile = runner.config.profile
    if profile is None:
        return None
    st = runner.st
    if st.profile is None:
        try:
            st.profile = load_profile(profile)
        except FileNotFoundError as exc:
            # The bare OSError names only the path: say which option and which model it is for,
            # and how such a file is made. Same type, so callers catching it still do.
            raise FileNotFoundError(
                exc.errno,
                f"SchedulerConfig.profile of the StreamScheduledModule wrapping {type(runner.module).__name__} "
                "(write one with `python -m streamsched profile MODULE:FACTORY --input-shape ... --out FILE`, "
                "or leave profile=None to plan with estimated costs): no such file",
                exc.filename,
            ) from None
    device = device_of(tensors, runner.module)
    try:
        check_profile(st.profile, type(runner.module).__name__, signature_text(tensors), str(device))
    except ProfileMismatchError as exc:
        raise ProfileMismatchError(f"{exc} (profile {profile})") from None
    return profile_costs(st.profile)


def revalidate(runner: Runner) -> bool:
    """Some module somewhere was re-wired, switched mode or had a flag set: re-key the
    mode, and say whether the caches must go (a trace whose modules moved or whose
    baked-in flags changed the program, a reconfigured fused module)."""
    st, module = runner.st, runner.module
    st.mode_id = st.mode_of(module)
    st.hot = None
    if st.changes == _generation.changes():
        # Only modules' modes were switched (train() / eval()) or hooks registered or
        # removed: plans are keyed by both (``WrapperState.mode_of``).
        st.generation = _generation.current()
        st.hook_registrations = _generation.hook_registrations()
        return False
    replaced = _generation.buffer_replacements() - st.buffer_replacements
    st.buffer_replacements = _generation.buffer_replacements()
    if (
        replaced
        and st.changes + replaced == _generation.changes()
        and st.hook_registrations == _generation.hook_registrations()
        and placement_probe(module)[1] == st.probed
    ):
        # Only buffers were given other tensors under their names (a branch keeping its
        # last output in one, ``self.last = y.detach()``, on every call): traces read
        # buffers on every call, the dtypes they relied on are compared on every call,
        # and no module moved. A fused stack holding one is re-stacked.
        if st.fusion is not None:
            st.fusion.check_buffers()
        st.generation = _generation.current()
        st.changes = _generation.changes()
        return False
    if st.nested is not None:
        st.nested.refresh()  # a child swapped: nest the new one
    # A module hook registered since: a hooked module runs as a call of its own.
    stale = st.hook_registrations != _generation.hook_registrations()
    st.hook_registrations = _generation.hook_registrations()
    # The first parameter may be another one now (re-wired); a cast or move of the
    # model at the same time must still count.
    probe, probed = placement_probe(module)
    stale = stale or probed != st.probed or not all(t.dtypes_hold() for t in st.dtype_guarded)
    st.dtype_probes = dtype_probes(st.dtype_guarded)  # a parameter may be another one now
    st.probe, st.probed = probe, probed
    for traced in list(st.traces.values()):
        if not isinstance(traced, Traced):
            continue
        if (
            not traced.modules_unchanged()
            or not traced.in_place_unchanged()
            or not (traced.flags_unchanged() or _retraces_same(runner, traced))
        ):
            stale = True
            break
    if stale:
        log.info("streamsched: %s changed after wrapping; re-tracing", type(module).__name__)
    elif st.fusion is not None and not st.fusion.fused_unchanged():
        log.info("streamsched: a fused module of %s was reconfigured; re-planning", type(module).__name__)
        stale = True
    elif st.fusion is not None:
        # A parameter may have been re-assigned: re-stack whatever no longer aliases
        # (one of another shape: the fused kernels' shapes no longer hold, plan again).
        try:
            st.fusion.check_all(full=True)
        except FusedMembersReshaped as exc:
            log.info("streamsched: %s; re-planning", exc)
            stale = True
    st.generation = _generation.current()
    st.changes = _generation.changes()
    return stale


def _retraces_same(runner: Runner, traced: Traced) -> bool:
    """A flag of a traced-through module changed: trace again, and keep the plans when
    the program is the same (the flag was never read by traced code)."""
    try:
        fresh = trace_model(
            runner.module, runner.st.binder, traced.spec, tuple(runner.config.leaf_modules), traced.ranks, traced.dtypes
        )
    except TraceError:
        return False
    if not traced.same_program(fresh):
        return False
    traced.flags = fresh.flags
    return True
