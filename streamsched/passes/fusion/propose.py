"""Propose: which nodes may be fused, and which of them form groups.

Split as in ``torch.fx``'s ``CapabilityBasedPartitioner``, which takes an
``OperatorSupport`` saying whether a node is supported and does the grouping itself:

- :class:`FusionSupport` is the support policy. For one node it says whether it can be
  fused, under which *signature* (module type and configuration, parameter and buffer
  shapes and dtypes, input shapes, constant arguments, train/eval), and, where a node
  that could be fused is left alone on purpose (hooks, BatchNorm with ``momentum=None``,
  an in-place effect on shared storage), why.
- :func:`propose` groups supported nodes: Linear/Conv nodes that read the *same* tensor
  with *different* output widths form a "wide" group first; the rest are bucketed by
  signature and *level* (longest path from the inputs). Nodes on one level never depend
  on each other, and contracting same-level nodes cannot create a cycle, so every bucket
  of at least ``fuse_min_size`` nodes is a valid group.

Each proposed group names the kernel kind that will build it (a key of
:data:`streamsched.passes.fusion.builders.BUILDERS`); nothing here touches the graph.
"""

from __future__ import annotations

import enum
import logging
import operator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from ... import _generation
from ...branch import BranchCall
from ...frontend import node_meta
from ...frontend.hooks import has_hooks
from ...frontend.meta import ConstMeta, TensorMeta, ValueMeta
from ...frontend.nodes import is_glue, node_label, submodule, target_name

__all__ = [
    "FusionSupport",
    "StaticSignatures",
    "Proposals",
    "propose",
    "module_kind",
    "structure_signature",
    "plain_attribute_names",
    "MODULE_KINDS",
]

log = logging.getLogger(__name__)

ELEMENTWISE_MODULES: tuple[type, ...] = (
    nn.ReLU,
    nn.ReLU6,
    nn.GELU,
    nn.Tanh,
    nn.Sigmoid,
    nn.SiLU,
    nn.LeakyReLU,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.Softplus,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Mish,
    nn.Hardtanh,
    nn.Identity,
    nn.Softsign,
    nn.Tanhshrink,
    nn.LogSigmoid,
    nn.Dropout,
    nn.AlphaDropout,
)
RANDOM_MODULES: tuple[type, ...] = (nn.Dropout, nn.AlphaDropout)

ELEMENTWISE_FUNCTIONS: frozenset = frozenset(
    {
        torch.relu,
        F.relu,
        torch.sigmoid,
        torch.tanh,
        F.gelu,
        F.silu,
        F.leaky_relu,
        F.elu,
        F.softplus,
        F.hardswish,
        F.mish,
        F.relu6,
        torch.exp,
        torch.log,
        torch.sin,
        torch.cos,
        torch.abs,
        torch.neg,
        torch.sqrt,
        torch.rsqrt,
        torch.square,
        torch.clamp,
        torch.add,
        torch.sub,
        torch.mul,
        torch.div,
        operator.add,
        operator.sub,
        operator.mul,
        operator.truediv,
        operator.neg,
        F.dropout,
    }
)
RANDOM_FUNCTIONS: frozenset = frozenset({F.dropout})
ELEMENTWISE_METHODS: frozenset = frozenset(
    {
        "relu",
        "sigmoid",
        "tanh",
        "exp",
        "log",
        "abs",
        "neg",
        "sqrt",
        "rsqrt",
        "square",
        "clamp",
        "add",
        "sub",
        "mul",
        "div",
        "pow",
        "relu_",
        "sigmoid_",
        "tanh_",
        "add_",
        "mul_",
    }
)

