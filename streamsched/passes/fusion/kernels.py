"""Batched kernels: one call that does the work of N identical members.

Each kernel is a callable object stored as the target of one fx node. It knows the
layout of each input (see :mod:`streamsched.passes.fusion.layout`) and the layout of
what it returns (``out_layout``), reads the members' parameters through
:class:`~streamsched.passes.fusion.params.StackedTensors` (so they are never stale), and
reads each member's mode (``training``) at call time, as the member itself would. How
each kernel is built from a proposed group's members is in
:mod:`streamsched.passes.fusion.builders`.

============  =====================================  =====================
members       kernel                                  output layout
============  =====================================  =====================
Linear        one ``baddbmm``; one wide ``linear``     stack; fold(last);
              when all read the same tensor; on the   transposed
              CPU in chains of Linears ``W @ x``
Conv1d/2d/3d  one grouped conv; one wide conv when    fold(channels)
              all read the same tensor
BatchNorm     one ``batch_norm`` on ``[B, N*C, ...]``  fold(1)
              with stacked running statistics
LayerNorm     one ``layer_norm`` + stacked affine      stack
elementwise   the op once on the whole tensor         input's
anything      ``vmap(functional_call)``               stack
============  =====================================  =====================
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .layout import SHARED, STACK, TRANSPOSED, Layout, aligned_stack, fold, to_fold, to_stack, transposer
from .params import StackedTensors
from .stacked import StackedParameter
from .stacked import grad_sink as _grad_sink

__all__ = [
    "FusedKernel",
    "FusedDtypeError",
    "LinearKernel",
    "ConvKernel",
    "BatchNormKernel",
    "LayerNormKernel",
    "ElementwiseKernel",
    "VmapKernel",
    "WideKernel",
]


class FusedDtypeError(RuntimeError):
    """A fused kernel returned another dtype than its members do under the same autocast
    state and input dtypes. Never expected: each kernel kind is built to match (or left
    unfused where it cannot); raised rather than return a silently different result."""


class FusedKernel:
    """Base: naming for fx, the facts the plan shows, and the dtype check.

    Subclasses implement :meth:`run` (the general path) and may implement
    :meth:`specialise`: the same work as one function built for this kernel's layouts,
    shapes and parameter modes, with nothing decided per call that the build already
    knows. A compiled program calls :attr:`fast` (or :attr:`fast_private`): the first call
    runs the specialised function and checks that the result has :attr:`out_dtype`, the
    dtype the members returned on the recording call (under the autocast state and input
    dtypes the plan is keyed by); later calls are the specialised function alone (an
    instance attribute replaces the checking method). Calling the kernel itself is
    :attr:`fast`.
    """

    kind = "fused"
    kernel = "fused"
    out_dtype: Optional[torch.dtype] = None
    """What each member returns; set by the pass from the recorded metas."""
    fresh_output = False
    """Whether every call returns a tensor of its own (no view of an input, a parameter or
    a kept tensor): a consumer that is its only reader may then write it in place."""

    def __init__(self, n: int, members: Sequence[str], out_layout: Layout, out_shape: tuple[int, ...]):
        self.n = n
        self.member_names = list(members)
        self.out_layout = out_layout
        self.out_shape = tuple(out_shape)
        self.__name__ = f"fused_{self.kind}"
        self.__qualname__ = self.__name__
        self.__module__ = "streamsched.passes.fusion"

    def __repr__(self) -> str:
        return f"<{self.kernel} x{self.n}: {self.member_names[0]} ...>"

    def __getstate__(self) -> dict:
        # The specialised functions close over this kernel's stacks: a copy builds its own.
        state = dict(self.__dict__)
        for key in ("fast", "fast_private", "_specialised"):
            state.pop(key, None)
        return state

    @property
    def params(self) -> list[StackedTensors]:
        return []

    def run(self, *xs: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def specialise(self, private: bool = False) -> Callable[..., torch.Tensor]:
        """The kernel's work as one function of its inputs, built once. ``private``: the
        caller guarantees that each tensor input is a fresh value nothing else reads, so
        the function may write it in place (where the result and every gradient stay the
        same). The default is :meth:`run`."""
        return self.run

    def _built(self, private: bool) -> Callable[..., torch.Tensor]:
        built = self.__dict__.setdefault("_specialised", {})
        fn = built.get(private)
        if fn is None:
            fn = built[private] = self.specialise(private)
        return fn

    @property
    def dtype_checked(self) -> bool:
        """Whether the result's dtype was checked (on the first call). Setting it to
        ``False`` checks again on the next call."""
        return self.__dict__.get("_dtype_checked", False)

    @dtype_checked.setter
    def dtype_checked(self, value: bool) -> None:
        self.__dict__["_dtype_checked"] = bool(value)
        if not value:  # back to the checking methods of the class
            self.__dict__.pop("fast", None)
            self.__dict__.pop("fast_private", None)

    def fast(self, *xs: torch.Tensor) -> torch.Tensor:
        """The kernel on ``xs`` (what a compiled program calls; never writes its inputs)."""
        fn = self._built(False)
        out = fn(*xs)
        if not self.dtype_checked:
            self._check_dtype(out)
        self.fast = fn  # type: ignore[method-assign] # checked: later calls skip this frame
        return out

    def fast_private(self, *xs: torch.Tensor) -> torch.Tensor:
        """As :meth:`fast`, for a program that proved each tensor input a fresh value
        with no other reader (see :meth:`specialise`)."""
        fn = self._built(True)
        out = fn(*xs)
        if not self.dtype_checked:
            self._check_dtype(out)
        self.fast_private = fn  # type: ignore[method-assign]
        return out

    def __call__(self, *xs: torch.Tensor) -> torch.Tensor:
        return self.fast(*xs)

    def _check_dtype(self, out: torch.Tensor) -> None:
        if self.out_dtype is not None and out.dtype is not self.out_dtype:  # dtypes are singletons
            raise FusedDtypeError(
                f"fused {self.kernel} x{self.n} ({self.member_names[0]} ...) returned {out.dtype} where its "
                f"members return {self.out_dtype}; this is a streamsched bug: please report it, and pass "
                "fuse=False to run the members one by one"
            )
        # A plan runs under one autocast state and one set of input dtypes, so every
        # later call returns this dtype too: checked on the first call only.
        self.dtype_checked = True


def _grad() -> bool:
    return torch.is_grad_enabled()


_NEVER = object()


class _NoStack:
    """Stands for an absent bias in the kept-views check (its ``stack`` is never replaced)."""

    stack = None


_NO_STACK = _NoStack()


def _kept_views(
    weight: StackedTensors,
    wop: Callable[..., torch.Tensor],
    wargs: tuple,
    bias: Optional[StackedTensors],
    bop: Callable[..., torch.Tensor],
    bargs: tuple,
) -> tuple[list, Callable[[bool], tuple[torch.Tensor, Optional[torch.Tensor]]]]:
    """The weight and bias views a kernel reads, and where it keeps them between calls.

    Returns ``(kept, views)``: ``views(grad)`` takes both views through
    :meth:`StackedTensors.view_of` (the general path, any mode); when no gradient is
    routed and both are views of their current stacks it also stores
    ``[weight stack, bias stack, weight view, bias view]`` in ``kept``. A kernel reads
    ``kept[2:]`` directly while grad mode is off and both stacks are still the tensors
    in ``kept[:2]`` (a re-stack makes new ones): the views share the stacks' storage, so
    in-place updates show through them. Copy-mode stacks (no alias) never match.
    """
    kept: list = [_NEVER, _NEVER, None, None]
    cacheable = weight.alias and (bias is None or bias.alias)

    def views(grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        w = weight.view_of(grad, wop, *wargs)
        b = bias.view_of(grad, bop, *bargs) if bias is not None else None
        if not grad and cacheable:
            ws = weight.stack
            bs = bias.stack if bias is not None else None
            if w._base is ws and (b is None or b._base is bs):
                kept[:] = [ws, bs, w, b]
        return w, b

    return kept, views


class StackedLinear(torch.autograd.Function):
    """``xs @ w^T + b`` over the member axis (``xs`` ``[N, M, in]``, ``w`` ``[N, out, in]``,
    ``b`` ``[N, out]`` or None), as the fused Linear computes it when a gradient may be
    routed: the same ``baddbmm`` forward, with a backward that makes every gradient in the
    layout ``F.linear``'s backward gives each member.

    Autograd's own ``baddbmm(b, xs, w^T)`` makes the weight's gradient ``xs^T @ grad``,
    ``[N, in, out]``, and hands it back through the transpose: each member's slice of it
    breaks the gradient layout contract, and ``AccumulateGrad`` copies every slice into
    the member's ``.grad`` (eager keeps the tensor autograd made: it steals a dense
    gradient nothing else references). Here the weight's gradient is ``grad^T @ xs``,
    ``[N, out, in]`` like the stack, whose slices ``AccumulateGrad`` keeps, and the input's
    ``grad @ w``, ``[N, M, in]`` like eager's. The backward is made of differentiable ops,
    so ``create_graph=True`` (a gradient penalty) differentiates it again.

    On the CPU, a narrow layer over a larger batch (``2 * out <= M`` and ``M >= 32``: the
    members of ``ParallelFCN``, 10 and 1 outputs over 64 rows) computes the forward
    without ``baddbmm``'s broadcast bias, which ATen's CPU kernel writes out before the
    product: one output as ``W @ xs^T`` written into ``[N, M, 1]`` (``[N, 1, M]`` is the
    same memory; 0.25 ms for ParallelFCN(1000)'s second layer at 64 rows against 0.91 ms
    for ``baddbmm``), several as ``bmm(xs, W^T)`` with the bias added in place after it
    (its first layer: 0.78-1.26 ms against 1.26-1.94 ms for ``W @ xs^T`` copied to a
    stack, which an earlier round chose, and 1.23-1.56 ms for ``baddbmm``; from 0.96x
    to 0.43x the copied product over eight shapes, an Intel Xeon with AVX-512). Under 32
    rows (the critics' layers over 16) ``baddbmm`` is as fast or faster. The backward is
    the same either way."""

    @staticmethod
    def forward(ctx: Any, xs: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
        ctx.save_for_backward(xs, w)
        ctx.b = b  # a leaf (a stack or a stacked parameter): where its gradient goes
        if 2 * w.shape[1] <= xs.shape[1] and xs.shape[1] >= 32 and xs.is_cpu:
            xt = xs.transpose(1, 2)
            if w.shape[1] == 1:
                # One output: [N, 1, M] is [N, M, 1]'s memory, so the product is written
                # straight into the output, which stays a tensor of its own (a view
                # would refuse the in-place ops eager's output takes).
                out = xs.new_empty((xs.shape[0], xs.shape[1], 1))
                into = out.view(xs.shape[0], 1, xs.shape[1])
                if b is None:
                    torch.bmm(w, xt, out=into)
                else:
                    torch.baddbmm(b.unsqueeze(2), w, xt, out=into)
                return out
            # Several outputs: the product in the stacked orientation, the bias added
            # after (the bias broadcast inside baddbmm, and the copy of W @ xs^T to a
            # stack, each cost about as much as the product on the CPU measured).
            y = torch.bmm(xs, w.transpose(1, 2))
            if b is not None:
                y.add_(b.unsqueeze(1))
            return y
        wt = w.transpose(1, 2)
        return torch.bmm(xs, wt) if b is None else torch.baddbmm(b.unsqueeze(1), xs, wt)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        xs, w = ctx.saved_tensors
        b = ctx.b
        grad = _unit_strides(grad)
        need_x, need_w, need_b = ctx.needs_input_grad
        gx = torch.bmm(grad, w) if need_x else None
        gw = gb = None
        edges = ctx.next_functions
        if need_w:
            # A stacked parameter's gradient is added straight into the buffer its
            # .grad is, inside the product, where autograd would add it there itself.
            buf = _grad_sink(w, edges[1][0])
            if buf is None:
                gw = torch.bmm(grad.transpose(1, 2), xs)
            else:
                buf.baddbmm_(grad.transpose(1, 2), xs)
        if need_b and b is not None:
            buf = _grad_sink(b, edges[2][0])
            if buf is None:
                gb = grad.sum(1)
            else:
                buf.add_(grad.sum(1))
        return gx, gw, gb


def _unit_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` with stride 1 on each dim of size 1 (the same elements). A gradient that came
    back through views (a gather's, a transposed view's) can carry any stride there, and
    ATen's CPU batched matmul then takes neither its contiguous nor its transposed path
    but one ``addmm`` per batch item: ParallelFCN(1000)'s one-output layer's input
    gradient took 4.5 ms instead of 0.3 (found with the output handed over transposed)."""
    shape, strides = t.shape, t.stride()
    if all(size != 1 or stride == 1 for size, stride in zip(shape, strides)):
        return t
    return t.as_strided(shape, [1 if size == 1 else stride for size, stride in zip(shape, strides)])


_autocast_on = torch.is_autocast_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_functorch_on = torch._C._are_functorch_transforms_active
_unwrap_dead = torch._C._functorch.unwrap_if_dead
# Function.apply's own C entry: the Python classmethod in front of it binds default
# arguments for a setup_context (StackedLinear has none) and routes functorch transforms
# (checked here), a few microseconds of a small layer's call.
_apply_linear = torch._C._FunctionBase.__dict__["apply"].__get__(None, StackedLinear)


def _stacked_linear(xs: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """:class:`StackedLinear` where the weights take a gradient; otherwise autograd's
    ``baddbmm`` over the transposed weight: for frozen weights (no member gradient to
    lay out; and torch.func transforms and forward-mode AD, which a Python autograd
    Function without their hooks refuses, keep working there as in eager), and under
    autocast (which casts the ``baddbmm`` and records the casts for the backward, where
    the function's own backward would meet gradients of the cast dtype)."""
    if not w.requires_grad or (_any_autocast() and _autocast_on(xs.device.type)) or _functorch_on():
        # Autograd accumulates a stacked parameter's gradient here: with its hooks.
        for p in (w, b):
            if type(p) is StackedParameter and p.requires_grad:
                p._hook()
        wt = w.transpose(1, 2)
        return torch.bmm(xs, wt) if b is None else torch.baddbmm(b.unsqueeze(1), xs, wt)
    # (w and b are the kernel's own stacks or stacked parameters, never functorch wrappers.)
    return _apply_linear(_unwrap_dead(xs), w, b)


def _rows_last_wide(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``w @ x^T (+ b)``: ``x`` ``[rows, in]``, ``w`` ``[N*out, in]``, ``b`` ``[N*out, 1]``.
    A 2-d matmul takes a transposed operand as it is (the BLAS call's own flag)."""
    return torch.mm(w, x.t()) if b is None else torch.addmm(b, w, x.t())


def _rows_last_bmm(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor]) -> torch.Tensor:
    """``w @ x (+ b)``: ``x`` ``[N, in, rows]``, ``w`` ``[N, out, in]``, ``b`` ``[N, out, 1]``."""
    return torch.bmm(w, x) if b is None else torch.baddbmm(b, w, x)


class LinearKernel(FusedKernel):
    kind = "Linear"

    def __init__(
        self,
        members: Sequence[nn.Linear],
        names: Sequence[str],
        weight: StackedTensors,
        bias: Optional[StackedTensors],
        in_layout: Layout,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
        transposed: bool = False,
    ):
        """``transposed``: return the ``TRANSPOSED`` layout (2-d members; the builder's
        choice, see ``builders.transposed_output``). A ``TRANSPOSED`` input is read as it
        is either way; a stacked one, or one folded along the features, is then read as a
        transposed view (:func:`~streamsched.passes.fusion.layout.transposer`)."""
        shared = in_layout == SHARED
        rows_last = in_layout == TRANSPOSED
        if transposed or rows_last:
            assert len(in_shape) == 2 and len(out_shape) == 2, (in_layout, in_shape)
            assert in_layout in (SHARED, TRANSPOSED, STACK, fold(1)), in_layout
        if transposed:
            out_layout = TRANSPOSED
        else:
            out_layout = fold(len(out_shape) - 1) if shared else STACK
        self.kernel = ("wide linear" if shared else "baddbmm") + (" (transposed)" if transposed or rows_last else "")
        super().__init__(len(members), names, out_layout, out_shape)
        self.weight = weight
        self.bias = bias
        self.in_layout = in_layout
        self.in_shape = tuple(in_shape)
        self.in_features = members[0].in_features
        self.out_features = members[0].out_features
        # F.linear's and baddbmm's results are their own; a view of them is not.
        self.fresh_output = shared or len(out_shape) == 2

    @property
    def params(self) -> list[StackedTensors]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        n, fin, fout = self.n, self.in_features, self.out_features
        grad = _grad()
        weight, bias = self.weight, self.bias
        transposed = self.out_layout == TRANSPOSED
        # view_of: the same views as before, kept between calls when no gradient is routed.
        if self.in_layout == SHARED:
            w = weight.view_of(grad, torch.Tensor.reshape, n * fout, fin)
            if transposed and not grad:
                b = bias.view_of(grad, torch.Tensor.reshape, n * fout, 1) if bias is not None else None
                return _rows_last_wide(x, w, b).view(n, fout, self.in_shape[0])
            y = F.linear(x, w, bias.view_of(grad, torch.Tensor.reshape, n * fout) if bias is not None else None)
            return y.view(self.in_shape[0], n, fout).permute(1, 2, 0) if transposed else y
        if (self.in_layout == TRANSPOSED or transposed) and not grad:
            w = weight.view_of(grad, torch.Tensor.view, n, fout, fin)
            xt = transposer(self.in_layout, n, self.in_shape)(x)
            y = _rows_last_bmm(xt, w, bias.view_of(grad, torch.Tensor.unsqueeze, 2) if bias is not None else None)
            return y if transposed else y.transpose(1, 2).contiguous()
        xs = to_stack(x, self.in_layout, n, self.in_shape)
        if xs.dim() != 3:  # members' inputs of other than 2 dims: one batch dim for bmm
            xs = xs.reshape(n, -1, fin)
        if grad:
            y = _stacked_linear(xs, weight.value(True), bias.value(True) if bias is not None else None)
        else:
            wt = weight.view_of(grad, torch.Tensor.transpose, 1, 2)
            if bias is None:
                y = torch.bmm(xs, wt)
            else:
                y = torch.baddbmm(bias.view_of(grad, torch.Tensor.unsqueeze, 1), xs, wt)
        if transposed:  # (with a gradient: the stacked result, viewed transposed)
            return y.transpose(1, 2)
        return y if len(self.out_shape) == 2 else y.view((n,) + self.out_shape)

    def specialise(self, private: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """``run`` for this kernel's input layout and shapes: the weight and bias views
        kept between calls while grad mode is off (see :func:`_kept_views`), the layout
        conversion and the op chosen at build time."""
        if self.in_layout == SHARED:
            return self._wide_rows_last() if self.out_layout == TRANSPOSED else self._wide_linear()
        if self.in_layout == TRANSPOSED or self.out_layout == TRANSPOSED:
            return self._rows_last()
        kind, _d = self.in_layout
        if self.bias is not None and len(self.in_shape) == 2 and len(self.out_shape) == 2 and kind in ("stack", "fold"):
            return self._stacked_baddbmm() if kind == "stack" else self._folded_baddbmm()
        return self._general_bmm()

    def _wide_linear(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A shared input: one ``F.linear`` with every member's weight rows."""
        n, fin, fout = self.n, self.in_features, self.out_features
        weight, bias = self.weight, self.bias
        bsrc: Any = bias if bias is not None else _NO_STACK
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(
            weight, torch.Tensor.reshape, (n * fout, fin), bias, torch.Tensor.reshape, (n * fout,)
        )
        linear = F.linear

        def wide_linear(x: torch.Tensor) -> torch.Tensor:
            grad = is_grad()
            if grad or weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                w, b = views(grad)
                return linear(x, w, b)
            return linear(x, kept[2], kept[3])

        return wide_linear

    def _wide_rows_last(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """A shared 2-d input, the output ``TRANSPOSED``: one ``addmm`` of every member's
        weight rows with the input's transpose (``[N*out, rows]``, viewed ``[N, out,
        rows]``); with a gradient, the wide ``linear`` viewed transposed."""
        n, fin, fout = self.n, self.in_features, self.out_features
        rows = self.in_shape[0]
        weight, bias = self.weight, self.bias
        bsrc: Any = bias if bias is not None else _NO_STACK
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(
            weight, torch.Tensor.reshape, (n * fout, fin), bias, torch.Tensor.reshape, (n * fout, 1)
        )
        linear, reshape, mm, addmm = F.linear, torch.Tensor.reshape, torch.mm, torch.addmm

        def wide_rows_last(x: torch.Tensor) -> torch.Tensor:
            if is_grad():
                w = weight.view_of(True, reshape, n * fout, fin)
                b = bias.view_of(True, reshape, n * fout) if bias is not None else None
                return linear(x, w, b).view(rows, n, fout).permute(1, 2, 0)
            if weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                w, b = views(False)
            else:
                w, b = kept[2], kept[3]
            return (mm(w, x.t()) if b is None else addmm(b, w, x.t())).view(n, fout, rows)

        return wide_rows_last

    def _rows_last(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The input read transposed (``[N, in, rows]``: a ``TRANSPOSED`` one as it is, a
        stack or a fold as a view): one ``baddbmm`` of the weight stack with it, ``[N,
        out, rows]``; copied to a stack where the output is not ``TRANSPOSED``. With a
        gradient, the stacked kernel on the input viewed as a stack (its result viewed
        transposed where the output is)."""
        n, fin, fout = self.n, self.in_features, self.out_features
        weight, bias = self.weight, self.bias
        bsrc: Any = bias if bias is not None else _NO_STACK
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(weight, torch.Tensor.view, (n, fout, fin), bias, torch.Tensor.unsqueeze, (2,))
        for_grad, bmm, baddbmm = _stacked_linear, torch.bmm, torch.baddbmm
        transposed = self.out_layout == TRANSPOSED
        layout, in_shape = self.in_layout, self.in_shape
        as_rows_last = transposer(layout, n, in_shape)

        def rows_last_bmm(x: torch.Tensor) -> torch.Tensor:
            if is_grad():  # (a plan with autograd keeps the stacked layouts: never on its path)
                xs = to_stack(x, layout, n, in_shape)
                y = for_grad(xs, weight.leaf_value(True), bias.leaf_value(True) if bias is not None else None)
                return y.transpose(1, 2) if transposed else y
            if weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                w, b = views(False)
            else:
                w, b = kept[2], kept[3]
            # (the matmul written out: no frame but the input's reading on a call of tens
            # of microseconds)
            xt = as_rows_last(x)
            y = bmm(w, xt) if b is None else baddbmm(b, w, xt)
            return y if transposed else y.transpose(1, 2).contiguous()

        return rows_last_bmm

    def _stacked_baddbmm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """2-d members' inputs already stacked, with a bias: one ``baddbmm``."""
        weight, bias = self.weight, self.bias
        bsrc: Any = bias
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(weight, torch.Tensor.transpose, (1, 2), bias, torch.Tensor.unsqueeze, (1,))
        baddbmm, for_grad = torch.baddbmm, _stacked_linear

        def stacked_baddbmm(x: torch.Tensor) -> torch.Tensor:
            if is_grad():
                return for_grad(x, weight.leaf_value(True), bias.leaf_value(True))
            if weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                wt, b = views(False)
                return baddbmm(b, x, wt)
            return baddbmm(kept[3], x, kept[2])

        return stacked_baddbmm

    def _folded_baddbmm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """2-d members' inputs folded side by side, with a bias: one view to a stack (where
        the input is the contiguous fold planned), then one ``baddbmm``."""
        n, in_shape = self.n, self.in_shape
        weight, bias = self.weight, self.bias
        bsrc: Any = bias
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(weight, torch.Tensor.transpose, (1, 2), bias, torch.Tensor.unsqueeze, (1,))
        _kind, d = self.in_layout
        baddbmm, for_grad = torch.baddbmm, _stacked_linear
        split = in_shape[:d] + (n, in_shape[d]) + in_shape[d + 1 :]
        # to_stack of a contiguous fold as one view: its sizes and strides, worked out
        # once (reshape, then movedim, is two view ops per call). Only for the shape
        # planned (as_strided would not refuse another one, as reshape does).
        stacked = torch.empty(split, device="meta").movedim(d, 0)
        size, stride = tuple(stacked.shape), stacked.stride()
        folded = torch.Size(in_shape[:d] + (n * in_shape[d],) + in_shape[d + 1 :])
        as_strided = torch.as_strided

        def folded_baddbmm(x: torch.Tensor) -> torch.Tensor:
            if is_grad():
                # Autograd's as_strided backward is a scatter into the whole storage.
                xs = x.reshape(split).movedim(d, 0)  # to_stack of a fold: a view where memory allows
                return for_grad(xs, weight.leaf_value(True), bias.leaf_value(True))
            if x.is_contiguous() and x.shape == folded:
                xs = as_strided(x, size, stride, x.storage_offset())
            else:
                xs = x.reshape(split).movedim(d, 0)
            if weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                wt, b = views(False)
                return baddbmm(b, xs, wt)
            return baddbmm(kept[3], xs, kept[2])

        return folded_baddbmm

    def _general_bmm(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """Any other layout or shape: to a stack, one batch dim, ``bmm`` or ``baddbmm``."""
        n, fin = self.n, self.in_features
        weight, bias = self.weight, self.bias
        bsrc: Any = bias if bias is not None else _NO_STACK
        is_grad = torch.is_grad_enabled
        kept, views = _kept_views(weight, torch.Tensor.transpose, (1, 2), bias, torch.Tensor.unsqueeze, (1,))
        layout, in_shape = self.in_layout, self.in_shape
        baddbmm, bmm, for_grad = torch.baddbmm, torch.bmm, _stacked_linear
        flat = len(in_shape) != 2  # members' inputs of other than 2 dims: one batch dim for bmm
        out_view = None if len(self.out_shape) == 2 else (n,) + self.out_shape

        def general(x: torch.Tensor) -> torch.Tensor:
            xs = to_stack(x, layout, n, in_shape)
            if flat:
                xs = xs.reshape(n, -1, fin)
            if is_grad():
                y = for_grad(xs, weight.leaf_value(True), bias.leaf_value(True) if bias is not None else None)
                return y if out_view is None else y.view(out_view)
            if weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                wt, b = views(False)
            else:
                wt, b = kept[2], kept[3]
            y = bmm(xs, wt) if b is None else baddbmm(b, xs, wt)
            return y if out_view is None else y.view(out_view)

        return general


_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


class ConvKernel(FusedKernel):
    kind = "Conv"
    fresh_output = True

    def __init__(
        self,
        members: Sequence[nn.modules.conv._ConvNd],
        names: Sequence[str],
        weight: StackedTensors,
        bias: Optional[StackedTensors],
        in_layout: Layout,
        in_shape: tuple[int, ...],
        out_shape: tuple[int, ...],
    ):
        m = members[0]
        self.nd = len(m.kernel_size)
        self.kind = type(m).__name__
        self.cdim = len(in_shape) - self.nd - 1  # 1 when batched, 0 when not
        self.wide = in_layout == SHARED and m.groups == 1
        self.kernel = f"wide conv{self.nd}d" if self.wide else f"grouped conv{self.nd}d"
        super().__init__(len(members), names, fold(self.cdim), out_shape)
        self.weight = weight
        self.bias = bias
        self.in_layout = in_layout
        self.in_shape = tuple(in_shape)
        self.groups = m.groups
        self.stride, self.padding, self.dilation = m.stride, m.padding, m.dilation
        self.padding_mode = m.padding_mode
        self.pad = getattr(m, "_reversed_padding_repeated_twice", None)
        self.fn = _CONV[self.nd]
        self.weight_shape = (-1,) + tuple(m.weight.shape[1:])  # the stack with N*out filters

    @property
    def params(self) -> list[StackedTensors]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        grad = _grad()
        w = self.weight.value(grad)
        b = self.bias.value(grad) if self.bias is not None else None
        w = w.reshape((-1,) + tuple(w.shape[2:]))
        b = b.reshape(-1) if b is not None else None
        if self.wide:
            xf, groups = x, 1
        else:
            xf = to_fold(x, self.in_layout, self.n, self.in_shape, self.cdim)
            groups = self.n * self.groups
        padding = self.padding
        if self.padding_mode != "zeros":
            xf = F.pad(xf, self.pad, mode=self.padding_mode)
            padding = 0
        return self.fn(xf, w, b, self.stride, padding, self.dilation, groups)

    def specialise(self, private: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
        """``run`` with the weight and bias reshapes kept between calls while grad mode is
        off (see :func:`_kept_views`), and the input conversion, padding and groups
        chosen at build time."""
        weight, bias = self.weight, self.bias
        bsrc: Any = bias if bias is not None else _NO_STACK
        reshape = torch.Tensor.reshape
        kept, views = _kept_views(weight, reshape, self.weight_shape, bias, reshape, (-1,))
        is_grad = torch.is_grad_enabled
        fn, stride, dilation = self.fn, self.stride, self.dilation
        wide, layout, n, in_shape, cdim = self.wide, self.in_layout, self.n, self.in_shape, self.cdim
        groups = 1 if wide else self.n * self.groups
        pad, mode = (self.pad, self.padding_mode) if self.padding_mode != "zeros" else (None, "zeros")
        padding = 0 if pad is not None else self.padding

        def conv(x: torch.Tensor) -> torch.Tensor:
            grad = is_grad()
            if grad or weight.stack is not kept[0] or bsrc.stack is not kept[1]:
                w, b = views(grad)
            else:
                w, b = kept[2], kept[3]
            xf = x if wide else to_fold(x, layout, n, in_shape, cdim)
            if pad is not None:
                xf = F.pad(xf, pad, mode=mode)
            return fn(xf, w, b, stride, padding, dilation, groups)

        return conv


class BatchNormKernel(FusedKernel):
    kind = "BatchNorm"
    kernel = "batch_norm over N*C channels"
    fresh_output = True

    def __init__(
        self,
        members: Sequence[nn.modules.batchnorm._BatchNorm],
        names: Sequence[str],
        weight: Optional[StackedTensors],
        bias: Optional[StackedTensors],
        running_mean: Optional[StackedTensors],
        running_var: Optional[StackedTensors],
        num_batches: Optional[StackedTensors],
        in_layout: Layout,
        in_shape: tuple[int, ...],
    ):
        self.kind = type(members[0]).__name__
        super().__init__(len(members), names, fold(1), in_shape)
        self.first = members[0]
        self.weight, self.bias = weight, bias
        self.running_mean, self.running_var, self.num_batches = running_mean, running_var, num_batches
        self.in_layout = in_layout
        self.in_shape = tuple(in_shape)

    @property
    def params(self) -> list[StackedTensors]:
        return [
            p for p in (self.weight, self.bias, self.running_mean, self.running_var, self.num_batches) if p is not None
        ]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        m = self.first
        xf = to_fold(x, self.in_layout, self.n, self.in_shape, 1)
        grad = _grad()
        # As _BatchNorm.forward, for N members at once.
        factor = 0.0 if m.momentum is None else m.momentum
        if m.training and m.track_running_stats and self.num_batches is not None:
            self.num_batches.value(False).add_(1)
            factor = m.momentum  # momentum=None groups are never fused
        use_batch = m.training or (self.running_mean is None and self.running_var is None)
        track = not m.training or m.track_running_stats
        rm = self.running_mean.value(False).view(-1) if (self.running_mean is not None and track) else None
        rv = self.running_var.value(False).view(-1) if (self.running_var is not None and track) else None
        w = self.weight.value(grad).reshape(-1) if self.weight is not None else None
        b = self.bias.value(grad).reshape(-1) if self.bias is not None else None
        return F.batch_norm(xf, rm, rv, w, b, use_batch, factor, m.eps)


class LayerNormKernel(FusedKernel):
    kind = "LayerNorm"
    kernel = "layer_norm + stacked affine"

    def __init__(
        self,
        members: Sequence[nn.LayerNorm],
        names: Sequence[str],
        weight: Optional[StackedTensors],
        bias: Optional[StackedTensors],
        in_layout: Layout,
        in_shape: tuple[int, ...],
    ):
        super().__init__(len(members), names, STACK, in_shape)
        m = members[0]
        self.normalized_shape = tuple(m.normalized_shape)
        self.eps = m.eps
        self.weight, self.bias = weight, bias
        self.in_layout = in_layout
        self.in_shape = tuple(in_shape)
        # Affine parameters broadcast over the member's leading dims.
        lead = len(in_shape) - len(self.normalized_shape)
        self.affine_shape = (len(members),) + (1,) * lead + self.normalized_shape

    @property
    def params(self) -> list[StackedTensors]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        xs = to_stack(x, self.in_layout, self.n, self.in_shape)
        # layer_norm computes a half-precision input in float32, affine included, and
        # rounds once (also with float32 weights: a bf16 activation under autocast meets
        # a float32 LayerNorm). Normalising and scaling in the input's dtype would round
        # three times, and a float32 weight would promote the result to float32.
        compute = torch.float32 if xs.dtype in (torch.float16, torch.bfloat16) else xs.dtype
        y = F.layer_norm(xs.to(compute), self.normalized_shape, None, None, self.eps)
        grad = _grad()
        if self.weight is not None:
            y = y * self.weight.value(grad).view(self.affine_shape).to(compute)
        if self.bias is not None:
            y = y + self.bias.value(grad).view(self.affine_shape).to(compute)
        # What the members return: the input's dtype, or float32 where autocast runs
        # layer_norm in float32 (CUDA).
        return y.to(self.out_dtype or xs.dtype)


class ElementwiseKernel(FusedKernel):
    """An elementwise op (module or function) applied once to the whole stacked tensor.

    ``operands`` describes each positional argument: ``("t", layout, member_shape)`` for
    a grouped tensor (stacked or shared) or ``("c", value)`` for a constant. When every
    tensor operand is in one layout with the same shape the op runs on it as is;
    otherwise operands are brought to ``STACK`` with member dims aligned for
    broadcasting.
    """

    kind = "elementwise"

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        names: Sequence[str],
        n: int,
        operands: Sequence[tuple],
        kwargs: dict,
        out_shape: tuple[int, ...],
        random: bool,
    ):
        self.fn = fn
        self.kind = name
        self.operands = list(operands)
        self.kwargs = dict(kwargs)
        tensor_ops = [op for op in operands if op[0] == "t"]
        layouts = {op[1] for op in tensor_ops}
        shapes = {tuple(op[2]) for op in tensor_ops}
        self.direct = len(layouts) == 1 and len(shapes) == 1 and not (random and SHARED in layouts)
        out_layout = next(iter(layouts)) if self.direct else STACK
        self.kernel = f"{name} once" if self.direct else f"{name} on stacked"
        super().__init__(n, names, out_layout, out_shape)
        self.ndim = len(out_shape)

    def run(self, *tensors: torch.Tensor) -> torch.Tensor:
        it = iter(tensors)
        args = []
        for op in self.operands:
            if op[0] == "c":
                args.append(op[1])
            elif self.direct:
                args.append(next(it))
            else:
                args.append(aligned_stack(next(it), op[1], self.n, tuple(op[2]), self.ndim))
        return self.fn(*args, **self.kwargs)

    def specialise(self, private: bool = False) -> Callable[..., torch.Tensor]:
        """One tensor operand, nothing else, in its own layout (a fused activation): the
        op itself, an activation module's functional where that is exactly its forward
        (no module ``__call__``), and for ReLU on a ``private`` input (fresh, no other
        reader) ``relu_``, as eager ``nn.ReLU(inplace=True)``: ReLU's backward reads its
        result, never its input, so the result and the gradients are the same. Operands
        with constants or of several layouts keep :meth:`run`."""
        ops = self.operands
        if not (self.direct and len(ops) == 1 and ops[0][0] == "t" and not self.kwargs):
            return self.run
        fn = self.fn
        if private and _is_relu(fn):
            return torch.relu_
        return _functional(fn)


_RELU_FUNCTIONS = (torch.relu, F.relu, torch.Tensor.relu, torch.relu_, torch.Tensor.relu_)


def _plain_module(fn: Any, cls: type) -> bool:
    """``fn`` is a module of exactly ``cls`` whose forward is the class's own and that
    has no hooks of its own (so calling it is calling ``cls.forward``)."""
    return (
        type(fn) is cls
        and "forward" not in fn.__dict__
        and not (fn._forward_hooks or fn._forward_pre_hooks or fn._backward_hooks or fn._backward_pre_hooks)
    )


def _is_relu(fn: Any) -> bool:
    """Whether ``fn(x)`` is ReLU of ``x`` (in place or not)."""
    return any(fn is f for f in _RELU_FUNCTIONS) or _plain_module(fn, nn.ReLU)


def _functional(fn: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` (an elementwise op or activation module) as the function its forward calls,
    reading the module's options at call time as its forward does. Anything else (other
    modules, a module with hooks: those fire through its ``__call__``) is ``fn`` itself.
    Global module hooks never reach here: a model with one runs as written."""
    if not isinstance(fn, nn.Module):
        return fn
    m = fn
    if _plain_module(m, nn.ReLU):
        relu, relu_ = torch.relu, torch.relu_

        def relu_module(x: torch.Tensor) -> torch.Tensor:  # ReLU.forward: F.relu(x, inplace=self.inplace)
            return relu_(x) if m.inplace else relu(x)

        return relu_module
    if _plain_module(m, nn.Tanh):
        return torch.tanh
    if _plain_module(m, nn.Sigmoid):
        return torch.sigmoid
    if _plain_module(m, nn.GELU):
        gelu = F.gelu

        def gelu_module(x: torch.Tensor) -> torch.Tensor:  # GELU.forward
            return gelu(x, approximate=m.approximate)

        return gelu_module
    return m


_TABLES = frozenset({"_parameters", "_buffers", "_modules", "forward"})


def _is_compiled(m: nn.Module) -> bool:
    """``torch.compile``'s module wrapper (read by name: importing dynamo costs a second)."""
    return any(c.__name__ == "OptimizedModule" and c.__module__.startswith("torch._dynamo") for c in type(m).__mro__)


def private_template(module: nn.Module) -> tuple[nn.Module, Callable[[], None]]:
    """A stand-in of ``module`` for ``torch.func.functional_call`` to swap tensors into,
    and a function that refreshes it. The stand-in has parameter, buffer and child tables
    of its own (its children stand-ins in turn) and, after each refresh, every other
    attribute of the module (``training``, ``eps``, flags set since).

    functional_call puts the tensors it is given into the module's tables for the length
    of the call and puts the old ones back after. Run on the member itself, a vmap
    kernel left the member holding vmap-batched tensors meanwhile: a call of that module
    on another lane saw them, and two kernels with the same first member (one module
    called on several inputs, as a detection head on each feature level) running at
    once put back each other's, leaving the module holding tensors escaped from vmap
    (``state_dict()`` then raised)."""
    pairs: list[tuple[nn.Module, nn.Module]] = []

    def stand_in(m: nn.Module) -> nn.Module:
        shadow = object.__new__(type(m))
        d = shadow.__dict__
        d.update((k, v) for k, v in m.__dict__.items() if k not in _TABLES)
        d["_parameters"] = dict(m._parameters)
        d["_buffers"] = dict(m._buffers)
        d["_modules"] = {k: (stand_in(c) if c is not None else None) for k, c in m._modules.items()}
        if "forward" in m.__dict__ and _is_compiled(m):
            # torch.compile's wrapper calls its compiled original (an instance
            # ``forward``): the stand-in calls the stand-in of that original.
            d["forward"] = d["_modules"]["_orig_mod"].__call__
        pairs.append((shadow, m))
        return shadow

    template = stand_in(module)

    def refresh() -> None:
        for shadow, m in pairs:
            d = shadow.__dict__
            for k, v in m.__dict__.items():
                if k not in _TABLES:
                    d[k] = v

    return template, refresh


class VmapKernel(FusedKernel):
    """Any module type: ``torch.func.vmap`` over ``functional_call`` with stacked weights."""

    kernel = "vmap(functional_call)"

    def __init__(
        self,
        members: Sequence[nn.Module],
        names: Sequence[str],
        params: dict[str, StackedTensors],
        buffers: dict[str, StackedTensors],
        inputs: Sequence[tuple[Layout, tuple[int, ...]]],
        kwargs: dict,
        out_shape: tuple[int, ...],
    ):
        self.kind = type(members[0]).__name__
        super().__init__(len(members), names, STACK, out_shape)
        # functional_call swaps the stacked (vmap-batched) tensors into the module it
        # runs: a stand-in of the first member, never the member itself (module.py).
        self.template, self._attributes = private_template(members[0])
        self.param_stacks = params
        self.buffer_stacks = buffers
        self.inputs = list(inputs)
        self.kwargs = dict(kwargs)
        in_dims = tuple(None if layout == SHARED else 0 for layout, _ in self.inputs)
        template = self.template
        kw = self.kwargs

        def member_forward(p: dict, b: dict, *xs: torch.Tensor) -> torch.Tensor:
            return torch.func.functional_call(template, (p, b), xs, kw)

        self._vmapped = torch.func.vmap(member_forward, in_dims=(0, 0) + in_dims, randomness="different")

    @property
    def params(self) -> list[StackedTensors]:
        return list(self.param_stacks.values()) + list(self.buffer_stacks.values())

    def run(self, *xs: torch.Tensor) -> torch.Tensor:
        self._attributes()
        grad = _grad()
        p = {k: v.value(grad) for k, v in self.param_stacks.items()}
        b = {k: v.value(False) for k, v in self.buffer_stacks.items()}
        args = [
            x if layout == SHARED else to_stack(x, layout, self.n, shape) for x, (layout, shape) in zip(xs, self.inputs)
        ]
        return self._vmapped(p, b, *args)


class WideKernel(FusedKernel):
    """Members of different output widths reading one tensor (multi-task heads, the
    1x1 convolutions of an Inception block): one op on concatenated weights. Its output
    holds the members' outputs side by side along ``split_dim`` (layout ``("split", d)``)."""

    def __init__(
        self,
        members: Sequence[nn.Module],
        names: Sequence[str],
        weight: StackedTensors,
        bias: Optional[StackedTensors],
        sizes: Sequence[int],
        split_dim: int,
        out_shape: tuple[int, ...],
    ):
        m = members[0]
        self.kind = type(m).__name__
        self.kernel = f"wide {self.kind} (concatenated weights)"
        super().__init__(len(members), names, ("split", split_dim), out_shape)
        self.weight, self.bias = weight, bias
        self.sizes = list(sizes)
        self.split_dim = split_dim
        if isinstance(m, nn.Linear):
            self.fn = F.linear
        else:
            nd = len(m.kernel_size)
            conv = _CONV[nd]
            stride, padding, dilation, groups = m.stride, m.padding, m.dilation, m.groups
            self.fn = lambda x, w, b: conv(x, w, b, stride, padding, dilation, groups)

    @property
    def params(self) -> list[StackedTensors]:
        return [p for p in (self.weight, self.bias) if p is not None]

    def run(self, x: torch.Tensor) -> torch.Tensor:
        # The whole output: a cat of all members along split_dim is this tensor itself;
        # other consumers read torch.split(...) views of it.
        grad = _grad()
        w = self.weight.value(grad)
        b = self.bias.value(grad) if self.bias is not None else None
        return self.fn(x, w, b)
