"""Rewrite: turn each built group into one fused node, and the graph around it.

The :class:`Rewriter` owns every edit the pass makes to the graph:

- :meth:`~Rewriter.source` finds one input of a group, in order of preference: the output
  of an earlier group (stays in that group's layout, no unstacking between layers), one
  tensor all members read (``SHARED``), equal consecutive slices of one tensor
  (``x[:, 20*i : 20*(i+1)]``, ``split``/``chunk``/``unbind`` parts: a view, see
  :mod:`streamsched.passes.fusion.sources`), and only as a last resort a ``torch.stack``
  of the members' inputs;
- :meth:`~Rewriter.emit` inserts the node calling the group's kernel (built by
  :mod:`streamsched.passes.fusion.builders`) and records where each member's value now
  lives;
- once every group is built, :meth:`~Rewriter.rewrite_consumers` turns a ``torch.cat`` /
  ``torch.stack`` of a whole group's outputs in order into a reshape of the kernel's
  output, and has any other consumer read a view from one ``unbind``;
  :meth:`~Rewriter.erase_members` removes the members, and :func:`resort` restores a
  topological order close to the original one.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import fx, nn

from ...frontend import node_meta
from ...frontend.meta import TensorMeta, ValueMeta
from ...frontend.nodes import AUGMENTED_OPERATORS, is_glue, node_label, submodule
from ...ir.cost import DeviceModel, estimate_node_cost
from .kernels import FusedKernel
from .layout import (
    SHARED,
    STACK,
    Layout,
    cat_members,
    eager_strides,
    fold,
    for_caller,
    member_copy,
    select_members,
    stack_members,
    unstack,
)
from .report import FusedGroupInfo
from .sources import consecutive_slices, unbound_parts

__all__ = ["Rewriter", "Source", "inplace", "resort"]


@dataclass
class Source:
    """Where a group input comes from, in which layout, with each member's shape."""

    node: fx.Node
    layout: Layout
    shape: tuple[int, ...]


@dataclass
class _Stacked:
    """Where a fused member's value lives now: item ``index`` of ``kernel_node``'s output
    (``sizes``: the members' widths, for a wide kernel's ``("split", d)`` output)."""

    kernel_node: fx.Node
    index: int
    layout: Layout
    n: int
    shape: tuple[int, ...]
    sizes: Optional[tuple[int, ...]] = None


def inplace(node: fx.Node, module: Optional[nn.Module]) -> bool:
    """Whether a call writes its input in place (``inplace=True`` modules and functions,
    ``relu_``-style methods)."""
    if module is not None:
        return bool(getattr(module, "inplace", False))
    if node.op == "call_method":
        return str(node.target).endswith("_")
    return bool(node.kwargs.get("inplace", False))


_INPLACE_OPERATORS = frozenset({operator.setitem, *AUGMENTED_OPERATORS})