MODULE_KINDS: dict[type, str] = {
    nn.Linear: "linear",
    **dict.fromkeys((nn.Conv1d, nn.Conv2d, nn.Conv3d), "conv"),
    **dict.fromkeys((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "batchnorm"),
    nn.LayerNorm: "layernorm",
    **dict.fromkeys(ELEMENTWISE_MODULES, "elementwise"),
}
"""Module type (exactly, not subclasses) -> the kernel kind that batches it; any other
module type is tried with ``vmap``. Kinds are keys of ``builders.BUILDERS``."""


def module_kind(m: nn.Module) -> str:
    """The kernel kind for a module call: ``linear``, ``conv`` ..., else ``vmap``."""
    return MODULE_KINDS.get(type(m), "vmap")


# --- signatures --------------------------------------------------------------------


# What every nn.Module instance holds in its __dict__ (registries, hook tables,
# flags): not configuration of its own, and compared separately where it matters.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) | {"_parameters", "_buffers", "_modules", "training"}
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
_EXACT_PLAIN_TYPES = frozenset(_PLAIN_TYPES)


def _value_sig(v: Any) -> Any:
    """A hashable stand-in for a plain attribute value that is equal exactly when the
    values behave alike: plain values by value, containers by their items, anything
    else (a function, a tensor that is not a registered buffer, an arbitrary object) by
    identity, so members holding different objects never share a signature."""
    if type(v) in _EXACT_PLAIN_TYPES or isinstance(v, _PLAIN_TYPES) or isinstance(v, enum.Enum):
        return (type(v), v)
    if type(v) in (tuple, list, set, frozenset):
        items = sorted(map(_value_sig, v), key=repr) if isinstance(v, (set, frozenset)) else map(_value_sig, v)
        return (type(v), tuple(items))
    if type(v) is dict and all(isinstance(k, str) for k in v):
        return (dict, tuple(sorted((k, _value_sig(x)) for k, x in v.items())))
    return ("object", id(v))


def _own_attributes(m: nn.Module) -> list[tuple[str, Any]]:
    """The plain attributes of ``m`` itself that its forward may read. A ``torch.compile``
    wrapper has none of its own that matter: its per-instance ``forward`` and dynamo
    context compile the wrapped module (compared as its child ``_orig_mod``)."""
    if type(m).__name__ == "OptimizedModule" and isinstance(getattr(m, "_orig_mod", None), nn.Module):
        return []
    return [(k, v) for k, v in vars(m).items() if k not in _MODULE_INTERNALS]


def plain_attribute_names(m: Optional[nn.Module], signature: Optional[tuple] = None) -> set[str]:
    """The names of the plain attributes :func:`structure_signature` reads, over ``m`` and
    its submodules (assigning one of them must re-check a plan that fused ``m``);
    ``signature``: ``m``'s signature, already made (the names are read off it)."""
    if signature is not None:
        return {k for *_, attributes in signature for k, _ in attributes}
    assert m is not None
    return {k for sub in m.modules() for k, _ in _own_attributes(sub)}


def structure_signature(m: nn.Module) -> tuple:
    """Everything of a module call but its parameters and buffers that its forward may
    read: for it and each submodule, the class, the training flag, ``extra_repr`` and
    every plain attribute of the instance. A fused kernel runs all members through one
    member's code (``vmap`` over ``functional_call`` of the first member), which swaps
    in each member's parameters and buffers only; members that differ in anything else
    (a ReLU child against an Identity, a ``scale`` attribute that ``extra_repr`` does not
    print, an instance's own ``forward``) must not share a signature."""
    if not m._modules and type(m).named_modules is nn.Module.named_modules:
        # A module without children (most calls): named_modules() yields it alone.
        return (("", type(m), m.training, m.extra_repr(), _attributes_signature(m)),)
    return tuple(
        (name, type(sub), sub.training, sub.extra_repr(), _attributes_signature(sub)) for name, sub in m.named_modules()
    )


def _attributes_signature(m: nn.Module) -> tuple:
    if type(m).__name__ == "OptimizedModule":
        return tuple(sorted((k, _value_sig(v)) for k, v in _own_attributes(m)))
    # As the line above, with the names of the attributes that count read once per
    # layout of the instance's __dict__ (alike modules share one), in sorted order.
    state = vars(m)
    layout = tuple(state)
    names = _OWN_NAMES.get(layout)
    if names is None:
        names = tuple(sorted(k for k in layout if k not in _MODULE_INTERNALS))
        if len(_OWN_NAMES) < 1024:
            _OWN_NAMES[layout] = names
    out = []
    for k in names:
        v = state[k]
        out.append((k, (type(v), v) if type(v) in _EXACT_PLAIN_TYPES else _value_sig(v)))
    return tuple(out)


_OWN_NAMES: dict[tuple, tuple] = {}


def _meta_sig(meta: Optional[ValueMeta]) -> Any:
    if isinstance(meta, TensorMeta):
        return ("T", meta.shape, meta.dtype, meta.device)
    if isinstance(meta, ConstMeta):
        return ("C", meta.type_name, meta.value if _hashable(meta.value) else None)
    if isinstance(meta, tuple):
        return tuple(_meta_sig(m) for m in meta)
    return None


def _hashable(v: Any) -> bool:
    try:
        hash(v)
        return True
    except TypeError:
        return False


# Argument values that are hashable and compare by value, whatever they hold: their
# signature is themselves (``_arg_sig`` answers them before its questions).
_CONST_ATOMS = frozenset({int, float, bool, str, type(None)})


def _arg_sig(arg: Any, metas: dict[fx.Node, ValueMeta], nodes: Optional[dict[fx.Node, Any]] = None) -> Any:
    """The signature of one argument: a node by its value's description, a constant by
    value. ``nodes``: signatures of nodes already made (one node feeds many calls)."""
    kind = type(arg)
    if kind is fx.Node and nodes is not None:
        sig = nodes.get(arg)
        if sig is None:
            sig = nodes[arg] = ("node", _meta_sig(metas.get(arg)))
        return sig
    if kind in _CONST_ATOMS:
        return ("const", kind.__name__, arg)
    if isinstance(arg, fx.Node):
        return ("node", _meta_sig(metas.get(arg)))
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_sig(a, metas, nodes) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_sig(v, metas, nodes)) for k, v in arg.items()))
    if kind is slice:
        start, stop, step = arg.start, arg.stop, arg.step
        if type(start) in _CONST_ATOMS and type(stop) in _CONST_ATOMS and type(step) in _CONST_ATOMS:
            return (
                "slice",
                ("const", type(start).__name__, start),
                ("const", type(stop).__name__, stop),
                ("const", type(step).__name__, step),
            )
    if isinstance(arg, slice):
        return (
            "slice",
            _arg_sig(arg.start, metas, nodes),
            _arg_sig(arg.stop, metas, nodes),
            _arg_sig(arg.step, metas, nodes),
        )
    if _hashable(arg):
        return ("const", type(arg).__name__, arg)
    return ("obj", id(arg))


