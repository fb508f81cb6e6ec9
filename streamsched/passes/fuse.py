"""Horizontal fusion: run structurally identical independent nodes as one batched node.

Two phases, as in ``torch.fx``'s partitioner: *propose* groups, then *rewrite*.

**Propose.** A node is a candidate when it is a module call of a kind with a batched
kernel (Linear, Conv, BatchNorm, LayerNorm, elementwise activations and dropout, or any
module ``vmap`` can batch) or an elementwise function. Candidates are bucketed by
*signature* (module type and configuration, parameter and buffer shapes and dtypes,
input shapes, constant arguments, train/eval) and by *level* (longest path from the
inputs). Nodes on one level never depend on each other, and contracting same-level
nodes cannot create a cycle, so every bucket of at least ``fuse_min_size`` nodes is a
valid group. Linear/Conv nodes that read the *same* tensor with *different* output
widths (multi-task heads, Inception's 1x1 convolutions) form a "wide" group first.

**Rewrite.** Each group becomes one node calling a kernel from
:mod:`streamsched.fusion.kernels`. Its inputs are found, in order of preference, as:
the output of an earlier group (stays in that group's layout, no unstacking between
layers), one tensor all members read (``SHARED``), equal consecutive slices of one
tensor (``x[:, 20*i : 20*(i+1)]``, ``split``/``chunk``/``unbind`` parts: a view), and
only as a last resort a ``torch.stack`` of the members' inputs. A ``torch.cat`` /
``torch.stack`` of a whole group's outputs in order becomes a reshape of the stacked
output; any other consumer reads a view from one ``unbind``.

The pass never fuses a module with hooks (they must fire per member), a BatchNorm
with ``momentum=None``, or an in-place op whose input anyone else could observe; each
such decision is logged at debug level.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn

from ..branch import BranchCall
from ..frontend.meta import ConstMeta, TensorMeta, ValueMeta
from ..frontend.nodes import AUGMENTED_OPERATORS, is_glue, node_label, target_name
from ..fusion.kernels import (
    BatchNormKernel,
    ConvKernel,
    ElementwiseKernel,
    FusedKernel,
    LayerNormKernel,
    LinearKernel,
    VmapKernel,
    WideKernel,
)
from ..fusion.layout import (
    SHARED,
    STACK,
    Layout,
    cat_members,
    fold,
    member_copy,
    select_members,
    split_member_copy,
    stack_members,
    unstack,
)
from ..ir.cost import DeviceModel, estimate_node_cost
from ..planning.plan import FusedGroupInfo, UnfusedGroup

__all__ = ["fuse_graph", "FuseResult"]

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


@dataclass
class FuseResult:
    groups: list[FusedGroupInfo]
    notes: list[str]
    kernels: list[FusedKernel]
    unfused: list[UnfusedGroup] = field(default_factory=list)


@dataclass
class _Source:
    """Where a group input comes from, in which layout, with each member's shape."""

    node: fx.Node
    layout: Layout
    shape: tuple[int, ...]


@dataclass
class _Stacked:
    kernel_node: fx.Node
    index: int
    layout: Layout
    n: int
    shape: tuple[int, ...]
    sizes: Optional[tuple[int, ...]] = None


# --- signatures --------------------------------------------------------------------


def _has_hooks(m: nn.Module) -> bool:
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or getattr(m, "_backward_pre_hooks", None)
    )


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


def _arg_sig(arg: Any, metas: dict[fx.Node, ValueMeta]) -> Any:
    if isinstance(arg, fx.Node):
        return ("node", _meta_sig(metas.get(arg)))
    if isinstance(arg, (tuple, list)):
        return (type(arg).__name__, tuple(_arg_sig(a, metas) for a in arg))
    if isinstance(arg, dict):
        return ("dict", tuple((k, _arg_sig(v, metas)) for k, v in arg.items()))
    if isinstance(arg, slice):
        return ("slice", _arg_sig(arg.start, metas), _arg_sig(arg.stop, metas), _arg_sig(arg.step, metas))
    if _hashable(arg):
        return ("const", type(arg).__name__, arg)
    return ("obj", id(arg))


