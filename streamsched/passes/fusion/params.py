"""The parameters of fused members, held in one stacked tensor, and kept the truth.

Each member's ``weight`` stays the very same ``nn.Parameter`` object (same name, same
``state_dict`` key, same optimizer state), but its storage is moved into a slice of one
stacked tensor (``alias`` mode): ``stack[i]`` *is* member ``i``'s weight. So:

- a batched kernel reads all N weights with no copy;
- ``optimizer.step()``, ``load_state_dict()`` and ``torch.nn.init`` write in place into
  the stack, and the next forward sees the new values;
- gradients flow back through :class:`GatherStacked`, whose backward hands ``grad[i]``
  to member ``i``, so each original parameter's ``.grad`` is filled as in the loop; or,
  with ``grad_handoff="direct"``, through :class:`HandOffStacked`, whose backward fills
  every member's ``.grad`` in one native call (``csrc/grad_handoff.cpp``) instead of
  one autograd edge and one ``AccumulateGrad`` per member. Either way only members
  whose output a gradient reached get one, as in eager
  (:mod:`streamsched.passes.fusion.member_use`).

Anything that gives a member new storage (``.to()``, ``p.data = ...``, re-assigning the
attribute) breaks the alias; :meth:`StackedTensors.check` notices and re-stacks before
the next use. A tensor that ``torch.func.functional_call`` swaps into a member's place
(straight into ``_parameters`` / ``_buffers``) is read instead of the stack, stacked per
call, until the member is put back; its storage is never taken over. Where aliasing
is impossible (a tensor shared by two members, or already aliased into another group's
stack, or ``fuse_params="copy"``), the stack is rebuilt with ``torch.stack`` on every
call (``copy`` mode): slower, never stale.

A model wrapped again finds its members aliased into the first wrapper's stacks: where
no live :class:`StackedTensors` reads such a stack any more (the first wrapper was
dropped) they are re-stacked; where a live one holds the same members in the same order,
the second reads that very stack (``share``; see :meth:`StackedTensors._restack`), and
a re-stack by either moves both; otherwise copy mode.

Members of different sizes along dim 0 (heads of different widths reading one input)
are held concatenated instead of stacked (``concat=True``).

``StreamScheduledModule.fused_parameters()`` turns each aliased group of parameters into
a :class:`~streamsched.passes.fusion.stacked.StackedParameter` bound here (``bind``): the
kernels then read that leaf, and its ``.grad`` (which every member's ``.grad`` is a view
of) receives the stacked gradient, for optimizers that update the group at once.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from ... import _generation
from ..._native import native
from ...errors import FusedMembersReshaped
from .member_use import UseCell

__all__ = ["GatherStacked", "HandOffStacked", "StackedTensors", "stacks_holding"]

log = logging.getLogger(__name__)

_functorch_active = torch._C._are_functorch_transforms_active


class GatherStacked(torch.autograd.Function):
    """``stack`` as a differentiable function of the member tensors it aliases."""

    @staticmethod
    def forward(
        ctx, stack: torch.Tensor, sizes: Optional[tuple[int, ...]], cell: Optional[UseCell], *members: torch.Tensor
    ):
        ctx.sizes = sizes
        ctx.cell = cell
        if cell is not None:
            ctx.members = members
        return stack.view_as(stack)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A contiguous gradient can carry odd strides on size-1 dims ([N, 1, k] with strides
        # (k, 1, 1)), which its slices inherit and DDP compares literally; one view() of the
        # whole restates canonical strides for every slice at no cost.
        if grad.is_contiguous():
            grad = grad.view(grad.shape)
        parts = grad.unbind(0) if ctx.sizes is None else grad.split(ctx.sizes, 0)
        cell = ctx.cell
        if cell is not None:
            used = cell.used()
            if used is not None:
                # Members whose output no gradient reached get none, as in eager, except
                # those with gradient hooks: autograd would still call their hooks (with
                # None), which eager never calls; they get zeros, as before.
                members = ctx.members
                return (
                    None,
                    None,
                    None,
                    *[p if i in used or _hooked(members[i]) else None for i, p in enumerate(parts)],
                )
        return (None, None, None, *parts)


def _hooked(t: torch.Tensor) -> bool:
    """Whether ``t`` has gradient hooks (``register_hook``,
    ``register_post_accumulate_grad_hook``) other than the ``auto`` trial's backward
    timing (:class:`~streamsched.backward_timing.BackwardSample`, which takes ``None``)."""
    hooks = t._backward_hooks
    if hooks and not all(getattr(getattr(h, "__self__", None), "backward_timer", False) for h in hooks.values()):
        return True
    return bool(getattr(t, "_post_accumulate_grad_hooks", None))


class HandOffStacked(torch.autograd.Function):
    """``stack`` as a differentiable value whose gradient goes straight to the members.

    Of the members, only ``canary`` is an input: it makes the output require grad, and
    its edge lets ``autograd.grad()`` / ``backward(inputs=...)`` naming it reach the
    backward, which then raises rather than silently leaving members out. In a plain
    ``backward()`` the native hand-off writes every member's ``.grad`` (the canary's
    included) as ``AccumulateGrad`` would, and the canary's edge carries zeros: its
    ``AccumulateGrad`` is a leaf of the engine, so the engine orders this node's stream
    (whose kernels wrote the gradients) before the caller's when ``backward()`` returns,
    as it does for every gradient on CUDA.

    With member tracking (``cell``, see :mod:`streamsched.passes.fusion.member_use`),
    members no gradient reached get no ``.grad``: the hand-off writes every member, and
    the ``.grad`` it gave those that had none is taken back. When the canary is one of
    them its edge carries nothing (zeros would give it a ``.grad``), so the node also has
    an edge to ``sink``, an empty leaf that always receives an empty gradient: the leaf
    that keeps this node's stream waited for.
    """

    @staticmethod
    def forward(
        ctx,
        stack: torch.Tensor,
        canary: torch.Tensor,
        handoff: Any,
        cell: Optional[UseCell] = None,
        members: Sequence[torch.Tensor] = (),
        sink: Optional[torch.Tensor] = None,
    ):
        ctx.handoff = handoff
        ctx.canary = canary
        ctx.cell = cell
        ctx.members = members
        ctx.sink = sink is not None
        return stack.view_as(stack)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cell = ctx.cell
        used = cell.used() if cell is not None else None
        canary = ctx.canary
        to_canary: Optional[torch.Tensor] = grad.new_zeros(()).expand(canary.shape)
        if used is None:
            ctx.handoff.accumulate(grad)
        else:
            # Members whose output no gradient reached get none, as in eager: the hand-off
            # adds zeros to a .grad they have (no change) and gives one to those without,
            # which is taken back. The canary's edge carries nothing then; the sink's
            # (an empty leaf) orders this node's stream before the caller's instead.
            unset = [m for i, m in enumerate(ctx.members) if i not in used and m.grad is None]
            ctx.handoff.accumulate(grad)
            for m in unset:
                m.grad = None
                if m is canary:
                    to_canary = None
        sink = grad.new_zeros((0,)) if ctx.sink else None
        return None, to_canary, None, None, None, sink


_data_ptr = torch.Tensor.data_ptr

_restacks = 0
"""How many re-stacks there have been, of any group anywhere: a :class:`StackSetGuard`
armed before the last one watches tensors that may no longer be the members."""


# Every stack some StackedTensors made, by its storage's address: the StackedTensors that
# read it (weakly: a dropped wrapper's stacks leave with it) and a weak reference to the
# storage (telling it from a new storage at the same address). A model wrapped again finds
# its members in here (see stacks_holding).
_registry: dict[int, tuple[StorageWeakRef, list[weakref.ref]]] = {}


def _storage_key(t: torch.Tensor) -> Optional[int]:
    if t.grad_fn is not None or t.is_sparse or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def stacks_holding(t: torch.Tensor) -> Optional[list[StackedTensors]]:
    """The live :class:`StackedTensors` whose stack ``t``'s storage is (alias mode, not
    retired), or None when that storage is no stack a StackedTensors made. An empty list:
    a stack whose StackedTensors are all gone (their wrapper was dropped), so its
    members' storage is nobody's and may be re-stacked."""
    key = _storage_key(t)
    if key is None:
        return None
    entry = _registry.get(key)
    if entry is None:
        return None
    if entry[0].expired() or entry[0].cdata != StorageWeakRef(t.untyped_storage()).cdata:
        return None
    live = []
    for ref in entry[1]:
        s = ref()
        if s is not None and not s.retired and s._storage_key() == key:
            live.append(s)
    return live


def _register(stack: torch.Tensor, holder: StackedTensors) -> None:
    key = _storage_key(stack)
    if not key:  # meta tensors, empty storage: no address to tell stacks apart by
        return
    entry = _registry.get(key)
    ref = StorageWeakRef(stack.untyped_storage())
    if entry is None or entry[0].expired() or entry[0].cdata != ref.cdata:
        entry = _registry[key] = (ref, [])
    refs = [r for r in entry[1] if r() is not None and r() is not holder]
    refs.append(weakref.ref(holder))
    entry[1][:] = refs
    if len(_registry) > 64 and len(_registry) & 63 == 0:
        for k in [k for k, e in _registry.items() if e[0].expired()]:
            del _registry[k]


class StackedTensors:
    """N member tensors (``getattr(module, name)`` for each owner) as one tensor.

    ``value(grad)`` returns ``[N, *shape]`` (or ``[sum(sizes), *rest]`` when ``concat``)
    holding the members' current values, differentiable with respect to each member
    when ``grad`` is true.
    """

    def __init__(
        self,
        owners: Sequence[tuple[nn.Module, str]],
        concat: bool = False,
        alias: bool = True,
        direct_grads: bool = False,
        tensors: Optional[Sequence[torch.Tensor]] = None,
        share: Optional[StackedTensors] = None,
    ):
        """``tensors``: the owners' tensors, where the caller has just read them.
        ``share``: a live stack (another wrapper's) holding the same members in the same
        order: this one reads its stack rather than re-stacking (see :meth:`_restack`)."""
        self.owners = list(owners)
        self.concat = concat
        self.alias = alias
        self.direct_grads = direct_grads
        # Whether value() reads the stack: False in copy mode, and while a tensor swapped
        # into a member's place (torch.func.functional_call) stands in for it (see check).
        self.live = alias
        self._set_aside: Optional[torch.Tensor] = None  # the stack, while something stands in
        self.tensors: list[torch.Tensor] = (
            list(tensors) if tensors is not None else [getattr(m, n) for m, n in self.owners]
        )
        self.sizes: Optional[tuple[int, ...]] = tuple(int(t.shape[0]) for t in self.tensors) if concat else None
        self.stack: Optional[torch.Tensor] = None
        # The members' shapes when stacked: the fused kernels' shapes (see _restack).
        self._shapes: Optional[list[torch.Size]] = None
        self._ptrs: list[int] = []
        self._guard: Any = None
        self._handoff: Any = None
        # The StackedParameter the kernels read while fused_parameters() is on (see
        # streamsched.passes.fusion.stacked): a leaf whose .grad the members' .grad are views of.
        self.param: Any = None
        # Member tracking (see streamsched.passes.fusion.member_use): None until a plan
        # links this stack's kernels to their exits, then True while every kernel reading
        # it has only understood consumers (False for good once one has not); ``cell``:
        # the UseCell of the latest differentiable read.
        self.track: Optional[bool] = None
        self.cell: Optional[UseCell] = None
        self._sink: Optional[torch.Tensor] = None  # an empty leaf (the direct hand-off's, see HandOffStacked)
        self.rebuilds = 0
        # Views of the stack the kernels take on every call (a transpose, an unsqueeze),
        # kept per (op, arguments) with the stack they were taken of: see view_of.
        self._views: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # Set when the wrapper's plans were dropped (FusionContext.invalidate): no longer
        # counted as reading its stack.
        self.retired = False
        if self.alias:
            self._restack(self.tensors, share)

    # --- alias maintenance ----------------------------------------------------------

    def _storage_key(self) -> Optional[int]:
        stack = self.stack if self.live else self._set_aside
        return None if stack is None or not self.alias else stack.untyped_storage().data_ptr()

    def sharer(self, tensors: Sequence[torch.Tensor]) -> Optional[StackedTensors]:
        return StackedTensors.sharer_of(tensors, self.concat, self)

    @staticmethod
    def sharer_of(
        tensors: Sequence[torch.Tensor], concat: bool, exclude: Optional[StackedTensors] = None
    ) -> Optional[StackedTensors]:
        """A live stack (of another wrapper of the model) whose members are ``tensors``,
        the same objects in the same order, laid out alike (stacked or concatenated), each
        of them still its slice: its stack can be this one's too."""
        held = stacks_holding(tensors[0])
        for other in held or ():
            if (
                other is not exclude
                and other.live
                and other.concat == concat
                and len(other.tensors) == len(tensors)
                and all(a is b for a, b in zip(other.tensors, tensors))
                and list(map(_data_ptr, tensors)) == other._ptrs
                and (other._guard is None or other._guard.valid())
            ):
                return other
        return None

    def retire(self) -> None:
        self.retired = True

    def _restack(self, tensors: Optional[list[torch.Tensor]] = None, share: Optional[StackedTensors] = None) -> None:
        """Stack the members and make each a view of its slice; ``tensors``: the owners'
        tensors, just read (else read here).

        Where another wrapper of the model holds the same members in the same order in a
        live stack (``share``, or found here: it re-stacked them first, after ``.to()`` or
        ``p.data = ...``), that stack is this one's too: both read one storage, which
        optimizer steps and ``load_state_dict`` through either update in place, and
        neither takes the members from the other (each re-stacking in turn would copy
        all of them on every call)."""
        tensors = tensors if tensors is not None else [getattr(m, n) for m, n in self.owners]
        shapes = [t.shape for t in tensors]
        if self._shapes is not None and shapes != self._shapes:
            (module, name), now, was = next(
                ((o, a, b) for o, a, b in zip(self.owners, shapes, self._shapes) if a != b),
                (self.owners[0], shapes[0], self._shapes[0]),
            )
            raise FusedMembersReshaped(
                f"{type(module).__name__}.{name} of a fused group is {tuple(now)} now, {tuple(was)} when planned"
            )
        global _restacks
        _restacks += 1
        self.tensors = tensors
        followers: list[StackedTensors] = []
        if share is None:
            share = self.sharer(self.tensors)
        if share is not None:
            stack = share.stack
            assert stack is not None
            log.debug("fused tensors (%s) read another wrapper's stack", self.owners[0][1])
        else:
            # The other wrappers reading the old stack with these very members follow at
            # once: one of them may hold the stacked parameter an optimizer steps before
            # its own next call.
            old = self.stack if self.live else self._set_aside
            if old is not None:
                followers = [
                    o
                    for o in stacks_holding(old) or ()
                    if o is not self
                    and o.live
                    and len(o.tensors) == len(self.tensors)
                    and all(a is b for a, b in zip(o.tensors, self.tensors))
                ]
            stack = self._stack_members()
        self.stack = stack
        self._shapes = shapes
        _register(stack, self)
        self._views.clear()  # views of the old stack would keep its storage alive
        self._ptrs = [t.data_ptr() for t in self.tensors]
        nat = native()
        self._guard = nat.StackGuard(self.tensors) if nat is not None else None
        if self.direct_grads and nat is not None:
            self._handoff = nat.GradHandOff(self.tensors, list(self.sizes or ()))
        if self.param is not None:
            if all(a is b for a, b in zip(self.param._stack.members, self.tensors)):
                if share is None or self.param.data_ptr() != stack.data_ptr():
                    self.param._rebind(stack)  # (a shared one: re-bound by the wrapper that re-stacked)
            else:
                # A member was replaced by another Parameter object: the optimizer holding
                # the stacked parameter no longer holds this group (as after assigning a
                # new Parameter in the loop). Gradients go to the members again.
                log.warning(
                    "fusion: a member of the stacked parameter %s... was replaced; it is no longer updated by "
                    "optimizers built from fused_parameters() (call fused_parameters() again)",
                    self.param._stack.names[0],
                )
                self.param._deactivate()
                self.param = None
        self.rebuilds += 1
        for o in followers:
            o._restack(share=self)

    def _stack_members(self) -> torch.Tensor:
        # The stack becomes the members' storage for good: made under inference_mode it
        # would turn the model's parameters into inference tensors, unusable for training.
        # And outside any torch.func transform the call runs in (a first call under
        # torch.func.grad): made at the transform's level, the stack would be freed with
        # it, and the parameters would hold dangling storage (the process crashed on
        # their next read).
        with torch.inference_mode(False), torch.no_grad(), torch._C._DisableFuncTorch():
            detached = [t.detach() for t in self.tensors]
            stack = torch.cat(detached, 0) if self.concat else torch.stack(detached, 0)
            if self.concat:
                offset = 0
                for t in self.tensors:
                    t.data = stack[offset : offset + t.shape[0]]
                    offset += t.shape[0]
            else:
                # unbind(0): the views stack[i] are, made in one call.
                for t, view in zip(self.tensors, stack.unbind(0)):
                    t.data = view
        return stack

    # --- the stacked parameter ----------------------------------------------------------

    def bind(self, param: Any) -> None:
        """Have the kernels read ``param`` (a StackedParameter over these members)."""
        assert self.alias and self.stack is not None
        self.param = param
        stack = self.stack
        if not (
            param.data_ptr() == stack.data_ptr()
            and param.shape == stack.shape
            and param.dtype == stack.dtype
            and param.device == stack.device
        ):
            param._rebind(stack)

    def unbind(self) -> None:
        self.param = None

    def check(self, full: bool = False) -> None:
        """Re-stack if any member no longer aliases the stack.

        Every call, every member's storage: with the native runtime in one C++ loop,
        without it in one ``map`` (``member.data = t`` on any one member gives it storage of
        its own, which the kernel reading the stack would not see). ``full=True`` (after a
        module anywhere re-registered a parameter, or had a tensor swapped in) also checks
        that each owner still holds its member in its ``_parameters`` / ``_buffers``.

        A tensor that ``torch.func.functional_call`` (``torch.nn.utils.stateless``) swapped
        into an owner's table stands in for the member until it is swapped back: the stack
        is set aside and :meth:`value` stacks what the owners hold on every call (copy mode,
        differentiable with respect to the tensors given), never taking over their storage.
        Any other tensor in a member's place is the member from now on: re-stacked.
        """
        if not self.alias:
            return
        tensors = self.tensors
        if full or not self.live:
            held = [getattr(m, n, None) for m, n in self.owners]
            if any(h is not t for h, t in zip(held, tensors)):
                if all(h is t or _generation.swapped_in(m, n, h) for (m, n), h, t in zip(self.owners, held, tensors)):
                    if self.live:
                        log.debug("fused tensors (%s) swapped out: stacked per call", self.owners[0][1])
                        self.live = False
                        self._set_aside, self.stack = self.stack, None
                        self._views.clear()
                    return
                self._take_back()
                self._restack()
                return
            self._take_back()
        if self._guard is not None:
            stale = not self._guard.valid()
        else:
            stale = list(map(_data_ptr, tensors)) != self._ptrs
        if not stale and full:
            stale = any(
                getattr(m, n) is not t or t.data_ptr() != p for (m, n), t, p in zip(self.owners, tensors, self._ptrs)
            )
        if stale:
            log.debug("re-stacking %d fused tensors (%s)", len(tensors), self.owners[0][1])
            self._restack()

    def _take_back(self) -> None:
        """The members are in their owners' tables again: read the stack again."""
        if not self.live:
            self.live = True
            self.stack, self._set_aside = self._set_aside, None

    # --- values -----------------------------------------------------------------------

    def value(self, grad: bool) -> torch.Tensor:
        if not self.live:
            current = [getattr(m, n) for m, n in self.owners]
            if self.alias or not (grad and self.track) or _functorch_active():
                # Tensors swapped in (torch.func.functional_call, where a Python autograd
                # Function may be refused), or nothing to track: autograd's own stack,
                # which hands every member its slice.
                return torch.cat(current, 0) if self.concat else torch.stack(current, 0)
            # Copy mode (tied weights, members aliased into another live stack in
            # another grouping), tracked: the same stack, through the gather whose backward
            # hands a gradient only to members a gradient reached, as eager does.
            with torch.no_grad():
                stack = torch.cat(current, 0) if self.concat else torch.stack(current, 0)
            if not any(t.requires_grad for t in current):
                return stack
            cell = self.cell = UseCell()
            return GatherStacked.apply(stack, self.sizes, cell, *current)
        stack = self.stack
        assert stack is not None
        param = self.param
        if param is not None:
            if grad:
                param._sync()
                return param
            return stack
        first, last = self.tensors[0], self.tensors[-1]
        if grad and (first.requires_grad or last.requires_grad):
            if _functorch_active():
                # Under torch.func's transforms (vmap, grad over the wrapper), which refuse
                # a Python autograd Function without their hooks: autograd's own stack of
                # the members (a copy), which hands every member its slice.
                return torch.cat(self.tensors, 0) if self.concat else torch.stack(self.tensors, 0)
            cell = None
            if self.track:
                cell = self.cell = UseCell()
            if self._handoff is not None and not self._handoff.hooked():
                canary = first if first.requires_grad else last
                if cell is None:
                    return HandOffStacked.apply(stack, canary, self._handoff)
                sink = self._sink
                if sink is None or sink.device != stack.device:
                    with torch.inference_mode(False):
                        sink = self._sink = torch.zeros(0, device=stack.device, requires_grad=True)
                return HandOffStacked.apply(stack, canary, self._handoff, cell, self.tensors, sink)
            return GatherStacked.apply(stack, self.sizes, cell, *self.tensors)
        return stack

    def leaf_value(self, grad: bool) -> torch.Tensor:
        """:meth:`value` for :class:`~streamsched.passes.fusion.kernels.StackedLinear`,
        whose backward does the work of a stacked parameter's accumulation hooks itself
        (``stacked.grad_sink``): the stacked parameter is checked without installing
        them."""
        param = self.param
        if param is not None and grad and self.live:
            param._sync_leaf()
            return param
        return self.value(grad)

    def view_of(self, grad: bool, op: Callable[..., torch.Tensor], *args: Any) -> torch.Tensor:
        """``op(self.value(grad), *args)``, where ``op`` makes a view (``Tensor.transpose``,
        ``Tensor.unsqueeze``, ``Tensor.reshape`` of the contiguous stack).

        When the value is the stack itself (no gradient to route: inference, ``no_grad``,
        frozen members) the view is made once and kept while the stack is the same tensor
        (a re-stack makes a new one): it shares the stack's storage, so in-place updates
        (optimizer steps, ``load_state_dict``) show through it, and each call saves the
        view ops' dispatch. A differentiable value (the gather, the stacked parameter) or
        a copy is viewed anew every call, as its autograd history must be its own.
        """
        if grad:
            param = self.param
            if param is not None and self.live:  # value(True): the stacked parameter, viewed anew
                param._sync()
                return op(param, *args)
        value = self.value(grad)
        if value is not self.stack:
            return op(value, *args)
        key = (op, args)
        kept = self._views.get(key)
        if kept is not None and kept[0] is value:
            return kept[1]
        # Made outside inference mode (defensive): autograd tags a view taken under
        # inference_mode, and later calls that record history (frozen members' weights,
        # tests/test_stacked_views.py) read the same view.
        with torch.inference_mode(False):
            view = op(value, *args)
        if view._base is value:  # a copy would go stale under in-place updates: never kept
            self._views[key] = (value, view)
        return view

    @property
    def grad_handoff(self) -> str:
        """How gradients reach the members now: ``"direct"`` (one native call),
        ``"autograd"`` (an edge per member: the default, copy mode, or members with
        gradient hooks), or ``"unavailable"`` (``direct`` asked for without the native
        extension), or ``"stacked"`` (``fused_parameters()``: into the stacked
        parameter's ``.grad``, which the members' ``.grad`` are views of)."""
        if self.param is not None:
            return "stacked"
        if self._handoff is not None:
            return "autograd" if self._handoff.hooked() else "direct"
        if self.direct_grads and self.alias and native() is None:
            return "unavailable"
        return "autograd"

    def __len__(self) -> int:
        return len(self.owners)

    @staticmethod
    def set_guard(stacks: Sequence[StackedTensors]) -> StackSetGuard:
        """One check of all of ``stacks`` (what a program reading them runs per call)."""
        return StackSetGuard(stacks)


class StackSetGuard:
    """:meth:`StackedTensors.check` of every stack one program reads, in one pass.

    Armed after every stack's own check passed, it records where all their members' storage
    is (with the native runtime one ``StackGuard`` over all of them, one C++ loop; without
    it, their ``data_ptr`` list). While no group anywhere has re-stacked since (a re-stack
    makes other tensors the members, or moves them) and every member is where it was, each
    stack's own check would pass: nothing to do. Otherwise each stack checks itself (and
    re-stacks what went stale) and the guard re-arms. The same condition as checking each
    stack, for one call instead of one per stack.
    """

    __slots__ = ("stacks", "_restacks", "_guard", "_tensors", "_ptrs")

    def __init__(self, stacks: Sequence[StackedTensors]):
        self.stacks = tuple(s for s in stacks if s.alias)  # copy mode: stacked anew every call
        self._restacks = -1
        self._guard: Any = None
        self._tensors: list[torch.Tensor] = []
        self._ptrs: list[int] = []

    def check(self) -> None:
        if self._restacks == _restacks:
            guard = self._guard
            if guard is not None:
                if guard.valid():
                    return
            elif list(map(_data_ptr, self._tensors)) == self._ptrs:
                return
        for stack in self.stacks:
            stack.check()
        self._arm()

    def _arm(self) -> None:
        tensors = [t for s in self.stacks for t in s.tensors]
        nat = native()
        self._guard = nat.StackGuard(tensors) if nat is not None else None
        self._tensors = tensors
        self._ptrs = [t.data_ptr() for t in tensors]
        self._restacks = _restacks