def _named_tensors(m: nn.Module, table: str) -> Any:
    """``m.named_parameters()`` (``table="_parameters"``) or ``m.named_buffers()``
    (``"_buffers"``); for a module without children (most calls a model makes) read
    straight from its table, without the generic walk over submodules."""
    method = "named_parameters" if table == "_parameters" else "named_buffers"
    if m._modules or getattr(type(m), method) is not getattr(nn.Module, method):
        return getattr(m, method)()
    seen: set[int] = set()
    out = []
    for name, t in getattr(m, table).items():
        if t is not None and id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _tensor_descriptions(m: nn.Module) -> tuple[tuple, tuple]:
    """``(name, shape, dtype, device, requires_grad)`` of each of ``m``'s parameters and
    ``(name, shape, dtype, device)`` of each buffer, as ``named_parameters()`` and
    ``named_buffers()`` give them (a tensor registered twice once). A module without
    children whose class walks its tables as ``nn.Module`` does (most calls) has its
    tables read here, an empty one (a ReLU's parameters, most buffers) at no cost."""
    kind = type(m)
    if (
        m._modules
        or kind.named_parameters is not nn.Module.named_parameters
        or kind.named_buffers is not nn.Module.named_buffers
    ):
        return (
            tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in _named_tensors(m, "_parameters")),
            tuple((n, tuple(b.shape), b.dtype, b.device) for n, b in _named_tensors(m, "_buffers")),
        )
    params: tuple = ()
    table = m._parameters
    if table:
        seen: set[int] = set()
        out = []
        for n, p in table.items():
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                out.append((n, tuple(p.shape), p.dtype, p.device, p.requires_grad))
        params = tuple(out)
    buffers: tuple = ()
    table = m._buffers
    if table:
        seen = set()
        out = []
        for n, b in table.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                out.append((n, tuple(b.shape), b.dtype, b.device))
        buffers = tuple(out)
    return params, buffers