def _tensor_args(node: fx.Node) -> bool:
    """Whether every Node argument is a direct positional argument (no nesting)."""
    for a in list(node.kwargs.values()):
        if isinstance(a, fx.Node) or _contains_node(a):
            return False
    for a in node.args:
        if not isinstance(a, fx.Node) and _contains_node(a):
            return False
    return True


def _contains_node(a: Any) -> bool:
    if isinstance(a, fx.Node):
        return True
    if isinstance(a, (tuple, list)):
        return any(_contains_node(x) for x in a)
    if isinstance(a, dict):
        return any(_contains_node(x) for x in a.values())
    if isinstance(a, slice):
        return any(_contains_node(x) for x in (a.start, a.stop, a.step))
    return False


def _module_kind(m: nn.Module) -> Optional[str]:
    t = type(m)
    if t is nn.Linear:
        return "linear"
    if t in (nn.Conv1d, nn.Conv2d, nn.Conv3d):
        return "conv"
    if t in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d):
        return "batchnorm"
    if t is nn.LayerNorm:
        return "layernorm"
    if t in ELEMENTWISE_MODULES:
        return "elementwise"
    return "vmap"


def _inplace(node: fx.Node, module: Optional[nn.Module]) -> bool:
    if module is not None:
        return bool(getattr(module, "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    return bool(node.kwargs.get("inplace", False))


_INPLACE_OPERATORS = frozenset({operator.setitem, *AUGMENTED_OPERATORS})


def _signature(
    node: fx.Node, root: nn.Module, metas: dict[fx.Node, ValueMeta], why: Optional[dict[fx.Node, str]] = None
) -> Optional[tuple]:
    """The fusion signature of a node, or ``None``; ``why`` collects the reason where a
    node that could otherwise be fused is left alone on purpose."""
    out = metas.get(node)
    if not isinstance(out, TensorMeta) or not _tensor_args(node):
        return None
    excluded = None
    if node.meta.get("streamsched_effect"):
        # It writes a storage another node reads or writes (or reads one written in
        # place): its place in eager order is kept, so it runs alone.
        excluded = "takes part in an in-place effect on shared storage (kept in eager order)"
    elif node.op == "call_module":
        m = root.get_submodule(node.target)
        if _has_hooks(m) or any(_has_hooks(s) for s in m.modules()):
            excluded = "has hooks (they must fire per member)"
        elif _module_kind(m) == "batchnorm" and m.momentum is None:
            excluded = "BatchNorm with momentum=None (a cumulative average per member)"
    if excluded is not None:
        log.debug("fuse: %s %s; not fused", node_label(node), excluded)
        if why is not None:
            why[node] = excluded
        return None
    if node.op == "call_module":
        m = root.get_submodule(node.target)
        kind = _module_kind(m)
        if kind is None:
            return None
        params = tuple((n, tuple(p.shape), p.dtype, p.device, p.requires_grad) for n, p in m.named_parameters())
        buffers = tuple((n, tuple(b.shape), b.dtype, b.device) for n, b in m.named_buffers())
        if kind == "vmap" and not params and not buffers:
            return None
        return (
            "module",
            type(m),
            m.extra_repr(),
            m.training,
            params,
            buffers,
            tuple(_arg_sig(a, metas) for a in node.args),
            tuple((k, _arg_sig(v, metas)) for k, v in node.kwargs.items()),
        )
    if node.op == "call_function":
        if node.target not in ELEMENTWISE_FUNCTIONS or isinstance(node.target, BranchCall):
            return None
    elif node.op == "call_method":
        if node.target not in ELEMENTWISE_METHODS:
            return None
    else:
        return None
    return (
        "function",
        node.op,
        node.target,
        tuple(_arg_sig(a, metas) for a in node.args),
        tuple((k, _arg_sig(v, metas)) for k, v in node.kwargs.items()),
    )


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
        level[node] = 1 + max((level[i] for i in ins), default=-1)
    return level


# --- the pass ------------------------------------------------------------------------


class _Rewriter:
    def __init__(
        self,
        graph: fx.Graph,
        root: nn.Module,
        metas: dict[fx.Node, ValueMeta],
        stacks: Any,
        device: DeviceModel,
        min_size: int,
    ):
        self.graph = graph
        self.root = root
        self.metas = metas
        self.stacks = stacks
        self.device = device
        self.min_size = min_size
        self.stacked_of: dict[fx.Node, _Stacked] = {}
        self.groups: list[FusedGroupInfo] = []
        self.kernels: list[FusedKernel] = []
        self.notes: list[str] = []
        self.members: set[fx.Node] = set()
        self.inserted: list[fx.Node] = []
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.unfused: list[UnfusedGroup] = []
        # Why the group being built was rejected (set where ``build`` gives up).
        self.reason = ""

    def reject(self, reason: str, members: list[fx.Node]) -> None:
        """Note that a proposed group stays unfused, and why (shown in the plan)."""
        labels = [node_label(m) for m in members]
        m = members[0]
        kind = type(self.root.get_submodule(m.target)).__name__ if m.op == "call_module" else target_name(m)
        self.unfused.append(UnfusedGroup(kind=kind, size=len(members), members=labels, reason=reason))
        log.debug("fuse: %d x %s not fused: %s", len(members), labels[0], reason)

    def _give_up(self, reason: str) -> None:
        self.reason = reason
        return None

    # -- proposals ------------------------------------------------------------------

    def propose(self) -> list[tuple[str, list[fx.Node]]]:
        level = _levels(self.graph)
        sigs: dict[fx.Node, tuple] = {}
        why: dict[fx.Node, str] = {}
        for node in self.graph.nodes:
            if node.op in ("call_module", "call_function", "call_method"):
                sig = _signature(node, self.root, self.metas, why)
                if sig is not None:
                    sigs[node] = sig
        # Nodes left alone on purpose, grouped as they would have been (roughly): the
        # plan says why they were not fused.
        excluded: dict[tuple, list[fx.Node]] = {}
        for node, reason in why.items():
            what = type(self.root.get_submodule(node.target)) if node.op == "call_module" else target_name(node)
            excluded.setdefault((what, level[node], reason), []).append(node)
        for (_, _, reason), nodes in excluded.items():
            if len(nodes) >= self.min_size:
                self.reject(reason, nodes)
        proposals: list[tuple[str, list[fx.Node]]] = []
        taken: set[fx.Node] = set()
        # Wide groups: Linear/Conv of different widths reading one tensor.
        wide: dict[tuple, list[fx.Node]] = {}
        for node in sigs:
            if node.op != "call_module" or len(node.args) != 1 or node.kwargs:
                continue
            m = self.root.get_submodule(node.target)
            if type(m) is nn.Linear:
                cfg = ("linear", m.in_features, m.bias is not None)
            elif type(m) in (nn.Conv1d, nn.Conv2d, nn.Conv3d) and m.groups == 1 and m.padding_mode == "zeros":
                cfg = (type(m), m.in_channels, m.kernel_size, m.stride, m.padding, m.dilation, m.bias is not None)
            else:
                continue
            p = m.weight
            key = (node.args[0], cfg, p.dtype, p.device, p.requires_grad, m.training)
            wide.setdefault(key, []).append(node)
        for nodes in wide.values():
            widths = {tuple(self.root.get_submodule(n.target).weight.shape) for n in nodes}
            if len(nodes) >= self.min_size and len(widths) > 1:
                proposals.append(("wide", nodes))
                taken.update(nodes)
        buckets: dict[tuple, list[fx.Node]] = {}
        for node, sig in sigs.items():
            if node not in taken:
                buckets.setdefault((sig, level[node], _origins(node)), []).append(node)
        for nodes in buckets.values():
            if len(nodes) >= self.min_size:
                proposals.append(("uniform", nodes))
        proposals.sort(key=lambda p: (level[p[1][0]], self.position[p[1][0]]))
        return proposals

    # -- sources --------------------------------------------------------------------

    def _shape(self, node: fx.Node) -> tuple[int, ...]:
        meta = self.metas.get(node)
        assert isinstance(meta, TensorMeta), node
        return meta.shape

    def _insert(self, target: Callable, args: tuple, anchor: fx.Node, glue: bool = True) -> fx.Node:
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(target, args)
        if glue:
            node.meta["streamsched_glue"] = True
        self.position[node] = self.position[anchor] - 0.5
        self.inserted.append(node)
        return node

    def discard_inserted(self) -> None:
        """Remove what a group that could not be built inserted."""
        for node in reversed(self.inserted):
            if not node.users:
                self.graph.erase_node(node)
        self.inserted = []

    def source(self, args: list[fx.Node], anchor: fx.Node) -> _Source:
        n = len(args)
        first = args[0]
        if all(a is first for a in args):
            return _Source(first, SHARED, self._shape(first))
        st = [self.stacked_of.get(a) for a in args]
        if all(s is not None for s in st) and len({s.kernel_node for s in st}) == 1 and st[0].sizes is None:
            s0 = st[0]
            indices = [s.index for s in st]
            if indices == list(range(s0.n)):
                return _Source(s0.kernel_node, s0.layout, s0.shape)
            index = torch.tensor(indices, dtype=torch.long)
            node = self._insert(select_members, (s0.kernel_node, s0.layout, s0.n, s0.shape, index), anchor)
            return _Source(node, STACK, s0.shape)
        sliced = self._slices(args)
        if sliced is not None:
            base, dim, start, width = sliced
            base_shape = self._shape(base)
            if start != 0 or width * n != base_shape[dim]:
                base = self._insert(torch.narrow, (base, dim, start, width * n), anchor)
            shape = base_shape[:dim] + (width,) + base_shape[dim + 1 :]
            return _Source(base, fold(dim), shape)
        unbound = self._unbind(args)
        if unbound is not None:
            base, dim = unbound
            if dim != 0:
                base = self._insert(torch.movedim, (base, dim, 0), anchor)
            return _Source(base, STACK, self._shape(first))
        node = self._insert(torch.stack, (list(args),), anchor, glue=False)
        return _Source(node, STACK, self._shape(first))

    def _slices(self, args: list[fx.Node]) -> Optional[tuple[fx.Node, int, int, int]]:
        """Equal, consecutive, in-order slices of one tensor along one dim."""
        parts = []
        for a in args:
            info = self._slice_of(a)
            if info is None:
                return None
            parts.append(info)
        base, dim = parts[0][0], parts[0][1]
        width = parts[0][3] - parts[0][2]
        if width <= 0:
            return None
        for i, (b, d, start, stop) in enumerate(parts):
            if b is not base or d != dim or stop - start != width or start != parts[0][2] + i * width:
                return None
        return base, dim, parts[0][2], width

    def _slice_of(self, node: fx.Node) -> Optional[tuple[fx.Node, int, int, int]]:
        """``(base, dim, start, stop)`` when ``node`` is a plain slice of one dim of base."""
        if node.op != "call_function" or node.target is not operator.getitem:
            return None
        base, index = node.args
        if not isinstance(base, fx.Node):
            return None
        base_meta = self.metas.get(base)
        if isinstance(base_meta, tuple):
            return self._split_part(base, index)
        if not isinstance(base_meta, TensorMeta):
            return None
        ndim = len(base_meta.shape)
        items = index if isinstance(index, tuple) else (index,)
        if any(not isinstance(i, slice) for i in items if i is not Ellipsis):
            return None
        if Ellipsis in items:
            k = items.index(Ellipsis)
            items = items[:k] + (slice(None),) * (ndim - len(items) + 1) + items[k + 1 :]
        dims = [d for d, s in enumerate(items) if s != slice(None)]
        if len(dims) != 1:
            return None
        d = dims[0]
        s = items[d]
        if s.step not in (None, 1) or any(isinstance(v, fx.Node) for v in (s.start, s.stop)):
            return None
        start, stop, _ = s.indices(base_meta.shape[d])
        return base, d, start, stop

    def _split_part(self, split: fx.Node, index: Any) -> Optional[tuple[fx.Node, int, int, int]]:
        """Part ``index`` of ``split``/``chunk`` as a slice of the split tensor."""
        if not isinstance(index, int):
            return None
        name = split.target if split.op == "call_method" else getattr(split.target, "__name__", "")
        if name not in ("split", "chunk"):
            return None
        src = split.args[0]
        if not isinstance(src, fx.Node):
            return None
        if name == "split":
            dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
        else:
            dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
        parts = self.metas.get(split)
        src_meta = self.metas.get(src)
        if not isinstance(parts, tuple) or not isinstance(src_meta, TensorMeta) or not isinstance(dim, int):
            return None
        dim = dim % len(src_meta.shape)
        sizes = [p.shape[dim] for p in parts if isinstance(p, TensorMeta)]
        if len(sizes) != len(parts):
            return None
        start = sum(sizes[:index])
        return src, dim, start, start + sizes[index]

    def _unbind(self, args: list[fx.Node]) -> Optional[tuple[fx.Node, int]]:
        """All parts of one ``unbind``, in order."""
        first = args[0]
        if first.op != "call_function" or first.target is not operator.getitem:
            return None
        ub = first.args[0]
        if not isinstance(ub, fx.Node):
            return None
        name = ub.target if ub.op == "call_method" else getattr(ub.target, "__name__", "")
        if name != "unbind":
            return None
        for i, a in enumerate(args):
            if a.op != "call_function" or a.target is not operator.getitem or a.args != (ub, i):
                return None
        parts = self.metas.get(ub)
        if not isinstance(parts, tuple) or len(parts) != len(args):
            return None
        dim = ub.kwargs.get("dim", ub.args[1] if len(ub.args) > 1 else 0)
        src_meta = self.metas.get(ub.args[0])
        if not isinstance(src_meta, TensorMeta):
            return None
        return ub.args[0], dim % len(src_meta.shape)

    # -- kernels --------------------------------------------------------------------

    def _owners(self, mods: Sequence[nn.Module], name: str) -> list[tuple[nn.Module, str]]:
        # "a.weight" lives on submodule "a" as "weight".
        path, _, leaf = name.rpartition(".")
        return [(m.get_submodule(path) if path else m, leaf) for m in mods]

    def _stack(self, mods: Sequence[nn.Module], name: str, concat: bool = False):
        if getattr(mods[0], name, None) is None:
            return None
        return self.stacks.stack_for(self._owners(mods, name), concat=concat)

    def build(self, kind: str, members: list[fx.Node]) -> Optional[FusedKernel]:
        anchor = members[0]
        names = [node_label(m) for m in members]
        out_shape = self._shape(anchor)
        if kind == "wide":
            mods = [self.root.get_submodule(m.target) for m in members]
            sizes = [int(m.weight.shape[0]) for m in mods]
            if type(mods[0]) is nn.Linear:
                split_dim = len(out_shape) - 1
            else:
                split_dim = len(out_shape) - len(mods[0].kernel_size) - 1
            kernel = WideKernel(
                mods,
                names,
                self._stack(mods, "weight", True),
                self._stack(mods, "bias", True),
                sizes,
                split_dim,
                out_shape,
            )
            return self._emit(kernel, members, [anchor.args[0]], kind, sizes=tuple(sizes))
        if anchor.op == "call_module":
            mods = [self.root.get_submodule(m.target) for m in members]
            mkind = _module_kind(mods[0])
            if mkind == "conv" and self._compute_bound_on_cpu(anchor, mods[0]):
                return self._give_up("convolutions with real work per member on CPU: a grouped conv is slower")
            single_input = len(anchor.args) == 1 and not anchor.kwargs
            if mkind in ("linear", "conv", "batchnorm", "layernorm", "elementwise") and not single_input:
                return None
            if mkind == "elementwise" and _inplace(anchor, mods[0]) and not self._inplace_safe(members):
                return self._give_up("in-place members whose inputs other nodes read")
            sources = [self.source([m.args[k] for m in members], anchor) for k in range(len(anchor.args))]
            src = sources[0] if sources else None
            if mkind in ("elementwise", "batchnorm", "layernorm") and self._copied(sources):
                return self._give_up("would need a stacked copy of its inputs: not worth it for a cheap op")
            if mkind == "linear":
                kernel = LinearKernel(
                    mods,
                    names,
                    self._stack(mods, "weight"),
                    self._stack(mods, "bias"),
                    src.layout,
                    src.shape,
                    out_shape,
                )
            elif mkind == "conv":
                kernel = ConvKernel(
                    mods,
                    names,
                    self._stack(mods, "weight"),
                    self._stack(mods, "bias"),
                    src.layout,
                    src.shape,
                    out_shape,
                )
            elif mkind == "batchnorm":
                kernel = BatchNormKernel(
                    mods,
                    names,
                    self._stack(mods, "weight"),
                    self._stack(mods, "bias"),
                    self._stack(mods, "running_mean"),
                    self._stack(mods, "running_var"),
                    self._stack(mods, "num_batches_tracked"),
                    src.layout,
                    src.shape,
                )
            elif mkind == "layernorm":
                kernel = LayerNormKernel(
                    mods, names, self._stack(mods, "weight"), self._stack(mods, "bias"), src.layout, src.shape
                )
            elif mkind == "elementwise":
                random = isinstance(mods[0], RANDOM_MODULES)
                kernel = ElementwiseKernel(
                    mods[0],
                    type(mods[0]).__name__,
                    names,
                    len(members),
                    [("t", src.layout, src.shape)],
                    {},
                    out_shape,
                    random,
                )
            else:
                kernel = self._vmap(mods, names, sources, anchor, out_shape)
                if kernel is None:
                    return None
            return self._emit(kernel, members, [s.node for s in sources], kind)
        # elementwise functions and methods
        if _inplace(anchor, None) and not self._inplace_safe(members):
            return None
        operands = []
        inputs = []
        for k, a in enumerate(anchor.args):
            if isinstance(a, fx.Node):
                src = self.source([m.args[k] for m in members], anchor)
                operands.append(("t", src.layout, src.shape))
                inputs.append(src.node)
            else:
                operands.append(("c", a))
        if any(node.target is torch.stack for node in inputs if node in self.inserted):
            return None  # stacking the inputs would cost as much as the op itself
        if anchor.op == "call_method":
            fn = getattr(torch.Tensor, str(anchor.target))
            name = str(anchor.target)
        else:
            fn = anchor.target
            name = getattr(fn, "__name__", "op")
        random = fn in RANDOM_FUNCTIONS
        kernel = ElementwiseKernel(fn, name, names, len(members), operands, dict(anchor.kwargs), out_shape, random)
        return self._emit(kernel, members, inputs, kind)

    def _compute_bound_on_cpu(self, node: fx.Node, module: nn.Module) -> bool:
        # A CPU launch costs microseconds, a convolution over a feature map far more:
        # batching members saves nothing there, and grouped kernels plus the stacked input
        # copy were measured slower (NASNet, RandWire cells). On GPUs batching pays.
        if self.device.name != "cpu":
            return False
        work = estimate_node_cost(node, module, self.metas, self.device) - self.device.launch_us
        return work > 20 * self.device.launch_us

    def _copied(self, sources: list[_Source]) -> bool:
        return any(s.node.target is torch.stack and s.node in self.inserted for s in sources)

    def _inplace_safe(self, members: list[fx.Node]) -> bool:
        # Applying the op once to the stacked tensor is only the same as N in-place ops
        # when nobody else can see the members' inputs: fresh values with one reader.
        for m in members:
            inp = m.args[0] if m.args else None
            if not isinstance(inp, fx.Node) or len(inp.users) != 1:
                return False
            if inp.op not in ("call_module", "call_function", "call_method") or is_glue(inp):
                return False
        return len({m.args[0] for m in members}) == len(members)

    def _vmap(
        self,
        mods: list[nn.Module],
        names: list[str],
        sources: list[_Source],
        anchor: fx.Node,
        out_shape: tuple[int, ...],
    ) -> Optional[VmapKernel]:
        params = {n: self.stacks.stack_for(self._owners(mods, n)) for n, _ in mods[0].named_parameters()}
        buffers = {n: self.stacks.stack_for(self._owners(mods, n)) for n, b in mods[0].named_buffers() if b is not None}
        if not _vmap_trial(mods[0], sources, dict(anchor.kwargs), out_shape):
            return self._give_up("vmap cannot batch it")
        return VmapKernel(
            mods, names, params, buffers, [(s.layout, s.shape) for s in sources], dict(anchor.kwargs), out_shape
        )

    def _emit(
        self,
        kernel: FusedKernel,
        members: list[fx.Node],
        inputs: list[fx.Node],
        kind: str,
        sizes: Optional[tuple[int, ...]] = None,
    ) -> FusedKernel:
        anchor = members[0]
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(kernel, tuple(inputs))
        label = _common_label([node_label(m) for m in members])
        node.meta["streamsched_label"] = f"{label} [x{len(members)} {kernel.kernel}]"
        self.position[node] = self.position[anchor] - 0.25
        member_cost = 0.0
        for m in members:
            mod = self.root.get_submodule(m.target) if m.op == "call_module" else None
            member_cost += max(0.0, estimate_node_cost(m, mod, self.metas, self.device) - self.device.launch_us)
        node.meta["streamsched_cost_us"] = member_cost + self.device.launch_us
        for i, m in enumerate(members):
            if sizes is not None:
                self.stacked_of[m] = _Stacked(node, i, kernel.out_layout, len(members), self._shape(m), sizes)
            else:
                self.stacked_of[m] = _Stacked(node, i, kernel.out_layout, len(members), kernel.out_shape)
        self.members.update(members)
        gid = len(self.groups)
        self.groups.append(
            FusedGroupInfo(
                id=gid,
                kind=kernel.kind,
                kernel=kernel.kernel,
                size=len(members),
                members=[node_label(m) for m in members],
                node=node.name,
            )
        )
        self.kernels.append(kernel)
        return kernel

    # -- consumers --------------------------------------------------------------------

    def _writes_input(self, node: fx.Node) -> bool:
        """Whether ``node`` may write its first argument in place (``relu_``,
        ``ReLU(inplace=True)``, ``x += 1``, item assignment)."""
        if node.op == "call_function" and node.target in _INPLACE_OPERATORS:
            return True
        module = self.root.get_submodule(node.target) if node.op == "call_module" else None
        return _inplace(node, module)

    def rewrite_consumers(self) -> None:
        # Members whose value a consumer writes in place: it gets storage of its own, as in
        # eager (see fusion.layout.member_copy), and no cat/stack of the group becomes a
        # view of the kernel's output (the write would show in it).
        written = {m for m in self.members if any(self._writes_input(u) for u in m.users if u not in self.members)}
        replaced: set[fx.Node] = set()
        for node in list(self.graph.nodes):
            if node.op != "call_function" or node.target not in (torch.cat, torch.concat, torch.stack):
                continue
            items = node.args[0] if node.args else node.kwargs.get("tensors")
            if not isinstance(items, (list, tuple)) or not items:
                continue
            if any(i in written for i in items):
                continue
            dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
            st = [self.stacked_of.get(i) if isinstance(i, fx.Node) else None for i in items]
            if any(s is None for s in st) or len({s.kernel_node for s in st}) != 1:
                continue
            s0 = st[0]
            if [s.index for s in st] != list(range(s0.n)) or not isinstance(dim, int):
                continue
            is_cat = node.target is not torch.stack
            if s0.sizes is not None:
                if not is_cat or dim % len(s0.shape) != s0.layout[1]:
                    continue
                node.replace_all_uses_with(s0.kernel_node)
            else:
                fn = cat_members if is_cat else stack_members
                new = self._insert(fn, (s0.kernel_node, s0.layout, s0.n, s0.shape, dim), node)
                node.replace_all_uses_with(new)
            replaced.add(node)
        for node in replaced:
            self.graph.erase_node(node)

        # Everything else reads a member's value from one unbind/split of its group.
        unstacked: dict[fx.Node, fx.Node] = {}
        for m in sorted(self.members, key=lambda n: self.position[n]):
            outside = [u for u in m.users if u not in self.members]
            if not outside:
                continue
            s = self.stacked_of[m]
            if m in written:
                if s.sizes is not None:
                    args = (s.kernel_node, tuple(s.sizes), s.layout[1], s.index)
                    item = self._insert(split_member_copy, args, m)
                else:
                    item = self._insert(member_copy, (s.kernel_node, s.layout, s.n, s.shape, s.index), m)
                self.position[item] = self.position[s.kernel_node] + 0.2
                m.replace_all_uses_with(item, delete_user_cb=lambda u: u not in self.members)
                continue
            parts = unstacked.get(s.kernel_node)
            if parts is None:
                anchor = s.kernel_node.next
                if s.sizes is not None:
                    parts = self._insert(torch.split, (s.kernel_node, list(s.sizes), s.layout[1]), anchor)
                else:
                    parts = self._insert(unstack, (s.kernel_node, s.layout, s.n, s.shape), anchor)
                self.position[parts] = self.position[s.kernel_node] + 0.1
                unstacked[s.kernel_node] = parts
            item = self._insert(operator.getitem, (parts, s.index), m)
            self.position[item] = self.position[s.kernel_node] + 0.2
            m.replace_all_uses_with(item, delete_user_cb=lambda u: u not in self.members)

    def erase_members(self) -> None:
        for m in sorted(self.members, key=lambda n: -self.position[n]):
            self.graph.erase_node(m)
        # Slices and splits that only fed fused members are dead now.
        changed = True
        while changed:
            changed = False
            for node in reversed(list(self.graph.nodes)):
                if not node.users and node.op in ("call_function", "call_method") and is_glue(node):
                    self.graph.erase_node(node)
                    changed = True


def _vmap_trial(template: nn.Module, sources: list[_Source], kwargs: dict, out_shape: tuple[int, ...]) -> bool:
    """Whether vmap can batch this module: one trial call on the meta device."""
    n = 2
    try:
        params = {
            k: torch.empty((n,) + tuple(p.shape), dtype=p.dtype, device="meta") for k, p in template.named_parameters()
        }
        buffers = {
            k: torch.empty((n,) + tuple(b.shape), dtype=b.dtype, device="meta")
            for k, b in template.named_buffers()
            if b is not None
        }
        ref = next(iter(template.parameters()), None)
        dtype = ref.dtype if ref is not None else torch.float32
        xs = [
            torch.empty(s.shape if s.layout == SHARED else (n,) + tuple(s.shape), dtype=dtype, device="meta")
            for s in sources
        ]
        dims = tuple(None if s.layout == SHARED else 0 for s in sources)

        def f(p, b, *args):
            return torch.func.functional_call(template, (p, b), args, kwargs)

        with torch.no_grad():
            out = torch.func.vmap(f, in_dims=(0, 0) + dims, randomness="different")(params, buffers, *xs)
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (n,) + tuple(out_shape)
    except Exception as exc:  # noqa: BLE001 - any failure means "do not fuse"
        log.debug("vmap trial failed: %s", exc)
        return False


def _common_label(labels: list[str]) -> str:
    """``mlps.*.fc1`` for ``mlps.0.fc1 .. mlps.999.fc1``."""
    parts = [lab.split(".") for lab in labels]
    if len({len(p) for p in parts}) != 1:
        return f"{labels[0]} .. {labels[-1]}"
    out = []
    for column in zip(*parts):
        out.append(column[0] if len(set(column)) == 1 else "*")
    return ".".join(out)


def _resort(graph: fx.Graph, position: dict[fx.Node, float]) -> None:
    """Re-link nodes in a topological order that follows ``position`` where it can."""
    import heapq

    nodes = list(graph.nodes)
    indeg = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [(position.get(n, 0.0), i, n) for i, n in enumerate(nodes) if indeg[n] == 0]
    heapq.heapify(ready)
    order = []
    index = {n: i for i, n in enumerate(nodes)}
    while ready:
        _, _, n = heapq.heappop(ready)
        order.append(n)
        for u in n.users:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (position.get(u, 0.0), index[u], u))
    if len(order) != len(nodes):
        raise RuntimeError("fusion produced a cyclic graph (please report this)")
    placeholders = [n for n in order if n.op == "placeholder"]
    rest = [n for n in order if n.op not in ("placeholder", "output")]
    output = [n for n in order if n.op == "output"]
    cursor = graph._root
    for n in placeholders + rest + output:
        cursor.append(n)
        cursor = n


def fuse_graph(
    graph: fx.Graph,
    root: nn.Module,
    metas: dict[fx.Node, ValueMeta],
    stacks: Any,
    device: DeviceModel,
    min_size: int = 2,
) -> FuseResult:
    """Fuse ``graph`` in place; ``stacks`` provides the stacked parameter holders."""
    rw = _Rewriter(graph, root, metas, stacks, device, min_size)
    for kind, members in rw.propose():
        rw.inserted = []
        rw.reason = ""
        try:
            kernel = rw.build(kind, members)
        except Exception as exc:  # noqa: BLE001 - a group that cannot be built stays unfused
            rw.reason = f"building its kernel failed: {type(exc).__name__}: {exc}"
            kernel = None
        if kernel is None:
            rw.discard_inserted()
            rw.reject(rw.reason or "no batched kernel for these arguments", members)
    if not rw.kernels:
        return FuseResult([], rw.notes, [], rw.unfused)
    rw.rewrite_consumers()
    rw.erase_members()
    _resort(graph, rw.position)
    graph.lint()
    return FuseResult(rw.groups, rw.notes, rw.kernels, rw.unfused)
