"""Which exits of fused values each fused kernel's members reach: the links that
:mod:`streamsched.passes.fusion.member_use` records member use along, made once per plan."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import fx

from ...frontend import node_meta
from .kernels import ElementwiseKernel, FusedKernel, VmapKernel, WideKernel
from .layout import SHARED, select_members, unstack
from .member_use import EntryGate, MemberUse, gated_stack, split_parts

__all__ = ["link_member_use"]


def link_member_use(graph: fx.Graph) -> int:
    """Give every exit of fused values downstream of a kernel its :class:`MemberUse`, and
    turn on the member tracking of each stacked tensor read by kernels whose every
    consumer is understood (:attr:`StackedTensors.track`). Returns how many exits."""
    kernels = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, FusedKernel)]
    links: dict[fx.Node, list[tuple[Any, Optional[tuple[int, ...]]]]] = {}
    for k in kernels:
        stacks = list(k.target.params)
        exits: list[tuple[fx.Node, Optional[tuple[int, ...]]]] = []
        complete = True
        todo: list[tuple[fx.Node, Optional[tuple[int, ...]]]] = [(k, None)]
        seen: set[tuple[fx.Node, Optional[tuple[int, ...]]]] = set()
        while todo and complete:
            node, mapping = todo.pop()
            for u in node.users:
                t = u.target
                if u.op != "call_function":
                    complete = False
                elif isinstance(t, FusedKernel):
                    if not _reads_members(u, node, len(mapping) if mapping is not None else k.target.n):
                        complete = False  # reads the group whole (as one shared tensor)
                        break
                    step = (u, mapping)
                    if step not in seen:
                        seen.add(step)
                        todo.append(step)
                elif t is select_members and u.args[0] is node:
                    index = tuple(int(i) for i in u.args[4].tolist())
                    step = (u, index if mapping is None else tuple(mapping[i] for i in index))
                    if step not in seen:
                        seen.add(step)
                        todo.append(step)
                elif t in (unstack, split_parts) and u.args[0] is node:
                    exits.append((u, mapping))
                elif t is torch.narrow and u.args[0] is node and mapping is None and _inserted(u):
                    # Consecutive members of a wide kernel read as one fold (Rewriter._wide_part).
                    part = _narrowed_members(k.target, u)
                    if part is None:
                        complete = False
                        break
                    step = (u, part)
                    if step not in seen:
                        seen.add(step)
                        todo.append(step)
                elif t is torch.split and u.args[0] is node and _inserted(u):
                    exits.append((u, mapping))
                else:
                    complete = False
                    break
        for st in stacks:
            st.track = bool(st.track is not False and complete and exits)
        if not complete or not exits:
            continue
        ups: list[Any] = [*stacks, *_gates(k)]
        for node, mapping in exits:
            links.setdefault(node, []).extend((st, mapping) for st in ups)
    for node, ups in links.items():
        t = node.target
        ups = [(st, m) for st, m in ups if st.track]
        if not ups:
            continue
        if t is torch.split:
            node.target = split_parts
            node.args = tuple(node.args[:3]) + (MemberUse(ups),)
        elif t is unstack:
            node.args = tuple(node.args[:4]) + (MemberUse(ups),)
        elif t is split_parts:
            node.args = tuple(node.args[:3]) + (MemberUse(ups),)
    return len(links)


def _gates(kernel: fx.Node) -> list[EntryGate]:
    """Gate each ``torch.stack`` of members' inputs that fusion inserted to enter
    ``kernel`` (its part ``j`` member ``j``'s input; read by the kernel alone): the
    node calls :func:`gated_stack` from now on. Returns the gates."""
    gates = []
    for a in kernel.args:
        if (
            isinstance(a, fx.Node)
            and a.target is torch.stack
            and node_meta.is_member_stack(a)
            and len(a.users) == 1
            and len(a.args) == 1
            and not a.kwargs
            and isinstance(a.args[0], (list, tuple))
            and len(a.args[0]) == kernel.target.n
        ):
            gate = EntryGate()
            a.target = gated_stack
            a.args = (a.args[0], gate)
            gates.append(gate)
    return gates


def _reads_members(user: fx.Node, node: fx.Node, n: int) -> bool:
    """Whether kernel ``user`` reads ``node`` (``n`` members' values) member by member:
    its member ``j`` reads member ``j`` only (an input in a stacked or folded layout),
    rather than every member of it (a shared input)."""
    kernel = user.target
    if isinstance(kernel, WideKernel) or kernel.n != n or user.kwargs:
        return False
    if isinstance(kernel, ElementwiseKernel):
        layouts = [op[1] for op in kernel.operands if op[0] == "t"]
    elif isinstance(kernel, VmapKernel):
        layouts = [layout for layout, _ in kernel.inputs]
    else:
        layout = getattr(kernel, "in_layout", None)
        layouts = [layout] if layout is not None else []
    if len(layouts) != len(user.args):
        return False
    return all(layout != SHARED for a, layout in zip(user.args, layouts) if a is node)


def _narrowed_members(kernel: FusedKernel, narrow: fx.Node) -> Optional[tuple[int, ...]]:
    """The members of wide ``kernel`` whose outputs ``narrow`` (``torch.narrow`` of the
    kernel's output along its split dim) covers exactly, in order; None otherwise."""
    if not isinstance(kernel, WideKernel) or narrow.kwargs or len(narrow.args) != 4:
        return None
    _, dim, start, length = narrow.args
    if dim != kernel.split_dim:
        return None
    members = []
    offset = 0
    for i, size in enumerate(kernel.sizes):
        if start <= offset and offset + size <= start + length:
            members.append(i)
        offset += size
    covered = sum(kernel.sizes[i] for i in members)
    if not members or covered != length or sum(kernel.sizes[: members[0]]) != start:
        return None
    return tuple(members)


def _inserted(node: fx.Node) -> bool:
    return bool(node_meta.is_inserted_glue(node))