def _tensor_args(node: fx.Node) -> bool:
    """Whether every Node argument is a direct positional argument (no nesting)."""
    if not node.kwargs:
        for a in node.args:
            if type(a) is not fx.Node and not isinstance(a, fx.Node):
                break
        else:
            return True
    for a in list(node.kwargs.values()):
        if isinstance(a, fx.Node) or _contains_node(a):
            return False
    for a in node.args:
        if not isinstance(a, fx.Node) and _contains_node(a):
            return False
    return True


def _contains_node(a: Any) -> bool:
    if type(a) in _CONST_ATOMS:
        return False
    if isinstance(a, fx.Node):
        return True
    if isinstance(a, (tuple, list)):
        return any(_contains_node(x) for x in a)
    if isinstance(a, dict):
        return any(_contains_node(x) for x in a.values())
    if isinstance(a, slice):
        return any(_contains_node(x) for x in (a.start, a.stop, a.step))
    return False


_EFFECT = "writes shared state or draws random numbers, ordered with other nodes that do (kept in eager order)"
_WRITES_PARAMETER = (
    "writes its own parameter in place (a fused member's parameter is a view of its group's stack, which "
    "autograd refuses to see written)"
)
_RETAINED = "its gradient is retained (retain_grad): the backward must pass through this tensor"


def _grad_retained(node: fx.Node) -> bool:
    """Whether the forward calls ``retain_grad()`` on ``node``'s value or a view of it.
    Fused, the value would be a member's part of the kernel's output, and the next
    layer's kernel would read the stacked output around it: the backward would never
    pass through the tensor whose ``.grad`` the caller reads."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for user in todo.pop().users:
            if user.op == "call_method" and user.target == "retain_grad":
                return True
            if user not in seen and is_glue(user):
                seen.add(user)
                todo.append(user)
    return False


_VALUE_SIZED = "its sizes are decided by tensor values (a boolean mask, nonzero): they may differ on the next call"

# Ops whose output's sizes the values of a tensor argument decide: every call of one
# signature may give other sizes (``x[route == i]`` selects as many rows as match).
_VALUE_SIZED_OPS = frozenset(
    {"nonzero", "masked_select", "unique", "unique_consecutive", "argwhere", "bincount", "repeat_interleave"}
)


def _bool_tensor(a: Any, metas: dict[fx.Node, ValueMeta]) -> bool:
    """Whether ``a`` (an index, or a tuple or list of them) holds a boolean tensor."""
    if isinstance(a, fx.Node):
        meta = metas.get(a)
        return isinstance(meta, TensorMeta) and meta.dtype in (torch.bool, torch.uint8)
    if isinstance(a, (tuple, list)):
        return any(_bool_tensor(x, metas) for x in a)
    return False


def _sizes_from_values(node: fx.Node, metas: dict[fx.Node, ValueMeta]) -> bool:
    if node.op == "call_method":
        return node.target in _VALUE_SIZED_OPS
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return len(node.args) == 2 and _bool_tensor(node.args[1], metas)
    if node.target is torch.where:
        return len(node.args) + len(node.kwargs) == 1  # torch.where(cond): nonzero
    return getattr(node.target, "__name__", None) in _VALUE_SIZED_OPS


def sized_by_values(graph: fx.Graph, metas: dict[fx.Node, ValueMeta]) -> set[fx.Node]:
    """The nodes whose output's sizes may depend on tensor values: a boolean-mask index,
    ``nonzero``, ``masked_select``, ``unique``... and everything computed from one (a
    size read from such a value, a module applied to it). A plan is made for the
    inputs' shapes, and such a node's shape is not fixed by them: fused with another
    node of equal shape on the recording call, it could meet one of another size on the
    next (members reading rows chosen by a mask: X-MOD's language adapters, an expert
    module each)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if _sizes_from_values(node, metas) or any(n in out for n in node.all_input_nodes):
            out.add(node)
    return out


