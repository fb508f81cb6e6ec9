"""Ranks of traced values: what ``len(x.shape)`` and ``(*x.shape[:-1], -1, d)`` need.

fx refuses to iterate a proxy or take its ``len``: the length of ``x.shape[:-1]`` is not
in the graph. Yet a trace is made for one rank of every input (the trace is keyed by
them, as plans are), and most operations give an output whose rank follows from their
inputs' ranks and their constant arguments alone, whatever the sizes. So the tracer
tracks ranks alongside the graph: a traced shape (``x.shape``, ``x.size()``, a slice of
either, a concatenation with a tuple) of a value of known rank has a known length, and
iterating it yields one ``getitem`` node per dimension. The sizes stay graph values: the
trace does not specialise on them.

A rank is known for: graph inputs; parameters and buffers (``get_attr``); the leaf
modules whose output rank is their input's (``Linear``, norms, activations, dropout) or
one more (``Embedding``; ``F.embedding`` too), where the class runs torch's own ``forward`` (a subclass's
forward may return any rank); element-wise operations and methods (broadcasting: the
largest rank); views and reshapes with explicit sizes; ``transpose``, ``permute``,
``unsqueeze``, ``flatten``, ``expand``, ``repeat``; reductions with explicit ``dim`` and
``keepdim``; ``matmul``, ``mm``, ``addmm``, ``bmm``, ``baddbmm``; ``cat`` and ``stack``;
indexing with ints, slices, ``None`` and ``...``, or with one tensor of known rank and
dtype (integers: its dimensions replace the first; booleans: theirs become one); ``arange``, ``linspace``, ``eye``, the
``*_like`` factories and ``zeros``/``ones``/``empty``/``full``/``rand``/``randn`` given
ints, sizes read from a shape (``x.shape[0]``, ``x.size(1)``) or a shape of known length.
Anything else (``squeeze()``, whose rank depends on sizes; indexing with a tensor; an
opaque call's value) has no known rank, and the values computed from it neither:
iterating their shape fails as before.

Sequences of tensors: the items of ``split``, ``chunk``, ``tensor_split`` (the input's
rank), ``unbind`` (one less), ``max``/``min``/``median`` with a ``dim`` and ``sort``/
``topk`` (values and indices) have a known rank. Their *number* is known only where it
does not depend on a size: ``split`` with a list of sizes, ``tensor_split`` with a count
or a list of indices. ``split(n)``, ``chunk(n)`` (fewer pieces than ``n`` for a small
size) and ``unbind`` are unpacked only as fx does (``a, b, c = ...``), never iterated.

A known rank also answers ``x.dim()``, ``x.ndimension()`` and ``x.ndim`` while tracing
(``frontend.trace``): a branch on a rank is decided once per trace, as a rank of an
input is the same on every call a trace serves.

Dtypes are tracked where an explicit dtype fixes them, whatever the inputs': a cast
(``.to(torch.float32)``, ``.float()``, ``.to(other)`` of a known dtype), a factory given
``dtype=``, a comparison (``bool``), and operations keeping the dtype of operands so
known (views, ``where``, ``matmul`` and ``+ - * /`` of floating tensors of one dtype or
with Python numbers, ``+ - *`` of integer tensors with ints; ``arange`` of ints is
``int64``). ``x.dtype`` of such a value is answered while tracing
(``torch.finfo(w.dtype).min`` in GPT-Neo, XLNet's ``if mask.dtype == torch.float16``).

Outside autocast (whose ops compute in its own dtypes), dtypes also follow from the
inputs' (the trace is keyed by them) and the parameters': a parameter or buffer read by
``get_attr`` has its dtype, an ``Embedding`` its weight's, the modules and functions of
the rank rules that torch runs in their input's dtype (or raise) keep a floating input's
dtype, and binary operations promote as ``torch.result_type`` does for operands of those
dtypes and ranks (not where the default dtype decides: an integer tensor with a Python
float, true division of integers). What a value's rank or dtype rests on besides the
trace's key, a parameter's dtype or a rule for an opaque call's output, is tracked with
it (``RankTracker.sources``); where the trace used the value's rank, length or dtype
(:meth:`RankTracker.relied`), those are checked on every call (``Traced.dtypes_hold``,
``OpaqueFunction.expect``).
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn

from .hooks import has_hooks
from .nodes import AUGMENTED_OPERATORS
from .opaque_outputs import OutputCheck
from .trace_guard import autocast_state

__all__ = ["RankTracker"]

# Same rank as the first tensor argument, whatever the other arguments.
_SAME_METHODS = frozenset(
    """
    contiguous float half double bfloat16 int long bool to type_as clone detach cpu cuda
    softmax log_softmax relu relu_ sigmoid tanh exp log sqrt rsqrt neg abs square reciprocal
    sign erf cos sin triu tril clamp clamp_ clamp_min clamp_max masked_fill_
    fill_ zero_ requires_grad_ transpose permute roll flip cumsum cumprod nan_to_num
    sigmoid_ tanh_ exp_ mul_ add_ sub_ div_ neg_ argsort
    """.split()
)
_BROADCAST_METHODS = frozenset(
    "add sub mul div pow masked_fill maximum minimum eq ne lt le gt ge logical_and logical_or".split()
)
_LIKE_FACTORIES = {
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.rand_like,
    torch.randn_like,
}
# Functions that keep their input's rank and a floating input's dtype: in both the
# same-rank and the float-keeping tables.
_KEEPING_RANK_AND_FLOAT = (
    torch.sigmoid,
    torch.tanh,
    torch.relu,
    torch.exp,
    torch.log,
    torch.sqrt,
    torch.rsqrt,
    torch.abs,
    torch.cos,
    torch.sin,
    torch.erf,
    torch.softmax,
    torch.log_softmax,
    F.relu,
    F.gelu,
    F.silu,
    F.mish,
    F.elu,
    F.leaky_relu,
    F.softmax,
    F.log_softmax,
    F.dropout,
    F.layer_norm,
    F.group_norm,
    F.normalize,
    F.softplus,
    F.hardtanh,
    F.hardswish,
    F.hardsigmoid,
    F.sigmoid,
    F.tanh,
    F.linear,
    F.scaled_dot_product_attention,
    F.conv1d,
    F.conv2d,
    F.conv3d,
)
_SAME_FUNCTIONS = {
    torch.neg,
    torch.transpose,
    torch.clamp,
    torch.triu,
    torch.tril,
    torch.cumsum,
    torch.flip,
    torch.roll,
    torch.nan_to_num,
    torch.clone,
    *_LIKE_FACTORIES,
    *_KEEPING_RANK_AND_FLOAT,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    F.avg_pool1d,
    F.avg_pool2d,
    F.avg_pool3d,
    F.adaptive_avg_pool1d,
    F.adaptive_avg_pool2d,
    F.adaptive_avg_pool3d,
    F.batch_norm,
    F.instance_norm,
    F.interpolate,
    F.pad,
    operator.neg,
    operator.pos,
    operator.invert,
}
_BROADCAST_FUNCTIONS = {
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.mod,
    operator.pow,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    operator.xor,
    torch.add,
    torch.sub,
    torch.mul,
    torch.div,
    torch.pow,
    torch.maximum,
    torch.minimum,
    torch.eq,
    torch.ne,
    torch.lt,
    torch.gt,
    torch.logical_and,
    torch.logical_or,
}
_SAME_MODULES = (
    nn.Linear,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.Dropout,
    nn.Identity,
    nn.ReLU,
    nn.GELU,
    nn.SiLU,
    nn.Tanh,
    nn.Sigmoid,
    nn.Softmax,
    nn.LeakyReLU,
    nn.ELU,
    nn.Mish,
    nn.Hardswish,
    nn.Hardtanh,
    nn.Softplus,
)
# Convolutions, pooling and norms over spatial dimensions keep the rank too (batched or
# not); max pooling only without return_indices (checked below).
_SAME_MODULES = _SAME_MODULES + (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.Upsample,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
)
_RMS_NORM = getattr(nn, "RMSNorm", None)
if _RMS_NORM is not None:
    _SAME_MODULES = _SAME_MODULES + (_RMS_NORM,)

# Methods and functions giving a sequence of tensors (``RankTracker._split``).
# max(dim), min(dim), median(dim): (values, indices); with no argument one tensor of rank 0.
_PAIR_REDUCTIONS = frozenset({"max", "min", "median", "sort", "topk"})
_SPLIT_METHODS = frozenset({"split", "chunk", "unbind", "tensor_split"}) | _PAIR_REDUCTIONS
_SPLIT_FUNCTIONS = {
    torch.split: "split",
    torch.chunk: "chunk",
    torch.unbind: "unbind",
    torch.tensor_split: "tensor_split",
}

# Functions whose output has one rank whatever their arguments'.
_FIXED_RANK_FUNCTIONS = {
    torch.arange: 1,
    torch.linspace: 1,
    torch.eye: 2,
    torch.mm: 2,
    torch.addmm: 2,
    torch.bmm: 3,
    torch.baddbmm: 3,
}
# The factories themselves: fx replaces torch's names while tracing (autowrap).
_ARANGE, _FULL = torch.arange, torch.full
# Factories given their sizes (``RankTracker._factory``); ``*_like`` take their input's rank.
_SIZED_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.rand, torch.randn, torch.full}

# Dtypes (``RankTracker._dtype``).
_CAST_METHODS = {
    "float": torch.float32,
    "double": torch.float64,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bool": torch.bool,
    "long": torch.int64,
    "int": torch.int32,
}
_DTYPE_KEEPING_METHODS = frozenset(
    """
    contiguous clone detach transpose permute view reshape expand expand_as repeat unsqueeze squeeze
    flatten masked_fill masked_fill_ neg triu tril flip roll t view_as reshape_as split chunk unbind
    gather index_select
    """.split()
)
_DTYPE_KEEPING_FUNCTIONS = {
    torch.transpose,
    torch.permute,
    torch.reshape,
    torch.unsqueeze,
    torch.squeeze,
    torch.flatten,
    torch.neg,
    torch.triu,
    torch.tril,
    torch.flip,
    torch.roll,
    torch.clone,
    operator.neg,
    torch.split,
    torch.chunk,
    torch.unbind,
    torch.gather,
    torch.index_select,
}
_COMPARISONS = frozenset("eq ne lt le gt ge".split())
_COMPARISON_FUNCTIONS = {
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    torch.eq,
    torch.ne,
    torch.lt,
    torch.le,
    torch.gt,
    torch.ge,
}
_ARITHMETIC = frozenset("add sub mul div".split())
_ARITHMETIC_FUNCTIONS = {operator.add, operator.sub, operator.mul, operator.truediv, torch.add, torch.sub, torch.mul}
_INPLACE_OPERATORS = frozenset(AUGMENTED_OPERATORS)
# Operations that give a floating input's dtype (or raise): activations, norms, dropout,
# softmax without a dtype, floating reductions. On integers some give the default dtype.
_FLOAT_KEEPING_METHODS = frozenset(
    """
    softmax log_softmax relu sigmoid tanh exp log sqrt rsqrt erf cos sin abs square reciprocal
    sum mean amax amin cumsum relu_ sigmoid_ tanh_ exp_
    """.split()
)
_FLOAT_KEEPING_FUNCTIONS = {
    torch.sum,
    torch.mean,
    torch.amax,
    torch.amin,
    *_KEEPING_RANK_AND_FLOAT,
}
_FACTORY_DTYPES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.eye,
    torch.linspace,
    torch.rand,
    torch.randn,
    torch.tensor,
} | _LIKE_FACTORIES


def _arithmetic(dtype: Optional[torch.dtype], others: list, division: bool = False) -> Optional[torch.dtype]:
    """``+ - * /`` of a floating tensor of ``dtype`` with tensors of the same dtype or
    Python numbers: that dtype (a number never widens a floating tensor); ``+ - *`` of
    an integer tensor with tensors of its dtype or Python ints: that dtype."""
    if dtype is None or dtype is torch.bool or dtype.is_complex:
        return None
    numbers: tuple[type, ...] = (int, float, bool) if dtype.is_floating_point else (int, bool)
    if division and not dtype.is_floating_point:
        return None  # true division of integers gives floats
    for other in others:
        if isinstance(other, torch.dtype):
            if other != dtype:
                return None
        elif type(other) not in numbers:
            return None
    return dtype


_SAME_FORWARDS = frozenset(cls.forward for cls in _SAME_MODULES)
# Arguments that hold no graph value (nothing for _inherit to walk).
_ATOMS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})

_SIZES_METHODS = frozenset({"view", "reshape", "expand", "repeat", "new_zeros", "new_ones", "new_empty"})


class RankTracker:
    """The ranks of a trace's tensor values and the lengths of its shape values, by node.
    ``inputs``: the ranks of the graph's inputs in order (``None``: none known);
    ``dtypes``: their dtypes (``None``: none known)."""

    def __init__(self, inputs: Optional[Sequence[int]], dtypes: Optional[Sequence[torch.dtype]] = None):
        self.inputs = list(inputs) if inputs is not None else None
        # Under autocast, ops compute in autocast's own dtypes: only explicit casts count.
        self.input_dtypes = list(dtypes) if dtypes is not None and not autocast_state() else None
        self.placeholders = 0
        self.rank: dict[fx.Node, int] = {}
        self.len: dict[fx.Node, int] = {}
        # Sequences of tensors (``split``, ``unbind``, ``max(dim)``...): the rank of
        # every item, whatever their number.
        self.items: dict[fx.Node, int] = {}
        # Single sizes (``x.shape[0]``, ``x.size(-1)``): what a factory given one graph
        # value is given.
        self.sizes: set[fx.Node] = set()
        # Dtypes fixed by an explicit cast (``x.to(torch.float32)``), or following from
        # the inputs' and parameters' dtypes: ``x.dtype``.
        self.dtypes: dict[fx.Node, torch.dtype] = {}
        # What a value's rank or dtype rests on besides the trace's key (the inputs'
        # ranks and dtypes): ("param", module, name, dtype), a parameter's or buffer's
        # dtype; ("opaque", target, index, rank, dtype), what a rule promised of an
        # opaque call's item. Every source of a value's arguments is one of its own.
        self.sources: dict[fx.Node, frozenset] = {}
        # The sources of every value whose rank, length or dtype the trace used
        # (:meth:`relied`): checked on every call (``frontend.trace``).
        self.assumed: set = set()
        # Opaque calls whose items a rule knows: node -> {index: (rank, dtype, source)}.
        self.promised: dict[fx.Node, dict[int, tuple]] = {}
        # What each get_attr / call_module path named (``_attribute``), per path prefix:
        # a trace names the submodules of a few containers thousands of times.
        self._paths: dict[str, Any] = {}
        self._paths_root: Any = None

    def length(self, node: fx.Node) -> Optional[int]:
        """How many items the value of ``node`` has, where known (a shape, or a split
        into a constant number of pieces)."""
        return self.len.get(node)

    def rank_of(self, node: fx.Node) -> Optional[int]:
        """The rank of the tensor value of ``node``, where known (``x.dim()``, ``x.ndim``)."""
        if self.inputs is None:
            return None
        return self.rank.get(node)

    def relied(self, node: fx.Node, kind: str) -> None:
        """The trace used ``node``'s rank or length (``kind``), or its dtype (``"dtype"``):
        what that rests on must hold on every call. (A parameter's dtype says nothing of
        a rank, except where it decided one: ``"param_rank"``.)"""
        sources = self.sources.get(node, frozenset())
        self.assumed |= sources if kind == "dtype" else {s for s in sources if s[0] in _RANK_SOURCES}

    def promise(self, node: fx.Node, index: int, like: fx.Node, target: Any, dtype: bool = True) -> None:
        """A rule says item ``index`` of opaque call ``node``'s value has the rank and
        (where ``dtype``) the dtype of ``like``'s value, as far as those are known
        (``target``, the call's :class:`~streamsched.frontend.opaque_functions.OpaqueFunction`,
        checks it on every call the trace relied on it)."""
        rank = self.rank_of(like)
        known_dtype = self.dtypes.get(like) if dtype else None
        if rank is None and known_dtype is None:
            return
        source = ("opaque", target, index, rank, known_dtype)
        # It rests on the rule, and on what ``like``'s rank and dtype rest on.
        sources = self.sources.get(like, frozenset()) | {source}
        self.promised.setdefault(node, {})[index] = (rank, known_dtype, sources)

    def note(
        self,
        node: fx.Node,
        kind: str,
        target: Any,
        args: tuple,
        kwargs: dict,
        root: Any,
        module: Optional[nn.Module] = None,
    ) -> None:
        """Note what is known of a node just created. ``module``: a ``call_module``
        node's module where the caller holds it (``frontend.member_replay``: the child
        whose path is ``target``), so that it is not looked up by its path again."""
        index = None
        if kind == "placeholder":
            index = self.placeholders
            self.placeholders += 1
        if self._passed_on(node, kind, target, args):
            return
        if kind == "call_module" and self._same_module_call(node, target, args, root, module):
            self._inherit(node, args, kwargs)
            return
        try:
            dtype = self._dtype(kind, target, args, kwargs, root, index, node)
            if dtype is not None:
                self.dtypes[node] = dtype
        except Exception:  # noqa: BLE001 - an argument shaped unlike the rule expects: unknown
            pass
        if self.inputs is not None:
            try:
                self._note(node, kind, target, args, kwargs, root, index)
            except Exception:  # noqa: BLE001 - an argument shaped unlike the rule expects: unknown
                pass
        self._inherit(node, args, kwargs)

    def _same_module_call(
        self, node: fx.Node, target: Any, args: tuple, root: Any, module: Optional[nn.Module] = None
    ) -> bool:
        """What :meth:`_dtype` and :meth:`_note` conclude for a call of one of torch's
        modules that keep their input's rank and floating dtype (``Linear``, ``ReLU``,
        ``Conv2d``...; the most common node), with the module looked up once. ``False``
        (nothing noted) for any other call: the general rules then decide."""
        if not args:
            return False
        try:
            if module is None:
                module = self.attribute(root, str(target))
            forward = type(module).forward
            if (
                not isinstance(module, _SAME_MODULES)
                or forward not in _SAME_FORWARDS
                or isinstance(module, nn.Embedding)
                or has_hooks(module)
            ):
                return False
        except Exception:  # noqa: BLE001 - the general rules say what such a call gives
            return False
        if self.input_dtypes is not None:
            dtype = _floating(self._d(args[0]))
            if dtype is not None:
                self.dtypes[node] = dtype
        if self.inputs is not None:
            rank = self._r(args[0])
            if rank is not None:
                self.rank[node] = rank
        return True

    def _inherit(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """What a new value's known dtype, rank or length rests on: what its arguments'
        rest on (all of it for a dtype; for a rank or length, the rules for opaque calls
        and the dtypes that decided a rank only). A value with neither known passes
        nothing on."""
        has_dtype = node in self.dtypes
        if not has_dtype and node not in self.rank and node not in self.len and node not in self.items:
            return
        sources: set = set()
        known = self.sources
        for a in (*args, *kwargs.values()):
            if isinstance(a, fx.Proxy):  # the common argument: no walk
                sources.update(known.get(a.node, ()))
            elif type(a) not in _ATOMS:
                fx.node.map_aggregate(a, lambda v: sources.update(self._sources(v)))
        if not has_dtype:
            sources = {s for s in sources if s[0] in _RANK_SOURCES}
        if sources:
            self.sources[node] = self.sources.get(node, frozenset()) | sources

    def _rank_rests_on_dtype(self, node: fx.Node, value: Any) -> None:
        """``node``'s rank follows from the dtype of ``value``: the parameters' dtypes that
        rests on count for its rank too (``("param_rank", ...)``, kept where a rank is
        passed on or relied on)."""
        held = {("param_rank", *s[1:]) for s in self._sources(value) if s[0] in ("param", "param_rank")}
        if held:
            self.sources[node] = self.sources.get(node, frozenset()) | held

    def _sources(self, value: Any) -> frozenset:
        node = value.node if isinstance(value, fx.Proxy) else value
        return self.sources.get(node, frozenset()) if isinstance(node, fx.Node) else frozenset()

    def _assume(self, node: fx.Node, source: tuple) -> None:
        self.sources[node] = self.sources.get(node, frozenset()) | {source}

    def _passed_on(self, node: fx.Node, kind: str, target: Any, args: tuple) -> bool:
        """An opaque call's value read through its structure check (the same value), or
        an item of it a rule knows: noted here."""
        if kind != "call_function" or not args:
            return False
        base = args[0].node if isinstance(args[0], fx.Proxy) else args[0]
        if not isinstance(base, fx.Node) or base not in self.promised:
            return False
        if isinstance(target, OutputCheck):
            self.promised[node] = self.promised[base]
            if base in self.sources:
                self.sources[node] = self.sources[base]
            return True
        if target is operator.getitem and len(args) == 2 and type(args[1]) is int:
            known = self.promised[base].get(args[1])
            if known is None:
                return True
            rank, dtype, sources = known
            if rank is not None:
                self.rank[node] = rank
            if dtype is not None:
                self.dtypes[node] = dtype
            self.sources[node] = self.sources.get(node, frozenset()) | sources
            return True
        return False

    def dtype_of(self, node: fx.Node) -> Optional[torch.dtype]:
        """The dtype of the tensor value of ``node``, where known (``x.dtype``)."""
        return self.dtypes.get(node)

    def _d(self, value: Any) -> Optional[torch.dtype]:
        node = value.node if isinstance(value, fx.Proxy) else value
        if isinstance(node, fx.Node):
            return self.dtypes.get(node)
        return None

    def _is_int(self, value: Any) -> bool:
        """A Python int, or a size read from a shape (an int on every call)."""
        if type(value) is int:
            return True
        node = value.node if isinstance(value, fx.Proxy) else value
        return isinstance(node, fx.Node) and node in self.sizes

    def _is_tensor(self, value: Any) -> bool:
        node = value.node if isinstance(value, fx.Proxy) else value
        return isinstance(node, fx.Node) and (node in self.rank or node in self.dtypes)

    def _dtype(
        self, kind: str, target: Any, args: tuple, kwargs: dict, root: Any, index: Optional[int], node: fx.Node
    ) -> Optional[torch.dtype]:
        """The dtype of a new node's value where it follows from an explicit dtype (a
        cast to a named dtype, a factory given one, a comparison), from the inputs' and
        parameters' dtypes (outside autocast), or from operations on operands whose
        dtypes are so known, by torch's rules."""
        derived = self.input_dtypes is not None
        if kind == "placeholder":
            if derived and index is not None and index < len(self.input_dtypes):  # type: ignore[arg-type]
                return self.input_dtypes[index]  # type: ignore[index]
            return None
        if kind == "get_attr":
            return self._attribute_dtype(root, target, node) if derived else None
        if kind == "call_module":
            return self._module_dtype(root, target, args, node) if derived else None
        if kind == "call_method":
            return self._method_dtype(target, args, kwargs)
        if kind == "call_function":
            return self._function_dtype(target, args, kwargs)
        return None

    def _attribute_dtype(self, root: Any, target: Any, node: fx.Node) -> Optional[torch.dtype]:
        """A parameter's or buffer's dtype, which the plan then rests on."""
        found = _owner(root, str(target))
        if found is None:
            return None
        owner, name, value = found
        self._assume(node, ("param", owner, name, value.dtype))
        return value.dtype

    def _module_dtype(self, root: Any, target: Any, args: tuple, node: fx.Node) -> Optional[torch.dtype]:
        """An embedding's weight dtype, or a dtype-keeping module's input dtype (only for
        modules without hooks, running their class's own forward)."""
        module = self.attribute(root, str(target))
        forward = type(module).forward
        if has_hooks(module):
            return None  # its hooks may cast its input or hand back another value
        if isinstance(module, nn.Embedding) and forward is nn.Embedding.forward:
            weight = module._parameters.get("weight")
            if weight is None:
                return None
            self._assume(node, ("param", module, "weight", weight.dtype))
            return weight.dtype
        if isinstance(module, _SAME_MODULES) and forward in _SAME_FORWARDS and args:
            return _floating(self._d(args[0]))  # torch's ops give their input's dtype, or raise
        return None

    def _method_dtype(self, name: Any, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
        """A tensor method's result dtype: a cast, a dtype-keeping or float-keeping
        method, a comparison, or arithmetic by torch's promotion."""
        x = args[0] if args else None
        named = [a for a in (*args[1:], *kwargs.values()) if isinstance(a, torch.dtype)]
        if name in ("to", "type"):
            return self._cast_method_dtype(name, args, kwargs, named)
        if name in _CAST_METHODS and len(args) == 1:
            return _CAST_METHODS[name]
        if name == "type_as":
            return self._d(args[1])
        if name == "view" and len(args) == 2 and isinstance(args[1], torch.dtype):
            return args[1]
        if name in _DTYPE_KEEPING_METHODS and "dtype" not in kwargs and not named:
            return self._d(x)
        if name in _COMPARISONS and self._is_tensor(x):
            return torch.bool
        if name in _ARITHMETIC:
            others = [self._d(a) if isinstance(a, (fx.Node, fx.Proxy)) else a for a in args[1:]]
            return _arithmetic(self._d(x), others, division=name == "div") or self._promoted(
                args[:2], kwargs, name == "div"
            )
        if name in _FLOAT_KEEPING_METHODS and not named:
            return _floating(self._d(x))
        if name in ("clamp", "clamp_", "clip"):
            return _arithmetic(self._d(x), [*args[1:], *kwargs.values()])
        if name in ("maximum", "minimum"):
            return self._promoted(args[:2], kwargs)
        return None

    def _cast_method_dtype(self, name: str, args: tuple, kwargs: dict, named: list) -> Optional[torch.dtype]:
        """``x.to(...)`` / ``x.type(...)``: the dtype named, or that of the tensor given."""
        if named:
            return named[0]
        if name == "to" and len(args) == 2 and isinstance(args[1], torch.Tensor):
            return args[1].dtype
        if name == "to" and len(args) == 2 and not kwargs:
            return self._d(args[1]) if self._is_tensor(args[1]) else None
        return None

    def _function_dtype(self, target: Any, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
        """A function's result dtype, each family of functions by its own rule (tried in
        this order: a function in two families follows the first)."""
        if target in _FACTORY_DTYPES:
            return self._factory_dtype(target, args, kwargs)
        if target is operator.getitem:
            return self._d(args[0]) if self._is_tensor(args[0]) else None
        if target in _COMPARISON_FUNCTIONS and any(self._is_tensor(a) for a in args[:2]):
            return torch.bool
        if target in (operator.invert, torch.logical_not) and self._d(args[0]) is torch.bool:
            return torch.bool
        if target in _DTYPE_KEEPING_FUNCTIONS and "dtype" not in kwargs:
            return self._d(args[0])
        if target in (torch.cat, torch.concat, torch.stack):
            parts = args[0] if args else kwargs.get("tensors")
            dtypes = {self._d(p) for p in parts}
            return dtypes.pop() if len(dtypes) == 1 else None
        if target in (torch.matmul, operator.matmul, torch.bmm, torch.mm):
            if autocast_state():
                return None  # autocast computes them in its own dtype
            a, b = self._d(args[0]), self._d(args[1])
            return a if a is not None and a == b else None
        if target is torch.where and len(args) == 3:
            a, b = self._d(args[1]), self._d(args[2])
            return a if a is not None and a == b else self._promoted(args[1:], kwargs)
        if target in _ARITHMETIC_FUNCTIONS:
            return self._arithmetic_function_dtype(target, args, kwargs)
        if target in (torch.maximum, torch.minimum):
            return self._promoted(args, kwargs)
        if target in _INPLACE_OPERATORS and len(args) == 2:
            return self._inplace_operator_dtype(target, args)
        if target in (torch.clamp, torch.clip) and args:
            return _arithmetic(self._d(args[0]), [*args[1:], *kwargs.values()])
        if target in _FLOAT_KEEPING_FUNCTIONS:
            if any(isinstance(a, torch.dtype) for a in (*args, *kwargs.values())):
                return None
            return _floating(self._d(args[0] if args else kwargs.get("input")))
        return None

    def _factory_dtype(self, target: Any, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
        """A factory's dtype: the one given, int64 for ``arange`` of integers, or the
        model tensor's for a ``*_like``."""
        d = kwargs.get("dtype")
        if isinstance(d, torch.dtype):
            return d
        if target is _ARANGE and d is None and args and all(self._is_int(a) for a in args):
            return torch.int64  # arange of integers
        if target in _LIKE_FACTORIES and d is None and args:
            return self._d(args[0])
        return None

    def _arithmetic_function_dtype(self, target: Any, args: tuple, kwargs: dict) -> Optional[torch.dtype]:
        """``a + b`` and its kin: by a dtype operand's rule with Python numbers, else by
        torch's promotion."""
        values = [self._d(a) if isinstance(a, (fx.Node, fx.Proxy)) else a for a in args]
        division = target in (operator.truediv, torch.div)
        known = None
        if isinstance(values[0], torch.dtype):
            known = _arithmetic(values[0], values[1:], division)
        elif len(values) == 2 and isinstance(values[1], torch.dtype):
            known = _arithmetic(values[1], values[:1], division)
        return known or self._promoted(args, kwargs, division)

    def _inplace_operator_dtype(self, target: Any, args: tuple) -> Optional[torch.dtype]:
        """``a += b`` and its kin: the left tensor's dtype, or a number rebound."""
        if self._is_tensor(args[0]):
            return self._d(args[0])  # written into the left tensor, in its dtype (or raises)
        if target in (operator.iadd, operator.isub, operator.imul, operator.itruediv):
            return self._promoted(args, {}, target is operator.itruediv)  # a number: rebound
        return None

    def _promoted(self, operands: Sequence[Any], kwargs: dict, division: bool = False) -> Optional[torch.dtype]:
        """The dtype of a binary operation on ``operands`` by torch's type promotion, where
        it follows from their dtypes and ranks (a zero-dimensional tensor promotes less
        than a dimensioned one; an unknown rank is tried both ways). Not where it is the
        default dtype (an integer tensor with a Python float, true division of integers):
        that is global state the trace key does not hold."""
        if len(operands) != 2 or kwargs.get("alpha") is not None and type(kwargs["alpha"]) not in (int, bool):
            return None
        if any(k not in ("alpha", "out") for k in kwargs) or "out" in kwargs:
            return None
        options: list[list[Any]] = [[]]
        tensor_dtypes = []
        for value in operands:
            if isinstance(value, (fx.Node, fx.Proxy)):
                dtype, rank = self._d(value), self._r(value)
                if dtype is None:
                    return None
                tensor_dtypes.append(dtype)
                ranks = [rank] if rank is not None else [0, 1]
                options = [o + [_meta_operand(dtype, r)] for o in options for r in ranks]
            elif type(value) in (int, float, bool):
                options = [o + [value] for o in options]
            else:
                return None
        if not tensor_dtypes:
            return None
        with torch._C.DisableTorchFunction():  # the trace's modes would record the call
            results = {torch.result_type(*o) for o in options}
        if len(results) != 1:
            return None
        (result,) = results
        if result.is_floating_point and not any(d.is_floating_point for d in tensor_dtypes):
            return None  # a Python float made it floating: the default dtype
        if result.is_complex and not any(d.is_complex for d in tensor_dtypes):
            return None
        if division and not result.is_floating_point and not result.is_complex:
            return None  # true division of integers: the default dtype
        return result

    def attribute(self, root: nn.Module, path: str) -> Any:
        """:func:`_attribute`, each path prefix read once per trace: fx names a module
        call's target by the paths it took when the trace began, and the trace may not
        assign module attributes (``trace_guard``)."""
        if root is not self._paths_root:
            self._paths, self._paths_root = {}, root
        paths = self._paths
        if path in paths:
            return paths[path]
        parent, _, name = path.rpartition(".")
        value = _attribute(self.attribute(root, parent) if parent else root, name)
        paths[path] = value
        return value

    def _r(self, value: Any) -> Optional[int]:
        """The rank of an argument: a graph value's, 0 for a Python number."""
        if isinstance(value, fx.Node):
            return self.rank.get(value)
        if isinstance(value, fx.Proxy):
            return self.rank.get(value.node)
        if type(value) in (int, float, bool):
            return 0
        return None

    def _n(self, value: Any) -> Optional[int]:
        """The length of a shape argument: a tuple's, or a graph shape's."""
        if isinstance(value, (tuple, list, torch.Size)):
            return len(value)
        node = value.node if isinstance(value, fx.Proxy) else value
        if isinstance(node, fx.Node):
            return self.len.get(node)
        return None

    def _note(
        self, node: fx.Node, kind: str, target: Any, args: tuple, kwargs: dict, root: Any, index: Optional[int]
    ) -> None:
        rank: Optional[int] = None
        if kind == "placeholder":
            assert self.inputs is not None and index is not None
            if index < len(self.inputs):
                rank = self.inputs[index]
        elif kind == "get_attr":
            value = self.attribute(root, str(target))
            if isinstance(value, torch.Tensor):
                rank = value.dim()
                # A parameter, buffer or tensor attribute may be re-assigned, or given
                # new data, of another rank: guarded wherever this rank is used.
                owner_path, _, name = str(target).rpartition(".")
                owner = self.attribute(root, owner_path) if owner_path else root
                if isinstance(owner, nn.Module):
                    self._assume(node, ("param_dim", owner, name, rank))
        elif kind == "call_module":
            module = self.attribute(root, str(target))
            x = self._r(args[0]) if args else None
            # Only where the class runs torch's own forward: a subclass's forward (a
            # leaf_modules class, an opaque one) may give any rank.
            forward = type(module).forward
            if has_hooks(module):
                pass  # its hooks may hand back another value
            elif isinstance(module, _SAME_MODULES) and forward in _SAME_FORWARDS:
                rank = x
            elif isinstance(module, nn.Embedding) and forward is nn.Embedding.forward and x is not None:
                rank = x + 1
        elif kind == "call_method":
            rank = self._method(node, target, args, kwargs)
        elif kind == "call_function":
            rank = self._function(node, target, args, kwargs)
        if rank is not None:
            self.rank[node] = rank

    def _method(self, node: fx.Node, name: str, args: tuple, kwargs: dict) -> Optional[int]:
        x = self._r(args[0])
        if name == "size" and x is not None and len(args) == 1 and not kwargs:
            self.len[node] = x
            return None
        if name == "size" and len(args) == 2 and type(args[1]) is int and not kwargs:
            self.sizes.add(node)
            return None
        if name in _SIZES_METHODS and not kwargs:
            # The rank is the number of sizes given, whatever the input's.
            sizes = args[1:]
            if len(sizes) == 1 and not isinstance(sizes[0], int):
                return self._n(sizes[0])
            return len(sizes) if all(isinstance(s, (int, fx.Proxy, fx.Node)) for s in sizes) else None
        if x is None:
            return None
        if name in _SPLIT_METHODS:
            return self._split(node, name, x, args[1:], kwargs)
        if name in _SAME_METHODS:
            return x
        if name in _BROADCAST_METHODS:
            return _broadcast([x, *(self._r(a) for a in args[1:])])
        if name in ("view_as", "reshape_as", "expand_as"):
            return self._r(args[1])
        if name == "unsqueeze":
            return x + 1
        if name == "flatten":
            return _flatten(x, args[1:], kwargs)
        if name in ("sum", "mean", "amax", "amin", "logsumexp"):
            return _reduce(x, args[1:], kwargs)
        if name == "matmul":
            return _matmul(x, self._r(args[1]))
        return None

    def _function(self, node: fx.Node, fn: Any, args: tuple, kwargs: dict) -> Optional[int]:
        if fn is getattr and len(args) == 2 and args[1] == "shape":
            x = self._r(args[0])
            if x is not None:
                self.len[node] = x
            return None
        if fn is operator.getitem:
            return self._getitem(node, args[0], args[1])
        if fn is operator.add and self._n(args[0]) is not None and self._n(args[1]) is not None:
            if isinstance(args[0], (fx.Node, fx.Proxy)) or isinstance(args[1], (fx.Node, fx.Proxy)):
                self.len[node] = self._n(args[0]) + self._n(args[1])  # type: ignore[operator]
                return None
        if fn is len:
            return None
        if fn in _FIXED_RANK_FUNCTIONS:
            return _FIXED_RANK_FUNCTIONS[fn]
        if fn in _SIZED_FACTORIES:
            return self._factory(args[:1] if fn is _FULL else args, kwargs)
        if fn in _SPLIT_FUNCTIONS:
            x = self._r(args[0]) if args else None
            if x is not None:
                self._split(node, _SPLIT_FUNCTIONS[fn], x, args[1:], kwargs)
            return None
        if fn is F.embedding:
            x = self._r(args[0]) if args else self._r(kwargs.get("input"))
            return None if x is None else x + 1  # a vector per index
        if fn in _SAME_FUNCTIONS:
            return self._r(args[0]) if args else self._r(kwargs.get("input"))
        if fn in _BROADCAST_FUNCTIONS or (fn is torch.where and len(args) == 3):
            return _broadcast([self._r(a) for a in args])
        if fn in (torch.cat, torch.concat, torch.stack):
            parts = args[0] if args else kwargs.get("tensors")
            ranks = {self._r(p) for p in parts}
            if len(ranks) != 1 or None in ranks:
                return None
            (r,) = ranks
            return r + 1 if fn is torch.stack else r
        if fn in (torch.matmul, operator.matmul):
            return _matmul(self._r(args[0]), self._r(args[1]))
        if fn is torch.unsqueeze:
            x = self._r(args[0])
            return None if x is None else x + 1
        if fn is torch.flatten:
            x = self._r(args[0])
            return None if x is None else _flatten(x, args[1:], kwargs)
        if fn in (torch.sum, torch.mean, torch.amax, torch.amin):
            x = self._r(args[0])
            return None if x is None else _reduce(x, args[1:], kwargs)
        if fn in (torch.reshape,):
            return self._n(args[1]) if len(args) > 1 else None
        if fn is torch.permute:
            return self._r(args[0])
        return None

    def _factory(self, args: tuple, kwargs: dict) -> Optional[int]:
        """``torch.zeros(2, n)``, ``torch.ones(shape)``, ``torch.full(shape, v)``: as many
        dimensions as sizes given. One graph value alone may be a size or a whole shape:
        only a shape of known length or a size read from a shape is counted."""
        sizes = args if args else ()
        if "size" in kwargs:
            sizes = (kwargs["size"],)
        if not sizes:
            return None
        if len(sizes) == 1:
            (only,) = sizes
            if type(only) is int:
                return 1
            n = self._n(only)
            if n is not None:
                return n
            node = only.node if isinstance(only, fx.Proxy) else only
            return 1 if isinstance(node, fx.Node) and node in self.sizes else None
        if all(type(s) is int or (isinstance(s, (fx.Node, fx.Proxy)) and self._n(s) is None) for s in sizes):
            return len(sizes)  # several arguments: each one size
        return None

    def _split(self, node: fx.Node, name: str, x: int, args: tuple, kwargs: dict) -> Optional[int]:
        """A method or function giving a sequence of tensors: the rank of its items,
        and its length where that is constant. ``x``: the input's rank. ``None``: the
        node is not one tensor."""
        if name in _PAIR_REDUCTIONS:
            # max(dim), min(dim), sort, topk, ...: (values, indices), or one tensor.
            if name in ("sort", "topk"):
                return self._items(node, x, 2)
            dim = args[0] if args else kwargs.get("dim")
            if isinstance(dim, (fx.Node, fx.Proxy)):
                return None  # max(other): a tensor of broadcast rank, unknown here
            if dim is None:
                return 0 if not args and not kwargs else None
            keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
            if type(dim) is not int or type(keepdim) is not bool:
                return None
            return self._items(node, x if keepdim else x - 1, 2)
        if name == "unbind":
            # As many items as the dimension's size: their rank only.
            return self._items(node, x - 1, None)
        pieces = args[0] if args else kwargs.get("split_size_or_sections", kwargs.get("sections"))
        count: Optional[int] = None
        if name == "split" and type(pieces) in (list, tuple) and all(type(p) is int for p in pieces):
            count = len(pieces)  # explicit sizes: exactly that many pieces (or an error)
        elif name == "tensor_split" and type(pieces) is int:
            count = pieces  # n pieces, some possibly empty, whatever the size
        elif name == "tensor_split" and type(pieces) in (list, tuple) and all(type(p) is int for p in pieces):
            count = len(pieces) + 1
        # split(int) and chunk(n): how many pieces depends on the size; their rank does not.
        return self._items(node, x, count)

    def _items(self, node: fx.Node, rank: int, count: Optional[int]) -> None:
        self.items[node] = rank
        if count is not None:
            self.len[node] = count
        return None

    def _getitem(self, node: fx.Node, base: Any, index: Any) -> Optional[int]:
        base_node = base.node if isinstance(base, fx.Proxy) else base
        if isinstance(base_node, fx.Node) and base_node in self.items:
            # An item of a sequence of tensors, or a slice of it.
            if type(index) is int:
                return self.items[base_node]
            if type(index) is slice:
                self.items[node] = self.items[base_node]
                n = self.len.get(base_node)
                if n is not None and all(type(b) in (int, type(None)) for b in (index.start, index.stop, index.step)):
                    self.len[node] = len(range(n)[index])
            return None
        n = self._n(base) if isinstance(base, (fx.Node, fx.Proxy)) else None
        if n is not None:
            # An item or a slice of a shape.
            if isinstance(index, slice) and all(
                type(b) in (int, type(None)) for b in (index.start, index.stop, index.step)
            ):
                self.len[node] = len(range(n)[index])
            elif type(index) is int:
                self.sizes.add(node)
            return None
        x = self._r(base)
        if x is None:
            return None
        if isinstance(index, (fx.Node, fx.Proxy)):
            # One tensor as the index: integers pick along the first dimension (the
            # index's dimensions replace it), booleans select (theirs become one).
            r, dtype = self._r(index), self._d(index)
            if r is None or dtype is None:
                return None
            # The rank rests on the index's dtype: where a parameter's or buffer's dtype
            # gave it, that is guarded wherever this rank is used.
            self._rank_rests_on_dtype(node, index)
            if dtype in (torch.int64, torch.int32):
                return x - 1 + r if x >= 1 else None
            if dtype is torch.bool:
                return x - r + 1 if r <= x else None
            return None
        items = index if type(index) is tuple else (index,)
        if sum(item is Ellipsis for item in items) > 1:
            return None
        consumed = 0
        rank = x
        for item in items:
            if item is None:
                rank += 1
            elif item is Ellipsis:
                continue
            elif type(item) is int:
                consumed += 1
                rank -= 1
            elif type(item) is slice:
                consumed += 1
            else:
                return None  # a tensor, a list, a graph value: advanced indexing
        return rank if consumed <= x else None


# Operands for torch.result_type in RankTracker._promoted: by dtype and whether
# dimensioned (only that of a rank counts in promotion).
_META_OPERANDS: dict[tuple[torch.dtype, bool], torch.Tensor] = {}


def _meta_operand(dtype: torch.dtype, rank: int) -> torch.Tensor:
    """A meta tensor of ``dtype``, zero-dimensional where ``rank`` is 0. Made with torch
    function handling off: while a trace runs, its mode records a factory call made on
    the tracing thread as a node of the graph (``trace_guard.GradModeGuard``)."""
    key = (dtype, rank > 0)
    tensor = _META_OPERANDS.get(key)
    if tensor is None:
        with torch._C.DisableTorchFunction():
            tensor = torch.empty((1,) if rank > 0 else (), dtype=dtype, device="meta")
        _META_OPERANDS[key] = tensor
    return tensor


# Sources a rank or length may rest on: a rule for an opaque call's items, the dtype of a
# parameter or buffer that decided a rank (a tensor index's: RankTracker._getitem), and
# the rank of a tensor attribute (a get_attr).
_RANK_SOURCES = ("opaque", "param_rank", "param_dim")


def _floating(dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    return dtype if dtype is not None and dtype.is_floating_point else None


def _owner(root: nn.Module, path: str) -> Optional[tuple[nn.Module, str, torch.Tensor]]:
    """The module holding the parameter or buffer at ``path``, its name there and the
    tensor; ``None`` for anything else (a plain tensor attribute may be re-assigned
    without a trace noticing)."""
    owner_path, _, name = path.rpartition(".")
    owner = _attribute(root, owner_path) if owner_path else root
    if not isinstance(owner, nn.Module):
        return None
    value = owner._parameters.get(name)
    if value is None:
        value = owner._buffers.get(name)
    return (owner, name, value) if isinstance(value, torch.Tensor) else None


def _attribute(root: nn.Module, path: str) -> Any:
    """The module, parameter or buffer at ``path``, read from the modules' own tables
    (``getattr`` on a module is fx's while tracing: it would record a node)."""
    value: Any = root
    for part in path.split("."):
        if not isinstance(value, nn.Module):
            return None
        for table in (value._modules, value._parameters, value._buffers, value.__dict__):
            if part in table:
                value = table[part]
                break
        else:
            return None
    return value


def _broadcast(ranks: list[Optional[int]]) -> Optional[int]:
    if any(r is None for r in ranks):
        return None
    return max(ranks)  # type: ignore[type-var]


def _matmul(a: Optional[int], b: Optional[int]) -> Optional[int]:
    if a is None or b is None or a == 0 or b == 0:
        return None
    if a == 1 and b == 1:
        return 0
    if a == 1:
        return b - 1
    if b == 1:
        return a - 1
    return max(a, b)


def _flatten(x: int, args: tuple, kwargs: dict) -> Optional[int]:
    start = args[0] if len(args) > 0 else kwargs.get("start_dim", 0)
    end = args[1] if len(args) > 1 else kwargs.get("end_dim", -1)
    if type(start) is not int or type(end) is not int:
        return None
    if x == 0:
        return 1
    start, end = start % x, end % x
    return x - (end - start) if end >= start else None


def _reduce(x: int, args: tuple, kwargs: dict) -> Optional[int]:
    dim = args[0] if len(args) > 0 else kwargs.get("dim", None)
    keepdim = args[1] if len(args) > 1 else kwargs.get("keepdim", False)
    if type(keepdim) is not bool:
        return None
    if dim is None:
        return x if keepdim else 0
    if type(dim) is int:
        return x if keepdim else x - 1
    if type(dim) in (tuple, list) and all(type(d) is int for d in dim):
        return x if keepdim else x - len(set(d % x for d in dim))
    return None