class Rewriter:
    """The graph edits of one run of the pass, and what they have fused so far."""

    def __init__(
        self,
        graph: fx.Graph,
        root: nn.Module,
        metas: dict[fx.Node, ValueMeta],
        stacks: Any,
        device: DeviceModel,
        autocast: tuple = (),
        grad: bool = False,
    ):
        self.graph = graph
        self.root = root
        self.metas = metas
        self.stacks = stacks
        self.device = device
        self.autocast = autocast
        """The autocast state the plan runs under (``trace_guard.autocast_state``)."""
        self.grad = grad
        """Whether the plan runs with autograd on (the grad mode is part of its key)."""
        self.stacked_of: dict[fx.Node, _Stacked] = {}
        self.groups: list[FusedGroupInfo] = []
        self.kernels: list[FusedKernel] = []
        self.members: set[fx.Node] = set()
        # Nodes inserted for the group being built (reset per group): what a group that
        # cannot be built leaves behind, and how a builder tells its inputs were copied.
        self.inserted: list[fx.Node] = []
        self.position = {n: i for i, n in enumerate(graph.nodes)}
        self.proposals: list[tuple[str, list[fx.Node]]] = []
        """The proposed groups, ``(kernel kind, members)`` (``fuse_graph`` sets them
        before building): what a builder may know of the groups after it."""
        self._kind_of: Optional[dict[fx.Node, str]] = None

    def feeds_linear(self, members: list[fx.Node]) -> bool:
        """Whether every reader of ``members``' values is a member of a proposed Linear
        group reading it as its input, or of an elementwise group of that one operand
        whose values are read likewise, and some Linear reads them: a chain a layout
        can carry through to the Linears (the groups may still be built otherwise)."""
        kind_of = self._kind_of
        if kind_of is None:  # made on first use: most plans never ask
            kind_of = self._kind_of = {m: kind for kind, group in self.proposals for m in group}
        reaches = False
        todo = list(members)
        seen: set[fx.Node] = set()
        while todo:
            for user in todo.pop().users:
                kind = kind_of.get(user)
                if kind == "linear" and len(user.all_input_nodes) == 1:
                    reaches = True
                elif kind in ("elementwise", "function") and len(user.all_input_nodes) == 1:
                    if user not in seen:
                        seen.add(user)
                        todo.append(user)
                else:
                    return False
        return reaches

    def shape(self, node: fx.Node) -> tuple[int, ...]:
        meta = self.metas.get(node)
        assert isinstance(meta, TensorMeta), node
        return meta.shape

    def _insert(self, target: Callable, args: tuple, anchor: fx.Node, glue: bool = True) -> fx.Node:
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(target, args)
        if glue:
            node_meta.set_inserted_glue(node)
        self.position[node] = self.position[anchor] - 0.5
        self.inserted.append(node)
        return node

    def discard_inserted(self) -> None:
        """Remove what a group that could not be built inserted."""
        for node in reversed(self.inserted):
            if not node.users:
                self.graph.erase_node(node)
        self.inserted = []

    def is_copy(self, node: fx.Node) -> bool:
        """Whether ``node`` is a ``torch.stack`` of members' inputs inserted for this group."""
        return node.target is torch.stack and node in self.inserted

    # -- sources --------------------------------------------------------------------

    def source(self, args: list[fx.Node], anchor: fx.Node) -> Source:
        """One input of a group (``args``: each member's), inserting before ``anchor``
        whatever it takes to read them as one value."""
        n = len(args)
        first = args[0]
        if all(a is first for a in args):
            return Source(first, SHARED, self.shape(first))
        st = [self.stacked_of.get(a) for a in args]
        if (
            all(s is not None for s in st)
            and len({s.kernel_node for s in st}) == 1
            # A member the caller gets with autograd on (a copy of its own, see
            # _members_written) is, as in eager, the tensor the backward of this group
            # passes through (its retained gradient, its hooks): read from the members.
            and not any(map(self._returned_with_grad, args))
        ):
            s0 = st[0]
            if s0.sizes is None:
                indices = [s.index for s in st]
                if indices == list(range(s0.n)):
                    return Source(s0.kernel_node, s0.layout, s0.shape)
                index = torch.tensor(indices, dtype=torch.long)
                node = self._insert(select_members, (s0.kernel_node, s0.layout, s0.n, s0.shape, index), anchor)
                return Source(node, STACK, s0.shape)
            if not self._writes_input(anchor):
                part = self._wide_part(st, anchor)  # type: ignore[arg-type]
                if part is not None:
                    return part
        sliced = consecutive_slices(args, self.metas)
        if sliced is not None:
            base, dim, start, width = sliced
            base_shape = self.shape(base)
            if start != 0 or width * n != base_shape[dim]:
                base = self._insert(torch.narrow, (base, dim, start, width * n), anchor)
            shape = base_shape[:dim] + (width,) + base_shape[dim + 1 :]
            return Source(base, fold(dim), shape)
        unbound = unbound_parts(args, self.metas)
        if unbound is not None:
            base, dim = unbound
            if dim != 0:
                base = self._insert(torch.movedim, (base, dim, 0), anchor)
            return Source(base, STACK, self.shape(first))
        node = self._insert(torch.stack, (list(args),), anchor, glue=False)
        node_meta.set_member_stack(node)
        return Source(node, STACK, self.shape(first))

    def _wide_part(self, st: list[_Stacked], anchor: fx.Node) -> Optional[Source]:
        """Members of a wide kernel (Linears or convolutions of different widths reading
        one tensor, their outputs side by side along the split dim), read as one fold:
        where they are consecutive and equally wide, a narrow of the kernel's output
        (the multi-task heads' pattern: alike heads beside other ones). Otherwise None:
        their values are copied into a stack, which a cheap op's group is not built for
        (the alike heads' activations ran one module each, their outputs stacked for the
        next layer). Not for a group writing its input in place (the narrow's other
        readers would see it written)."""
        s0 = st[0]
        kind, dim = s0.layout
        sizes = s0.sizes
        assert sizes is not None
        first, n = s0.index, len(st)
        if kind != "split" or [s.index for s in st] != list(range(first, first + n)):
            return None
        width = sizes[first]
        if any(sizes[i] != width for i in range(first, first + n)):
            return None
        base = s0.kernel_node
        start = sum(sizes[:first])
        if start != 0 or width * n != sum(sizes):
            base = self._insert(torch.narrow, (base, dim, start, width * n), anchor)
        shape = s0.shape[:dim] + (width,) + s0.shape[dim + 1 :]
        return Source(base, fold(dim), shape)

    # -- the fused node -----------------------------------------------------------------

    def emit(
        self,
        members: list[fx.Node],
        kernel: FusedKernel,
        inputs: list[fx.Node],
        sizes: Optional[tuple[int, ...]] = None,
        alike: bool = False,
    ) -> FusedKernel:
        """Insert the node calling ``kernel`` on ``inputs`` before the first member.

        ``alike``: the members share one fusion signature (module configuration,
        parameter shapes, argument descriptions; not a wide group), so each member's
        estimated cost depends on its output's description alone: it is estimated once
        per description (a 1,000-member group estimated 1,000 times the same cost)."""
        anchor = members[0]
        with self.graph.inserting_before(anchor):
            node = self.graph.call_function(kernel, tuple(inputs))
        label = _common_label([node_label(m) for m in members])
        node_meta.set_fused_label(node, f"{label} [x{len(members)} {kernel.kernel}]")
        self.position[node] = self.position[anchor] - 0.25
        member_cost = 0.0
        estimated: dict[Any, float] = {}
        for m in members:
            key = None
            if alike:
                key = (self.metas.get(m), node_meta.fixed_cost_us(m), node_meta.is_inserted_glue(m))
            cost = estimated.get(key) if key is not None else None
            if cost is None:
                mod = submodule(self.root, m.target) if m.op == "call_module" else None
                cost = estimate_node_cost(m, mod, self.metas, self.device)
                if key is not None:
                    estimated[key] = cost
            member_cost += max(0.0, cost - self.device.launch_us)
        node_meta.set_fixed_cost_us(node, member_cost + self.device.launch_us)
        for i, m in enumerate(members):
            if sizes is not None:
                self.stacked_of[m] = _Stacked(node, i, kernel.out_layout, len(members), self.shape(m), sizes)
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
        module = submodule(self.root, node.target) if node.op == "call_module" else None
        return inplace(node, module)

    def _returned_with_grad(self, member: fx.Node) -> bool:
        """Whether the graph returns ``member``'s value, or a view of it, and it requires
        grad (as recorded on the planning call)."""
        meta = self.metas.get(member)
        if not isinstance(meta, TensorMeta) or not meta.requires_grad:
            return False
        return self._returned(member)

    def _returned(self, node: fx.Node) -> bool:
        """Whether the graph returns ``node``'s value, or a view of it (fused members
        aside)."""
        seen: set[fx.Node] = set()
        todo = [node]
        while todo:
            for user in todo.pop().users:
                if user in self.members or user in seen:
                    continue
                if user.op == "output":
                    return True
                if is_glue(user):
                    seen.add(user)
                    todo.append(user)
        return False

    def _needs_eager_strides(self, member: fx.Node) -> bool:
        """Whether something reading ``member`` may need it contiguous, as eager's value
        is, where the group hands it out as a strided view (a wide kernel's split, a
        folded layout): a ``view`` (it refuses other strides), a module or function whose
        code the plan does not see (it may view it), or the caller (the graph returns it,
        or a view of it)."""
        for user in member.users:
            if user in self.members:
                continue
            if user.op == "output":
                return True
            if user.op == "call_method" and user.target in ("view", "view_as"):
                return True
            if user.op == "call_function" and user.target in (torch.Tensor.view, torch.Tensor.view_as):
                return True
            if user.op == "call_module":
                module = submodule(self.root, user.target)
                if not type(module).__module__.startswith("torch.nn."):
                    return True
            if user.op == "call_function" and not getattr(user.target, "__module__", "").startswith(
                ("torch", "_operator", "operator", "builtins")
            ):
                return True
            if is_glue(user) and self._needs_eager_strides(user):
                return True
        return False

    def rewrite_consumers(self) -> None:
        """Point every reader of a fused member at the member's part of its group's output."""
        written = self._members_written()
        self._fold_cats_and_stacks()
        self._read_members_from_parts(written)

    def _members_written(self) -> set[fx.Node]:
        """Members whose value a consumer writes in place: each gets storage of its own,
        as in eager (see layout.member_copy), and no cat/stack of the group becomes a
        view of the kernel's output (the write would show in it)."""
        # The recorded effects also see writes through views (``outs[1].view(-1).zero_()``).
        # So does a member the caller gets (or a view of it) with autograd on: the caller
        # may write it in place, which eager allows and a view of an unbind or split
        # refuses ("a function that returns multiple views").
        return {
            m
            for m in self.members
            if node_meta.output_written(m)
            or any(self._writes_input(u) for u in m.users if u not in self.members)
            or self._returned_with_grad(m)
        }

    def _fold_cats_and_stacks(self) -> None:
        """A cat or stack of a whole group, in order, becomes the kernel's output (or a
        view of it); returned to the caller, a tensor of its own (``for_caller``)."""
        replaced: set[fx.Node] = set()
        for node in list(self.graph.nodes):
            folded = self._whole_group_of(node)
            if folded is None:
                continue
            s0, dim, is_cat = folded
            if s0.sizes is not None:
                if not is_cat or dim % len(s0.shape) != s0.layout[1]:
                    continue
                new = s0.kernel_node
            else:
                fn = cat_members if is_cat else stack_members
                new = self._insert(fn, (s0.kernel_node, s0.layout, s0.n, s0.shape, dim), node)
            if self._returned(node):
                position = self.position[new]
                new = self._insert(for_caller, (new,), node)
                self.position[new] = position + 0.01
            node.replace_all_uses_with(new)
            replaced.add(node)
        for node in replaced:
            self.graph.erase_node(node)

    def _whole_group_of(self, node: fx.Node) -> Optional[tuple[_Stacked, int, bool]]:
        """For a cat/stack of every member of one group in order that may become a view
        of the kernel's output: (the first member's stacked value, dim, whether a cat)."""
        if node.op != "call_function" or node.target not in (torch.cat, torch.concat, torch.stack):
            return None
        items = node.args[0] if node.args else node.kwargs.get("tensors")
        if not isinstance(items, (list, tuple)) or not items:
            return None
        # Eager's cat/stack is a fresh tensor. As a view of the kernel's output it is
        # only the same while nothing writes it (in place, or as an ``out=``), and
        # nothing else reads the members (a member's view would share its storage; a
        # written member has such a reader, the op or view that writes it).
        if "out" in node.kwargs or node_meta.output_written(node):
            return None
        if any(u is not node for i in items if isinstance(i, fx.Node) for u in i.users if u not in self.members):
            return None
        dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else 0)
        st = [self.stacked_of.get(i) if isinstance(i, fx.Node) else None for i in items]
        if any(s is None for s in st) or len({s.kernel_node for s in st}) != 1:
            return None
        s0 = st[0]
        if [s.index for s in st] != list(range(s0.n)) or not isinstance(dim, int):
            return None
        return s0, dim, node.target is not torch.stack

    def _read_members_from_parts(self, written: set[fx.Node]) -> None:
        """Everything else reads a member's value from one unbind/split of its group (a
        written member: from a copy of its own)."""
        unstacked: dict[fx.Node, fx.Node] = {}
        for m in sorted(self.members, key=lambda n: self.position[n]):
            outside = [u for u in m.users if u not in self.members]
            if not outside:
                continue
            s = self.stacked_of[m]
            parts = unstacked.get(s.kernel_node)
            if parts is None:
                parts = unstacked[s.kernel_node] = self._unstack(s)
            if m in written:
                item = self._insert(member_copy, (parts, s.index), m)
                self.position[item] = self.position[s.kernel_node] + 0.2
                m.replace_all_uses_with(item, delete_user_cb=lambda u: u not in self.members)
                continue
            item = self._insert(operator.getitem, (parts, s.index), m)
            self.position[item] = self.position[s.kernel_node] + 0.2
            if self._needs_eager_strides(m):
                # Eager's value is dense; the part is a view with the kernel output's
                # strides (copied only where it is not dense).
                item = self._insert(eager_strides, (item,), m)
                self.position[item] = self.position[s.kernel_node] + 0.25
            if self._returned(m):
                # Returned without autograd (with it, the member is copied above): no view.
                item = self._insert(for_caller, (item,), m)
                self.position[item] = self.position[s.kernel_node] + 0.27
            m.replace_all_uses_with(item, delete_user_cb=lambda u: u not in self.members)

    def _unstack(self, s: _Stacked) -> fx.Node:
        """The group's parts, split or unbound from the kernel's output just after it."""
        anchor = s.kernel_node.next
        if s.sizes is not None:
            parts = self._insert(torch.split, (s.kernel_node, list(s.sizes), s.layout[1]), anchor)
        else:
            parts = self._insert(unstack, (s.kernel_node, s.layout, s.n, s.shape), anchor)
        self.position[parts] = self.position[s.kernel_node] + 0.1
        return parts

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


def _common_label(labels: list[str]) -> str:
    """``mlps.*.fc1`` for ``mlps.0.fc1 .. mlps.999.fc1``. Members that differ in their first
    component are listed, ``{left,right}.fc``: a leading ``*`` names nothing, and a task
    name starting with it reads like the plan's critical-path mark."""
    parts = [lab.split(".") for lab in labels]
    if len({len(p) for p in parts}) != 1:
        return f"{labels[0]} .. {labels[-1]}"
    out = []
    for i, column in enumerate(zip(*parts)):
        if len(set(column)) == 1:
            out.append(column[0])
        elif i == 0:
            names = list(dict.fromkeys(column))
            out.append("{" + ",".join(names if len(names) <= 4 else [*names[:2], "...", names[-1]]) + "}")
        else:
            out.append("*")
    return ".".join(out)


def resort(graph: fx.Graph, position: dict[fx.Node, float]) -> None:
    """Re-link nodes in a topological order that follows ``position`` where it can."""
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
