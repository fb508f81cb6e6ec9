"""One leaf ``Parameter`` per fused group, for optimizers that update the group at once.

``StreamScheduledModule.fused_parameters()`` hands the optimizer a
:class:`StackedParameter` ``S`` for every fused group of parameters instead of the
group's N members. ``S`` *is* the stacked storage the members already alias (member
``i``'s weight is ``S[i]``, or rows of ``S`` when the group is concatenated), so an
optimizer step over ``S`` is a handful of tensor ops and every member sees the new
values.

Gradients, the invariant kept while ``S`` is active:

- the fused kernels read ``S`` itself, a leaf: autograd accumulates the stacked gradient
  into ``S.grad`` with one ``AccumulateGrad``; the fused Linear (``StackedLinear``), in a
  plain CPU backward, adds it into ``S.grad`` itself instead, inside its product
  (:func:`grad_sink`), where that is exactly what autograd's accumulation would do;
- ``S.grad`` is one persistent buffer, and every member's ``.grad`` is its slice (a view)
  of that buffer. Reading a member's ``.grad`` reads the stacked gradient; anything
  that adds into a member's ``.grad`` in place (the member used outside its fused kernel,
  another plan that reads the members, the plain model called directly) adds into
  ``S.grad``;
- ``S.grad = None`` (what ``optimizer.zero_grad()`` does) zeroes the buffer instead of
  dropping it, so the members' views stay valid at no per-member cost: after
  ``zero_grad()`` the members' ``.grad`` read zeros, not ``None``;
- a member whose ``.grad`` was set to ``None`` or to another tensor
  (``model.zero_grad()``, a per-member optimizer's ``zero_grad``) is folded back in at the
  next forward or before ``S``'s next accumulation: ``None`` counts as zero, another
  tensor's values are copied into the member's slice, and the member's ``.grad`` is its
  view again. The cheap check looks at the first and last member of the group (every
  member when it finds one out of place), as clearing usually clears all;
- under ``backward(create_graph=True)`` autograd replaces ``S.grad`` by a tensor with a
  graph; the members' ``.grad`` then become views of that tensor (one pass over the
  members), and the next ``zero_grad()`` returns everything to the buffer.

The folding before an accumulation and the taking in after it are two Python hooks on
``S`` (:meth:`StackedParameter._hook`), installed by the first reader whose gradient
autograd accumulates (any fused kernel but ``StackedLinear``, or ``StackedLinear`` under
autocast). A parameter only ``StackedLinear`` reads has none, and saves their two calls a
backward: that backward folds in first and, where it leaves the accumulation to autograd
(``create_graph=True``, hooks of the user's on ``S``, ``autograd.grad``, CUDA), has the
result taken in when the backward ends. (A gradient reaching such an ``S`` only through
the user's own code, with no fused kernel in that backward, gets neither.)
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Optional, Sequence

import torch
from torch import nn

from ...errors import StreamSchedError
from .params import _hooked

__all__ = ["StackedParameter", "StackedLayoutError", "stacked_owner", "layout_version", "grad_sink"]

log = logging.getLogger(__name__)

_GRAD = torch._C.TensorBase.grad
_grad_get = _GRAD.__get__


def _get_grad(t: torch.Tensor) -> Optional[torch.Tensor]:
    return _GRAD.__get__(t)


def _set_grad(t: torch.Tensor, value: Optional[torch.Tensor]) -> None:
    _GRAD.__set__(t, value)


class StackedLayoutError(StreamSchedError, ValueError):
    """What a stacked tensor cannot express: members with different optimizer options,
    some members trainable and others frozen, optimizer state held by some members only."""


# id(member) -> the active StackedParameter holding it (checked by identity on use).
_OWNER: weakref.WeakValueDictionary[int, StackedParameter] = weakref.WeakValueDictionary()
_layout_version = 0


def layout_version() -> int:
    """Moves whenever a stacked parameter is activated, deactivated or re-bound (caches
    of which member lives where compare it)."""
    return _layout_version


def _moved() -> None:
    global _layout_version
    _layout_version += 1


def stacked_owner(p: torch.Tensor) -> Optional[tuple[StackedParameter, int]]:
    """``(S, i)`` when ``p`` is member ``i`` of an active stacked parameter ``S``."""
    s = _OWNER.get(id(p))
    if s is None:
        return None
    link = s._stack
    i = link.index.get(id(p))
    if i is None or link.members[i] is not p:
        return None
    return s, i


class _Link:
    """The bookkeeping of one stacked parameter (kept off the tensor's own dict)."""

    __slots__ = (
        "members",
        "names",
        "sizes",
        "starts",
        "index",
        "buf",
        "owner",
        "views",
        "active",
        "hooks",
        "ref",
        "first",
        "last",
    )

    def __init__(self, members: Sequence[nn.Parameter], names: Sequence[str], sizes: Optional[Sequence[int]]):
        self.members = list(members)
        self.first, self.last = self.members[0], self.members[-1]  # what the cheap checks read
        self.names = list(names)
        self.sizes = tuple(sizes) if sizes is not None else None
        starts, start = [], 0
        for size in self.sizes or ():
            starts.append(start)
            start += size
        self.starts = starts
        self.index = {id(m): i for i, m in enumerate(self.members)}
        self.buf: Optional[torch.Tensor] = None  # the persistent gradient buffer
        self.owner: Optional[torch.Tensor] = None  # what the members' .grad are views of
        self.views: list[torch.Tensor] = []
        self.active = False
        self.hooks: list[Any] = []
        self.ref: Any = None

    def before(self, grad: torch.Tensor) -> None:
        """Before the stacked parameter's gradient accumulates (a tensor hook): members
        re-pointed since the forward (``model.zero_grad()``) are folded in first, so the
        accumulation does not add to a gradient they cleared."""
        members, views = self.members, self.views
        if self.active and views and (members[0].grad is not views[0] or members[-1].grad is not views[-1]):
            s = self.ref()
            if s is not None:
                s._fold_members()
        return None

    def part(self, t: torch.Tensor, i: int) -> torch.Tensor:
        if self.sizes is None:
            return t[i]
        return t.narrow(0, self.starts[i], self.sizes[i])


class StackedParameter(nn.Parameter):
    """The parameters of one fused group as one leaf ``Parameter`` (see the module doc).

    ``members`` are the original parameters (member ``i`` is ``self[i]``, or its rows of
    a concatenated group: ``member_slice(self, i)``), ``member_names`` their qualified
    names.
    Pickled or deep-copied, it becomes a plain ``nn.Parameter`` holding the stacked
    values.
    """

    _stack: _Link

    def __new__(cls, data: Optional[torch.Tensor] = None, requires_grad: bool = True):
        return super().__new__(cls, data, requires_grad)

    @classmethod
    def over(
        cls,
        stack: torch.Tensor,
        members: Sequence[nn.Parameter],
        names: Sequence[str],
        sizes: Optional[Sequence[int]] = None,
    ) -> StackedParameter:
        """A stacked parameter sharing ``stack``'s storage (which the members alias)."""
        flags = {bool(m.requires_grad) for m in members}
        if len(flags) > 1:
            frozen = next(n for n, m in zip(names, members) if not m.requires_grad)
            trainable = next(n for n, m in zip(names, members) if m.requires_grad)
            raise StackedLayoutError(
                f"fused group {names[0]} ... ({len(members)} members): {trainable} is trainable but {frozen} is "
                "frozen (requires_grad=False); one stacked tensor is trained or frozen as a whole. Freeze or unfreeze "
                "the whole group, or keep per-member parameters (model.parameters())"
            )
        hooked = next((n for n, m in zip(names, members) if _hooked(m)), None)
        if hooked is not None:
            # Its gradient would accumulate into the stacked tensor's .grad, past the hook.
            raise StackedLayoutError(
                f"fused group {names[0]} ... ({len(members)} members): {hooked} has a gradient hook "
                "(register_hook or register_post_accumulate_grad_hook), which a stacked tensor's gradient would "
                "bypass. Register it on the stacked tensor, or keep per-member parameters (model.parameters())"
            )
        with torch.inference_mode(False):
            self = cls(stack, requires_grad=flags.pop())
        self.__dict__["_stack"] = _Link(members, names, sizes)
        return self

    def _hook(self) -> None:
        """Hooks on this leaf (it must require grad): fold stray members in before its
        gradient accumulates, and take in a replaced ``.grad`` after."""
        link = self._stack
        if link.hooks or not self.requires_grad:
            return
        link.ref = weakref.ref(self)
        link.hooks = [self.register_hook(link.before), self.register_post_accumulate_grad_hook(_after)]

    # --- what it holds ----------------------------------------------------------------

    @property
    def members(self) -> tuple[nn.Parameter, ...]:
        return tuple(self._stack.members)

    @property
    def member_names(self) -> tuple[str, ...]:
        return tuple(self._stack.names)

    @property
    def concat(self) -> bool:
        """Whether members are concatenated along dim 0 (sizes differ) rather than stacked."""
        return self._stack.sizes is not None

    def member_slice(self, t: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s part of ``t``, a tensor laid out like this parameter (a view)."""
        return self._stack.part(t, i)

    def member_rows(self) -> list[int]:
        """For each row (dim 0 index) of this parameter, the member it belongs to."""
        link = self._stack
        if link.sizes is None:
            return list(range(len(link.members)))
        return [i for i, size in enumerate(link.sizes) for _ in range(size)]

    @property
    def active(self) -> bool:
        """Whether the fused kernels read this parameter (gradients land in its ``.grad``)."""
        return self._stack.active

    def __repr__(self) -> str:
        link = self._stack if "_stack" in self.__dict__ else None
        if link is None:
            return super().__repr__()
        first = link.names[0] if link.names else "?"
        return (
            f"StackedParameter({len(link.members)} x {first} ..., shape={tuple(self.shape)}, "
            f"dtype={self.dtype}, device={self.device}, active={link.active})"
        )

    def __reduce_ex__(self, proto: int) -> Any:
        return (torch._utils._rebuild_parameter, (self.data, self.requires_grad, {}))

    def __deepcopy__(self, memo: dict) -> nn.Parameter:
        if id(self) in memo:
            return memo[id(self)]
        result = nn.Parameter(self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    # --- .grad: one persistent buffer the members' .grad are views of -----------------

    @property
    def grad(self) -> Optional[torch.Tensor]:  # type: ignore[override]
        # Optimizers, clip_grad_norm_ and GradScaler read .grad here: fold in whatever
        # re-pointed a member's .grad since the last check (a few attribute reads).
        g = _grad_get(self)
        link = self.__dict__.get("_stack")
        if link is not None and link.active and link.buf is not None:
            views = link.views
            if g is not link.owner or link.first.grad is not views[0] or link.last.grad is not views[-1]:
                self._check_grads()
                g = _grad_get(self)
        return g

    @grad.setter
    def grad(self, value: Optional[torch.Tensor]) -> None:
        link = self.__dict__.get("_stack")
        buf = link.buf if link is not None else None
        if buf is None:
            _set_grad(self, value)
            return
        if value is None:
            # zero_grad(set_to_none=True): zero the buffer the members' views read (it
            # never requires grad, so no autograd mode is needed).
            buf.zero_()
            if link.owner is not buf or _grad_get(self) is not buf:
                _set_grad(self, buf)
                self._point_members(buf)
            return
        if value is buf or (
            not value.requires_grad
            and value.shape == buf.shape
            and value.dtype == buf.dtype
            and value.device == buf.device
            and value.layout == buf.layout
        ):
            if value is not buf:
                with torch.no_grad():
                    buf.copy_(value)
            if _get_grad(self) is not buf:
                _set_grad(self, buf)
            if link.owner is not buf:
                self._point_members(buf)
            return
        _set_grad(self, value)  # PyTorch checks shape, dtype and device
        self._point_members(value)

    @grad.deleter
    def grad(self) -> None:
        self.grad = None

    # --- keeping the invariant ---------------------------------------------------------

    def _point_members(self, owner: torch.Tensor) -> None:
        """Every member's ``.grad`` becomes its view of ``owner`` (one pass over members)."""
        link = self._stack
        views = [link.part(owner, i) for i in range(len(link.members))]
        for m, v in zip(link.members, views):
            m.grad = v
        link.views = views
        link.owner = owner

    def _link_grads(self) -> None:
        """Create the gradient buffer, holding the members' current gradients."""
        link = self._stack
        with torch.no_grad(), torch.inference_mode(False):
            buf = torch.zeros_like(self, memory_format=torch.contiguous_format)
            for i, m in enumerate(link.members):
                g = m.grad
                if g is not None and g.shape == m.shape:
                    link.part(buf, i).copy_(g)
        link.buf = buf
        _set_grad(self, buf)
        self._point_members(buf)

    def _fold_members(self) -> None:
        """Members whose ``.grad`` is not their view any more: ``None`` counts as zero,
        another tensor's values are copied in; then each is its view again."""
        link = self._stack
        with torch.no_grad():
            for m, v in zip(link.members, link.views):
                g = m.grad
                if g is v:
                    continue
                if g is None:
                    v.zero_()
                elif g.shape == v.shape:
                    v.copy_(g)
                else:
                    raise RuntimeError(
                        f"{link.names[link.index[id(m)]]}.grad has shape {tuple(g.shape)}, expected {tuple(v.shape)}"
                    )
                m.grad = v

    def _adopt(self, g: Optional[torch.Tensor]) -> None:
        """``S.grad`` is no longer what the members' views read: take it in."""
        link = self._stack
        buf = link.buf
        assert buf is not None
        if g is None:
            with torch.no_grad():
                buf.zero_()
            _set_grad(self, buf)
            if link.owner is not buf:
                self._point_members(buf)
        elif g.requires_grad or g.shape != buf.shape or g.dtype != buf.dtype or g.device != buf.device:
            # backward(create_graph=True): the gradient carries a graph; members follow it.
            self._point_members(g)
        else:
            with torch.no_grad():
                buf.copy_(g)
            _set_grad(self, buf)
            if link.owner is not buf:
                self._point_members(buf)

    def _sync(self) -> None:
        """The per-forward check (a few attribute reads when nothing changed), for a
        reader whose gradient autograd accumulates: with the accumulation hooks."""
        self._sync_leaf()
        link = self._stack
        if not link.hooks and self.requires_grad:
            self._hook()

    def _sync_leaf(self) -> None:
        """:meth:`_sync` without installing the hooks: for :class:`StackedLinear`, whose
        backward does their work itself (:func:`grad_sink`)."""
        link = self._stack
        first, last = link.first, link.last
        wanted = first.requires_grad
        if self.requires_grad is not wanted or last.requires_grad is not wanted:
            self._sync_requires_grad()
            if not self.requires_grad:
                return
        elif not wanted:
            return
        if link.buf is None:
            self._link_grads()
            return
        views = link.views
        if _grad_get(self) is not link.owner or first.grad is not views[0] or last.grad is not views[-1]:
            self._check_grads()

    def _check_grads(self) -> None:
        link = self._stack
        g = _get_grad(self)
        if g is not link.owner:
            self._adopt(g)
        views = link.views
        members = link.members
        if members[0].grad is not views[0] or members[-1].grad is not views[-1]:
            self._fold_members()

    def _sync_requires_grad(self) -> None:
        link = self._stack
        flags = {bool(m.requires_grad) for m in link.members}
        if len(flags) > 1:
            raise StackedLayoutError(
                f"fused group {link.names[0]} ...: some members are frozen (requires_grad=False) and others are not; "
                "with fused_parameters() a stacked tensor is trained or frozen as a whole"
            )
        self.requires_grad_(flags.pop())

    # --- activation -------------------------------------------------------------------

    def _activate(self) -> None:
        link = self._stack
        self._sync_requires_grad()
        if self.requires_grad:
            if link.buf is None or link.buf.shape != self.shape or link.buf.device != self.device:
                self._link_grads()
            else:
                self._sync_leaf()
        link.active = True
        for m in link.members:
            _OWNER[id(m)] = self
        _moved()

    def _deactivate(self) -> None:
        link = self._stack
        link.active = False
        for m in link.members:
            if _OWNER.get(id(m)) is self:
                del _OWNER[id(m)]
        _moved()

    def _rebind(self, stack: torch.Tensor) -> None:
        """The members were re-stacked into new storage: point this parameter at it and
        rebuild the gradient buffer from the members' current gradients."""
        link = self._stack
        with torch.no_grad(), torch.inference_mode(False):
            _set_grad(self, None)
            self.data = stack
        link.buf = None
        link.owner = None
        link.views = []
        if link.active and self.requires_grad:
            self._link_grads()
        _moved()


_grad_on = torch.is_grad_enabled
_will_execute = torch._C._will_engine_execute_node
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


def grad_sink(t: torch.Tensor, node: Any) -> Optional[torch.Tensor]:
    """Inside the backward of a function that read ``t`` (``node``: ``t``'s
    ``AccumulateGrad``, the function's edge to it): the buffer ``t``'s gradient may be
    added into in place by the function itself, or ``None`` where it returns the
    gradient for autograd to accumulate.

    For an active stacked parameter it first does what its accumulation hooks do
    (:meth:`StackedParameter._hook`; :class:`StackedLinear` reads it without them): members
    whose ``.grad`` was re-pointed are folded in, and where autograd will accumulate, the
    result is taken in once the backward is done. It returns the buffer where ``t``'s
    ``.grad`` is the persistent buffer the members' views read, on the CPU (a CUDA
    backward may run on another stream than autograd's accumulation), with no gradient
    graph being built (``create_graph=False``), no hook on ``t`` but its own, and this
    backward about to accumulate into ``t`` (not ``autograd.grad``, nor
    ``backward(inputs=...)`` without it): there, adding it in place is what autograd's
    accumulation would do, without its separate add and its hooks."""
    link = t.__dict__.get("_stack") if type(t) is StackedParameter else None
    if link is None or not link.active:
        return None
    buf = link.buf
    if buf is None:
        return None
    members, views = link.members, link.views
    if members[0].grad is not views[0] or members[-1].grad is not views[-1]:
        t._fold_members()
    hooked = 1 if link.hooks else 0
    if (
        _grad_on()
        or _grad_get(t) is not buf
        or link.owner is not buf
        or not buf.is_cpu
        or len(t._backward_hooks or ()) != hooked
        or len(t._post_accumulate_grad_hooks or ()) != hooked
        or node is None
        or not _accumulates(node)
    ):
        if not hooked:
            _queue_callback(lambda: _after(t))
        return None
    return buf


def _accumulates(node: Any) -> bool:
    """Whether the running backward will run ``node``, a leaf's ``AccumulateGrad``."""
    try:
        return _will_execute(node)
    except RuntimeError:  # autograd.grad(), which asks this of no leaf: it accumulates none
        return False


def _after(s: StackedParameter) -> None:
    """After ``s``'s gradient accumulated: autograd may have replaced ``.grad`` (under
    ``create_graph=True``, or where it was ``None``); take it in."""
    link = s.__dict__["_stack"]
    if link.buf is not None and _get_grad(s) is not link.owner:
        s._adopt(_get_grad(s))


# torch.optim picks its multi-tensor ("foreach") path by exact type; a stacked
# parameter is an nn.Parameter in every respect that path relies on.
try:  # pragma: no cover - depends on the PyTorch version
    from torch.optim import optimizer as _optimizer

    if StackedParameter not in _optimizer._foreach_supported_types:
        _optimizer._foreach_supported_types.append(StackedParameter)
except (ImportError, AttributeError):  # pragma: no cover
    pass
