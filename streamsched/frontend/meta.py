"""What each graph value looked like on a real call: shapes, dtypes, devices.

The first call with a new input signature runs the traced graph node by node (this *is*
that call's forward, so its result is returned to the user) and records a
:class:`TensorMeta` for every tensor it produces. Fusion signatures, cost estimates and
the plan are computed from these records.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch
from torch import fx

from .._gc import cyclic_gc_paused
from . import node_meta
from .leafcalls import leaf_module_types, leaf_units, recording_counter, store_counts
from .nodes import submodule_resolver
from .opaque_outputs import copy_recorded_structures, leaf_label, misleads, note_recorded_structure
from .rank_checks import RankAssumptionError, check_relied

__all__ = ["TensorMeta", "ValueMeta", "describe", "run_and_record", "tensor_metas"]


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool
    contiguous: bool

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.dtype)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return f"{dt}[{', '.join(map(str, self.shape))}]"


@functools.cache
def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class ConstMeta:
    """A non-tensor value; ``value`` kept when small and hashable (ints, shapes)."""

    type_name: str
    value: Any = None


ValueMeta = Union[TensorMeta, ConstMeta, tuple]


def describe(value: Any, known: Optional[dict[tuple, TensorMeta]] = None) -> ValueMeta:
    """The description of a value. ``known``: descriptions made so far, by their fields:
    tensors described alike share one (frozen) :class:`TensorMeta`, made once."""
    if isinstance(value, torch.Tensor):
        fields = (tuple(value.shape), value.dtype, value.device, value.requires_grad, value.is_contiguous())
        if known is None:
            return TensorMeta(*fields)
        meta = known.get(fields)
        if meta is None:
            meta = known[fields] = TensorMeta(*fields)
        return meta
    if isinstance(value, (tuple, list)):
        return tuple(describe(v, known) for v in value)
    if isinstance(value, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.Size)):
        return ConstMeta(type(value).__name__, value)
    return ConstMeta(type(value).__name__)


def tensor_metas(meta: ValueMeta) -> list[TensorMeta]:
    """All tensors in a (possibly nested) value description."""
    if isinstance(meta, TensorMeta):
        return [meta]
    if isinstance(meta, tuple):
        return [t for m in meta for t in tensor_metas(m)]
    return []


@cyclic_gc_paused
def run_and_record(
    graph: fx.Graph,
    root: torch.nn.Module,
    inputs: list[Any],
    on_error: Callable[[BaseException, fx.Node], None],
    record: Optional[dict[fx.Node, ValueMeta]] = None,
    effects: Any = None,
    resolve: Optional[Callable[[str], torch.nn.Module]] = None,
    reads_only: bool = False,
) -> Any:
    """Run ``graph`` node by node on real inputs, recording each value's description.

    Values are dropped after their last use, as ``torch.fx.Interpreter`` does, so the
    first call's peak memory is that of eager execution. ``on_error`` is called with the
    exception and the failing node before it propagates (to add the module path).
    ``effects`` (an active :class:`~streamsched.frontend.effects.EffectRecorder`) is told which
    node runs, so it attributes each storage access to its node.

    Where ``root`` is a trace's root, every leaf call's value is checked against how the
    graph reads it (:mod:`~streamsched.frontend.opaque_outputs`): one that misled the trace
    (``None`` where the traced code went on with a tensor) makes the trace learn its
    structure and trace again, replacing the :class:`~streamsched.frontend.trace.Traced`'s
    graph in place; the run goes on in the new graph from that call (the nodes before it
    are the same: the traced code before the call did not depend on it). Until the last
    leaf call that could mislead it has run, no value is dropped, since the new graph may
    read it later than the old one did.

    ``resolve``: a resolver of ``root``'s module paths the caller made already
    (:func:`~streamsched.frontend.nodes.submodule_resolver`), to share its lookups.
    ``reads_only``: every node is one that
    :func:`~streamsched.frontend.effects.reads_only` allows, whose call runs its own
    module's ``forward`` and calls no other module: its leaf calls are counted by rule
    (one where its module is a leaf module the counter would hook, none elsewhere), with
    no hook put in and each module called plainly.

    Where ``root`` is a trace's root, the leaf-module calls each node makes are counted
    into ``node.meta`` (:mod:`~streamsched.frontend.leafcalls`: a forward pre-hook on
    every leaf module for the length of this call), which ``Plan.coverage`` is made of.
    """
    ref = root.__dict__.get("_streamsched_traced")
    traced = ref() if ref is not None else None
    if traced is None:
        return _RecordingRun(graph, root, inputs, on_error, record, effects, None, None, resolve).run()
    if reads_only:
        resolve = submodule_resolver(root) if resolve is None else resolve
        result = _RecordingRun(graph, root, inputs, on_error, record, effects, traced, None, resolve).run()
        units = {id(m) for m in leaf_units(traced.model, leaf_module_types(traced.leaf_types))}
        for node in traced.graph.nodes:
            counted = node.op == "call_module" and id(resolve(node.target)) in units
            node_meta.set_leaf_calls(node, 1 if counted else 0)
        return result
    counter = recording_counter(traced)
    with counter:
        result = _RecordingRun(graph, root, inputs, on_error, record, effects, traced, counter, resolve).run()
    store_counts(counter, list(traced.graph.nodes))
    return result


class _RecordingRun:
    """One run of :func:`run_and_record`: the graph's nodes in order, the values alive,
    and which of them die after each node (or are held while the trace may change)."""

    def __init__(
        self,
        graph: fx.Graph,
        root: torch.nn.Module,
        inputs: list[Any],
        on_error: Callable[[BaseException, fx.Node], None],
        record: Optional[dict[fx.Node, ValueMeta]],
        effects: Any,
        traced: Any,
        counter: Any,
        resolve: Optional[Callable[[str], torch.nn.Module]] = None,
    ) -> None:
        self.nodes = list(graph.nodes)
        self.root = root
        self.submodule = _submodules(root) if resolve is None else resolve
        self.frees, self.hold_until = _plan_frees(self.nodes, traced is not None, self.submodule, 0)
        self.held: list[fx.Node] = []
        self.env: dict[fx.Node, Any] = {}
        self.described: dict[tuple, TensorMeta] = {}
        self.inputs = iter(inputs)
        self.on_error = on_error
        self.record = record
        self.effects = effects
        self.traced = traced
        self.counter = counter
        self.retraces = 0

    def run(self) -> Any:
        result: Any = None
        i = 0
        while i < len(self.nodes):
            node = self.nodes[i]
            if self.counter is not None:
                self.counter.where = node.name
            value = self._evaluate(node)
            if node.op == "output":
                result = value
            else:
                if self.traced is not None and leaf_label(node) is not None:
                    if misleads(node, value, self._in_sequence):
                        node = self._trace_again(i, node, value)
                    note_recorded_structure(node, value)
                self._check_relied_ranks(node, value)
                self._keep(i, node, value)
            i += 1
        return result

    def _in_sequence(self, node: fx.Node) -> bool:
        """Whether the model's output holds ``node``'s value as an item of a tuple or list
        (not of a ``ModelOutput`` or a dict, rebuilt from their fields each call)."""
        tree = self.traced.output_tree if self.traced is not None else None
        output = self.nodes[-1]
        if tree is None or tree.is_plain or output.op != "output":
            return False
        leaves = output.args[0]
        if not isinstance(leaves, (tuple, list)):
            return False
        parents = tree.leaf_parents()
        return any(leaf is node and parents[i] in (tuple, list) for i, leaf in enumerate(leaves) if i < len(parents))

    def _evaluate(self, node: fx.Node) -> Any:
        """The node's value (the output's: the call's result), its storage accesses
        charged to it; an error goes to ``on_error`` first."""
        effects = self.effects
        if effects is not None:
            effects.begin(node.name)
        try:
            return self._compute(node)
        except Exception as exc:
            self.on_error(exc, node)
            raise
        finally:
            if effects is not None:
                effects.end()

    def _compute(self, node: fx.Node) -> Any:
        env, op = self.env, node.op
        if op == "placeholder":
            return next(self.inputs)
        if op == "get_attr":
            return fetch_attr(self.root, node.target)
        if op == "call_module":
            module = self.submodule(node.target)
            args = load_argument(node.args, env)
            kwargs = load_argument(node.kwargs, env) if node.kwargs else {}
            return module(*args, **kwargs) if self.counter is None else self.counter.call(module, args, kwargs)
        if op == "call_function":
            args = load_argument(node.args, env)
            kwargs = load_argument(node.kwargs, env) if node.kwargs else {}
            return node.target(*args, **kwargs)
        if op == "call_method":
            self_obj, *rest = load_argument(node.args, env)
            return getattr(self_obj, node.target)(*rest, **load_argument(node.kwargs, env))
        if op == "output":
            return load_argument(node.args[0], env)
        raise RuntimeError(f"unknown fx op {node.op}")  # pragma: no cover - fx has no other ops

    def _trace_again(self, i: int, node: fx.Node, value: Any) -> fx.Node:
        """A leaf call misled the trace: trace again knowing what it returns, and go on in
        the new graph from node ``i`` (returned: its counterpart there)."""
        self.retraces += 1
        if self.retraces > _MAX_RETRACES:
            raise RuntimeError(f"{self.retraces} re-traces for what leaf calls return; giving up at '{node.target}'")
        try:
            # The re-trace must see the modules without the counting hooks (a hooked
            # module is a leaf to the tracer).
            with self.counter.paused():
                self.traced.relearn(node, value)
        except Exception as exc:
            self.on_error(exc, node)
            raise
        old = self.nodes
        self.nodes = nodes = list(self.traced.graph.nodes)
        self.root = self.traced.root
        self.submodule = _submodules(self.root)
        renamed = _same_prefix(old, nodes, i)
        self.env = {renamed[n]: v for n, v in self.env.items()}
        copy_recorded_structures(old[:i], renamed)
        if self.record is not None:
            for n in old[: i + 1]:
                if n in self.record:
                    self.record[renamed[n]] = self.record.pop(n)
        self.frees, self.hold_until = _plan_frees(nodes, True, self.submodule, i + 1)
        # Values the new graph reads no more after this point: dropped with the rest.
        position = {n: k for k, n in enumerate(nodes)}
        self.held = [n for n in self.env if max((position[u] for u in n.users), default=-1) <= i]
        return nodes[i]

    def _check_relied_ranks(self, node: fx.Node, value: Any) -> None:
        """A rank the trace relied on must hold for the value the call produced."""
        if node_meta.relied(node) is not None:
            try:
                check_relied(node, value)
            except RankAssumptionError as exc:
                self.on_error(exc, node)
                raise

    def _keep(self, i: int, node: fx.Node, value: Any) -> None:
        """Keep and describe the value; drop the values it was the last use of (unless
        the trace may still change)."""
        self.env[node] = value
        if self.record is not None:
            self.record[node] = describe(value, self.described)
        dead = self.frees.get(node, ())
        if i < self.hold_until:
            self.held.extend(dead)
        else:
            for d in (*self.held, *dead):
                self.env.pop(d, None)
            self.held = []


_MAX_RETRACES = 256


def _submodules(root: torch.nn.Module) -> Callable[[str], torch.nn.Module]:
    """``root.get_submodule``, each path resolved once per recording (a module's calls
    recur in a graph, and each walk splits the path and looks up every component)."""
    return submodule_resolver(root)


def _plan_frees(
    nodes: list[fx.Node], checked: bool, submodule: Callable[[str], torch.nn.Module], start: int
) -> tuple[dict, int]:
    """Which values die after each node (their last use), and the index of the last leaf
    call that could still make the trace change (``-1`` when none can)."""
    last_use: dict[fx.Node, fx.Node] = {}
    for node in reversed(nodes):
        for inp in node.all_input_nodes:
            last_use.setdefault(inp, node)
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        frees.setdefault(user, []).append(value)
    hold_until = -1
    if checked:
        for k in range(len(nodes) - 1, start - 1, -1):
            node = nodes[k]
            module = submodule(node.target) if node.op == "call_module" else None
            if leaf_label(node) is not None and (module is None or may_mislead(module)):
                hold_until = k
                break
    return frees, hold_until


def may_mislead(module: torch.nn.Module) -> bool:
    """Whether a leaf call of ``module`` may return something other than a tensor, or
    tensors only: every module but ``torch.nn``'s own, and ``MultiheadAttention``
    (``(out, None)`` without weights)."""
    cls = type(module)
    return not cls.__module__.startswith("torch.nn.") or isinstance(module, torch.nn.MultiheadAttention)


def _same_prefix(old: list[fx.Node], new: list[fx.Node], upto: int) -> dict[fx.Node, fx.Node]:
    """Old node -> new node for the first ``upto + 1`` nodes, which must be the same
    program (a re-trace records the code before a call the same way)."""
    if len(new) <= upto:
        raise RuntimeError("the re-trace is shorter than the part of the call already run")
    for a, b in zip(old[: upto + 1], new[: upto + 1]):
        if (a.op, a.name, str(a.target), str(a.args), str(a.kwargs)) != (
            b.op,
            b.name,
            str(b.target),
            str(b.args),
            str(b.kwargs),
        ):
            raise RuntimeError(
                f"the re-trace differs from the first trace before '{old[upto].target}' ({a.format_node()} vs "
                f"{b.format_node()}): the call cannot go on in it"
            )
    return dict(zip(old[: upto + 1], new[: upto + 1]))


def load_argument(a: Any, env: dict) -> Any:
    """A node's argument with each node replaced by its value in ``env``; its lists and
    dicts new, mutable ones on every call, as the forward's own code made them (and as
    the compiled program renders them: literals). fx's ``map_arg`` would hand a call
    its ``immutable_list``: a function that changes the list it is given (torchvision's
    Swin3D window adapter) then fails on the recording call."""
    kind = type(a)
    if kind is fx.Node:
        return env[a]
    if kind is tuple:  # the common case (a node's arguments): no generator, no _fields
        return tuple([env[v] if type(v) is fx.Node else load_argument(v, env) for v in a])
    if isinstance(a, tuple):
        items = tuple(load_argument(v, env) for v in a)
        return kind(*items) if hasattr(a, "_fields") else items
    if isinstance(a, list):
        return [load_argument(v, env) for v in a]
    if isinstance(a, dict):
        return {k: load_argument(v, env) for k, v in a.items()}
    if kind is slice:
        return slice(load_argument(a.start, env), load_argument(a.stop, env), load_argument(a.step, env))
    return a


def fetch_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj
