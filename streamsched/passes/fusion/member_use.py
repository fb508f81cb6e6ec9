"""Which members of a fused group a backward reached: only those get a gradient.

A fused kernel reads its members' parameters as one stacked tensor
(:class:`~streamsched.passes.fusion.params.GatherStacked`), and the stacked gradient
reaching it holds a slice for every member, zeros for a member whose output reaches no
loss. Eager leaves such a member's ``.grad`` as ``None`` (autograd never reaches its
parameters), and optimizers treat the two differently: ``SGD`` with weight decay or
momentum, ``Adam`` and ``AdamW`` step a parameter whose gradient is zeros and skip one
whose gradient is ``None``.

So each *exit* of a fused group (where members' values leave the stacked layout: the
one ``unbind`` or ``split`` that hands every member its part, from which members'
own copies are made too) watches its backward: one pre-hook on its autograd node sees
``None`` for every part no gradient reached.
It records the members it saw in a :class:`UseCell` of every gather upstream of it (the
cell that gather made on this call), and the gather's backward, which the engine runs
after every exit downstream of it, hands a gradient to those members only.

Which exits are downstream of which kernels is worked out once per plan
(:func:`~streamsched.passes.fusion.member_links.link_member_use`): from each kernel
through the kernels reading its output (member ``i`` stays member ``i``; a member
selection maps them) to the exits. A kernel
whose output reaches anything else (a ``torch.cat`` / ``torch.stack`` of the whole group
folded into a view of the output, or a kernel reading that view as one shared input:
either reaches every member, as eager's ``cat`` does) keeps handing every member its
slice, and so does any stacked tensor such a kernel reads.

Several backward passes through one forward (``retain_graph``) record per pass; a gather
reached in a pass whose exits recorded nothing (the second backward of a gradient
penalty, through the graph the first one made) or after a backward with
``create_graph=True`` uses every member any pass through this call saw. A member with
gradient hooks of its own is always handed its slice: autograd calls the hooks of a
parameter it reaches even with no gradient (with ``None``), where eager would not reach
it at all.

A group whose input is a ``torch.stack`` of its members' inputs (the source of last
resort: each member reads a value of its own that no earlier kernel's layout holds, a
member chain broken by an op that is not fused) is *entered* there, and that stack's
backward would hand every part a slice, zeros for a member no gradient reached: the ops
before it, and an earlier group's members (each of which then got zeros for a ``.grad``
eager leaves ``None``), were reached. So such a stack is a gate (:func:`gated_stack`)
linked to the group's exits as its gathers are: its backward hands a gradient only to
the parts of members the exits saw reached.
"""

from __future__ import annotations

import operator
from functools import partial
from typing import Any, Optional, Sequence

import torch

__all__ = ["UseCell", "MemberUse", "split_parts", "EntryGate", "gated_stack"]

_task_id = torch._C._current_graph_task_id
_is_none = partial(operator.is_, None)
_grad_enabled = torch.is_grad_enabled
_functorch_active = torch._C._are_functorch_transforms_active
_requires_grad = operator.attrgetter("requires_grad")


class UseCell:
    """What the exits downstream of one gather, on one call, saw in the backward.

    ``now``: the members seen in the latest backward pass (``task``); ``ever``: in every
    pass so far. ``True`` stands for every member."""

    __slots__ = ("task", "now", "ever", "higher")

    def __init__(self) -> None:
        self.task: Optional[int] = None
        self.now: Any = None
        self.ever: Any = None
        self.higher = False

    def record(self, seen: Any) -> None:
        """``seen``: ``True`` (every member) or a set of member indices."""
        task = _task_id()
        if task != self.task:
            self.task = task
            self.now = seen if seen is True else set(seen)
        elif self.now is not True:
            if seen is True:
                self.now = True
            else:
                self.now |= seen
        ever = self.ever
        if ever is None:
            self.ever = seen if seen is True else set(seen)
        elif ever is not True:
            if seen is True:
                self.ever = True
            else:
                ever |= seen
        if _grad_enabled():  # backward(create_graph=True): later passes may come through its graph
            self.higher = True

    def used(self) -> Optional[set[int]]:
        """The members to hand a gradient in the running backward pass; ``None``: all."""
        if self.task is None:
            return None
        seen = self.now if (self.task == _task_id() and not self.higher) else self.ever
        return None if seen is True else seen


class MemberUse:
    """The link from one exit of fused values (the node handing every member its part)
    to the stacked tensors upstream of it: a constant argument of the exit's node.

    ``ups``: ``(stacked tensors, mapping)`` pairs, ``mapping[j]`` the member of that
    group that the exit's part ``j`` is (``None``: the same index)."""

    __slots__ = ("ups",)

    def __init__(self, ups: Sequence[tuple[Any, Optional[tuple[int, ...]]]]):
        self.ups = tuple(ups)

    def watch(self, part: torch.Tensor) -> None:
        """Record, in the backward of ``part``'s autograd node (the exit, whose outputs
        are every member's part), which parts a gradient reached, in the cell each
        upstream gather made on this call."""
        node = part.grad_fn
        if node is None:
            return
        cells = [(st.cell, m) for st, m in self.ups if st.cell is not None]
        if not cells:
            return

        def seen(grads: tuple) -> None:
            if any(map(_is_none, grads)):
                parts = {j for j, g in enumerate(grads) if g is not None}
                for cell, m in cells:
                    cell.record(parts if m is None else {m[j] for j in parts})
            else:
                for cell, m in cells:
                    cell.record(True if m is None else set(m))

        node.register_prehook(seen)

    def __repr__(self) -> str:
        return f"MemberUse({len(self.ups)} stacked tensors)"


def split_parts(x: torch.Tensor, sizes: list[int], dim: int, use: Optional[MemberUse] = None) -> tuple:
    """``torch.split(x, sizes, dim)`` (a wide kernel's members), watched by ``use``."""
    parts = torch.split(x, sizes, dim)
    if use is not None:
        use.watch(parts[0])
    return parts


class EntryGate:
    """The link from a group's exits to the ``torch.stack`` that enters the group (a
    constant argument of :func:`gated_stack`): the exits record, in ``cell``, which
    members this call's backward reached, as they do for the group's gathers."""

    __slots__ = ("cell",)
    track = True  # (what MemberUse's links ask of a stacked tensor)

    def __init__(self) -> None:
        self.cell: Optional[UseCell] = None

    def __repr__(self) -> str:
        return "EntryGate()"


class _GatedStack(torch.autograd.Function):
    """``torch.stack(parts)`` whose backward hands a gradient only to the parts of members
    the exits saw reached (all of them where the exits recorded nothing)."""

    @staticmethod
    def forward(ctx, cell: UseCell, *parts: torch.Tensor) -> torch.Tensor:
        ctx.cell = cell
        return torch.stack(parts, 0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        parts = grad.unbind(0)
        used = ctx.cell.used()
        if used is None:
            return (None, *parts)
        return (None, *[p if i in used else None for i, p in enumerate(parts)])


def gated_stack(parts: Sequence[torch.Tensor], gate: EntryGate) -> torch.Tensor:
    """``torch.stack(parts)`` entering a group, gated by ``gate`` (see the module's
    docstring). Without a gradient to route (no grad mode, no part requiring one) or under
    torch.func's transforms (which refuse a Python autograd Function without their
    hooks), autograd's own stack, and no cell: the exits then record nothing for it."""
    if not _grad_enabled() or _functorch_active() or not any(map(_requires_grad, parts)):
        gate.cell = None
        return torch.stack(parts, 0)
    cell = gate.cell = UseCell()
    return _GatedStack.apply(cell, *parts)