class _Static(NamedTuple):
    """What of a node's fusion signature does not depend on the input sizes: read off the
    trace and the modules once, and kept across the plans of one trace
    (:class:`StaticSignatures`)."""

    # Every Node argument is a direct one (_tensor_args); None for a function or method
    # without a batched kernel, where only the note of why it is not fused asks it.
    tensor_args: Optional[bool]
    module: Optional[nn.Module]  # the called module, for a call_module node
    excluded: Optional[str]  # why a module call is left alone whatever the sizes (hooks...)
    structure: tuple  # structure_signature(module), or ()
    vmap: bool  # the module has no kernel of its own (vmap)
    supported: bool  # a function or method with a batched kernel
    wide: Optional[tuple]  # a Linear/Conv's configuration but its output width (wide_key)


class StaticSignatures:
    """The size-independent half of every node's fusion signature for one trace, kept
    from one plan of the trace to the next (its next input sizes).

    What it holds is a function of the trace and of the modules' configuration only: the
    module each node calls, whether its arguments are plain, its hooks and the
    configuration :func:`structure_signature` reads (the parameters and buffers, which
    ``m.bias = None`` replaces without a trace, are read again on every plan). The names
    of the attributes that configuration reads are watched (``_generation.watch``), so
    assigning one on any module of the model drops every entry (:meth:`valid` compares
    the counters they were made under), as does registering a module hook; a re-wired
    module drops the trace, and these entries with it. The size-dependent half (input and
    output metas, in-place effects, parameter shapes and flags) is read on every plan,
    and the groups are formed from both halves as a fresh proposal forms them.
    """

    __slots__ = ("entries", "stamp", "groups", "unwatched")

    def __init__(self) -> None:
        self.entries: dict[str, _Static] = {}
        self.stamp: Optional[tuple] = None
        # The groups the last proposal made: (kind, member names), to tell a plan whose
        # groups came out as before.
        self.groups: Optional[list[tuple[str, tuple[str, ...]]]] = None
        # Attribute names read into entries since the last seal(), to watch.
        self.unwatched: set[str] = set()

    @staticmethod
    def _now() -> tuple:
        # A re-wired module (a submodule swapped, a parameter re-registered) moves the
        # generation, and the wrapper drops every trace whose modules moved (and these
        # entries with them, FusionContext.invalidate) before it plans again; the
        # generation itself moves for any wrapped model anywhere (a new wrapper, .eval()).
        return (_generation.hook_registrations(), _generation.assignments())

    def valid(self) -> bool:
        """Whether the cached entries still describe the modules; if not, they are dropped."""
        if self.stamp == self._now():
            return True
        self.clear()
        return False

    def clear(self) -> None:
        self.entries.clear()
        self.unwatched.clear()
        self.stamp = None

    def seal(self) -> None:
        """The entries describe the modules as they are now: from here on, assigning an
        attribute any of them read moves the counters :meth:`valid` compares."""
        if self.unwatched:
            _generation.watch(self.unwatched)
            self.unwatched = set()
        self.stamp = self._now()


class FusionSupport:
    """The support policy: whether a node can be fused, under which signature, and why not.

    The counterpart of ``torch.fx``'s ``OperatorSupport``, with two additions the
    grouping needs: :meth:`signature` says *with what* a node may be fused (nodes fuse
    only with nodes of the same signature), and :attr:`excluded` keeps the reason for each
    node that could otherwise be fused but is left alone on purpose (the plan shows them).

    ``statics``: the size-independent halves of the signatures from an earlier plan of
    the same trace (:class:`StaticSignatures`), used where still valid and filled in
    where not.
    """

    def __init__(self, root: nn.Module, metas: dict[fx.Node, ValueMeta], statics: Optional[StaticSignatures] = None):
        self.root = root
        self.metas = metas
        self.excluded: dict[fx.Node, str] = {}
        self.value_sized: set[fx.Node] = set()
        """Nodes whose sizes tensor values decide (:func:`sized_by_values`): never fused."""
        self.structures: dict[int, tuple[nn.Module, tuple]] = {}
        """:func:`structure_signature` of each module a signature was made for, by id (a
        module called at several nodes is read once; the fused ones are kept to check)."""
        if statics is None:
            statics = StaticSignatures()
        # Whether the signatures' static halves come from an earlier plan.
        self.reused = statics.valid() and bool(statics.entries)
        self.statics = statics
        # The argument signature of each node read so far (an input feeds many calls).
        self._node_sigs: dict[fx.Node, Any] = {}
        # Structure signatures made in this pass, each once (see structure()), and those
        # whose attribute names the static entries watch (kept: keyed by id).
        self._interned: dict[tuple, tuple] = {}
        self._watched: dict[int, tuple] = {}

    def structure(self, m: nn.Module) -> tuple:
        """:func:`structure_signature` of ``m``, computed once per pass."""
        entry = self.structures.get(id(m))
        if entry is None:
            signature = structure_signature(m)
            # Equal signatures (alike members) are one tuple: comparing them (grouping)
            # is then an identity check, and their attribute names are read once.
            signature = self._interned.setdefault(signature, signature)
            entry = self.structures[id(m)] = (m, signature)
        return entry[1]

    def _watch_attributes(self, signature: tuple) -> None:
        """Have the static entries watch the plain attributes ``signature`` reads."""
        if id(signature) not in self._watched:
            self._watched[id(signature)] = signature
            self.statics.unwatched |= plain_attribute_names(None, signature)

    def kind(self, node: fx.Node) -> str:
        """The kernel kind of a supported node (``function`` for functions and methods)."""
        return module_kind(submodule(self.root, node.target)) if node.op == "call_module" else "function"

    def _static(self, node: fx.Node) -> _Static:
        entries = self.statics.entries
        st = entries.get(node.name)
        if st is not None:
            if st.module is not None:
                self.structures.setdefault(id(st.module), (st.module, st.structure))
            return st
        if node.op == "call_module":
            m = submodule(self.root, node.target)
            kind = module_kind(m)
            excluded = None
            if has_hooks(m) or (m._modules and any(has_hooks(s) for s in m.modules())):
                excluded = "has hooks (they must fire per member)"
            elif kind == "batchnorm" and m.momentum is None:
                excluded = "BatchNorm with momentum=None (a cumulative average per member)"
            structure = self.structure(m)
            self._watch_attributes(structure)
            st = _Static(_tensor_args(node), m, excluded, structure, kind == "vmap", True, _wide_config(m))
        else:
            if node.op == "call_function":
                supported = node.target in ELEMENTWISE_FUNCTIONS and not isinstance(node.target, BranchCall)
            else:
                supported = node.op == "call_method" and node.target in ELEMENTWISE_METHODS
            # (An unsupported one, a slice say, is never fused: its arguments are looked
            # at only where it has an effect, to say why it is not; see signature.)
            st = _Static(_tensor_args(node) if supported else None, None, None, (), False, supported, None)
        entries[node.name] = st
        return st

    def signature(self, node: fx.Node) -> Optional[tuple]:
        """The fusion signature of a node, or ``None``; records in :attr:`excluded` the
        reason where a node that could otherwise be fused is left alone on purpose.

        Its size-independent half comes from :class:`StaticSignatures`; the rest (the
        metas of the node and its arguments, the in-place effects of this plan's
        recording call, the parameters' shapes and flags) is read here, on every plan."""
        metas = self.metas
        out = metas.get(node)
        if not isinstance(out, TensorMeta):
            return None
        st = self._static(node)
        if st.tensor_args is False:
            return None
        excluded = None
        if node_meta.writes_parameter(node):
            excluded = _WRITES_PARAMETER
        elif node_meta.has_effect(node):
            # It writes a storage another node reads or writes (or reads one written in
            # place): its place in eager order is kept, so it runs alone.
            excluded = _EFFECT
        elif st.excluded is not None:
            excluded = st.excluded
        elif _grad_retained(node):
            excluded = _RETAINED
        elif node in self.value_sized and (st.module is not None or st.supported):
            excluded = _VALUE_SIZED
        if st.tensor_args is None:
            # A function or method without a batched kernel: never fused, and noted as
            # left alone (where its arguments are plain, as for any node) only where one
            # of the reasons above holds, so its arguments are looked at only then.
            if excluded is None or not _tensor_args(node):
                return None
        if excluded is not None:
            log.debug("fuse: %s %s; not fused", node_label(node), excluded)
            self.excluded[node] = excluded
            return None
        if st.module is not None:
            params, buffers = _tensor_descriptions(st.module)
            if st.vmap and not params and not buffers:
                return None
            return ("module", st.structure, params, buffers, *self._args_sig(node))
        if not st.supported:
            return None
        return ("function", node.op, node.target, *self._args_sig(node))

    def _args_sig(self, node: fx.Node) -> tuple[tuple, tuple]:
        metas, nodes = self.metas, self._node_sigs
        kwargs = node.kwargs
        return (
            tuple(_arg_sig(a, metas, nodes) for a in node.args),
            tuple((k, _arg_sig(v, metas, nodes)) for k, v in kwargs.items()) if kwargs else (),
        )

    def wide_key(self, node: fx.Node) -> Optional[tuple]:
        """For a Linear/Conv call on one tensor, what members of a wide group share (the
        input node and everything but the output width); ``None`` for any other node."""
        if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
            return None
        st = self.statics.entries.get(node.name) or self._static(node)  # made by signature()
        if st.wide is None:
            return None
        m = st.module
        p = m.weight
        return (node.args[0], st.wide, m.bias is not None, p.dtype, p.device, p.requires_grad, m.training)


def _wide_config(m: nn.Module) -> Optional[tuple]:
    """What a Linear/Conv shares with the members of a wide group but its output width
    and its parameters (read per plan); ``None`` for any other module."""
    if "forward" in vars(m):  # an instance's own forward: the wide kernel would skip it
        return None
    if type(m) is nn.Linear:
        return ("linear", m.in_features)
    if type(m) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and m.groups == 1 and m.padding_mode == "zeros":
        return (type(m), m.in_channels, m.kernel_size, m.stride, m.padding, m.dilation)
    return None


# --- grouping ------------------------------------------------------------------------


@dataclass
class Proposals:
    """What :func:`propose` found."""

    groups: list[tuple[str, list[fx.Node]]] = field(default_factory=list)
    """``(kernel kind, members)`` for each group, in graph order (by level, then position)."""
    excluded: list[tuple[str, list[fx.Node]]] = field(default_factory=list)
    """``(reason, members)``: nodes left alone on purpose, grouped roughly as they would
    have been, where enough of them to make a group."""
    structures: dict[int, tuple[nn.Module, tuple]] = field(default_factory=dict)
    """``(module, structure_signature(module))`` of the modules of the signatures, by id."""


def _origins(node: fx.Node) -> tuple:
    """For inputs picked out of another value (slices, split parts), that value.

    Members whose inputs are parts of different tensors go to different groups, each
    reading its parts as one view, rather than one group that copies them together.
    """
    out = []
    for a in node.args:
        if isinstance(a, fx.Node) and a.op == "call_function" and a.target is operator.getitem:
            out.append(a.args[0])
        else:
            out.append(None)
    return tuple(out)


def _levels(graph: fx.Graph) -> dict[fx.Node, int]:
    level: dict[fx.Node, int] = {}
    for node in graph.nodes:
        ins = node.all_input_nodes
        level[node] = 1 + max(map(level.__getitem__, ins)) if ins else 0
    return level


def propose(graph: fx.Graph, support: FusionSupport, min_size: int) -> Proposals:
    """Groups of at least ``min_size`` nodes that ``support`` allows to run as one."""
    root = support.root
    level = _levels(graph)
    position = {n: i for i, n in enumerate(graph.nodes)}
    support.value_sized = sized_by_values(graph, support.metas)
    sigs: dict[fx.Node, tuple] = {}
    for node in graph.nodes:
        if node.op in ("call_module", "call_function", "call_method"):
            sig = support.signature(node)
            if sig is not None:
                sigs[node] = sig
    out = Proposals()
    # Nodes left alone on purpose, grouped as they would have been (roughly): the plan
    # says why they were not fused.
    excluded: dict[tuple, list[fx.Node]] = {}
    for node, reason in support.excluded.items():
        what = type(submodule(root, node.target)) if node.op == "call_module" else target_name(node)
        excluded.setdefault((what, level[node], reason), []).append(node)
    for (_, _, reason), nodes in excluded.items():
        if len(nodes) >= min_size:
            out.excluded.append((reason, nodes))
    taken: set[fx.Node] = set()
    # Wide groups: Linear/Conv of different widths reading one tensor.
    wide: dict[tuple, list[fx.Node]] = {}
    for node in sigs:
        # The members of a wide group are users of the one input they share: a node whose
        # input has fewer than ``min_size`` users is in no group that is kept (most
        # Linears read a tensor of their own), so its key is not made.
        first = node.args[0] if len(node.args) == 1 else None
        if type(first) is fx.Node and len(first.users) < min_size:
            continue
        key = support.wide_key(node)
        if key is not None:
            wide.setdefault(key, []).append(node)
    for nodes in wide.values():
        if len(nodes) < min_size:
            continue  # (most Linears read a tensor of their own)
        widths = {tuple(submodule(root, n.target).weight.shape) for n in nodes}
        if len(widths) > 1:
            out.groups.append(("wide", nodes))
            taken.update(nodes)
    buckets: dict[tuple, list[fx.Node]] = {}
    for node, sig in sigs.items():
        if node not in taken:
            buckets.setdefault((sig, level[node], _origins(node)), []).append(node)
    for nodes in buckets.values():
        if len(nodes) >= min_size:
            out.groups.append((support.kind(nodes[0]), nodes))
    out.groups.sort(key=lambda p: (level[p[1][0]], position[p[1][0]]))
    out.groups, dropped = _without_effect_cycles(graph, out.groups)
    for _kind, nodes in dropped:
        out.excluded.append((_EFFECT_CYCLE, nodes))
    out.structures = support.structures
    return out


_EFFECT_CYCLE = "run as one kernel, it would break the eager order of in-place writes or random draws around it"


def _without_effect_cycles(
    graph: fx.Graph, groups: list[tuple[str, list[fx.Node]]]
) -> tuple[list[tuple[str, list[fx.Node]]], list[tuple[str, list[fx.Node]]]]:
    """``groups`` less those that, each run as one node, would close a cycle with the
    recording's effect edges (``node_meta.effect_after``), and the groups dropped.

    Levels count data edges only, and the nodes effect edges join are never members; but
    a group can sit between two of them: members ``fc2_i`` of branches ``i`` that each
    draw a dropout mask before and after it. Eager draws branch 0's two masks, then
    branch 1's; one kernel for every ``fc2_i`` needs every first mask before it and every
    second mask after it. Checked only where some node has an effect edge (none in most
    plans); groups are taken in level order, each kept where the graph with it and the
    groups kept before it contracted stays acyclic."""
    nodes = list(graph.nodes)
    by_name = {n.name: n for n in nodes}
    extra: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        after = node_meta.effect_after(n)
        if after:
            extra[n] = [by_name[a] for a in after if a in by_name]
    if not extra or not groups:
        return groups, []
    if _acyclic(nodes, extra, groups):
        return groups, []
    kept: list[tuple[str, list[fx.Node]]] = []
    dropped: list[tuple[str, list[fx.Node]]] = []
    for group in groups:
        if _acyclic(nodes, extra, kept + [group]):
            kept.append(group)
        else:
            dropped.append(group)
    return kept, dropped


def _acyclic(
    nodes: list[fx.Node], extra: dict[fx.Node, list[fx.Node]], groups: list[tuple[str, list[fx.Node]]]
) -> bool:
    """Whether the graph of ``nodes`` (data edges and the ``extra`` edges) stays acyclic
    with each group's members contracted into one node (Kahn's algorithm)."""
    rep: dict[fx.Node, Any] = {}
    for i, (_, members) in enumerate(groups):
        for m in members:
            rep[m] = ("group", i)
    succ: dict[Any, set] = {}
    indeg: dict[Any, int] = {}
    for n in nodes:
        r = rep.get(n, n)
        indeg.setdefault(r, 0)
        for p in (*n.all_input_nodes, *extra.get(n, ())):
            q = rep.get(p, p)
            if q is r:
                continue
            targets = succ.setdefault(q, set())
            if r not in targets:
                targets.add(r)
                indeg[r] = indeg.get(r, 0) + 1
    ready = [r for r, d in indeg.items() if d == 0]
    seen = 0
    while ready:
        r = ready.pop()
        seen += 1
        for t in succ.get(r, ()):
            indeg[t] -= 1
            if indeg[t] == 0:
                ready.append(t)
    return seen == len(indeg)
