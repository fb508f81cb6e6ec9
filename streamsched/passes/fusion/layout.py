"""How the N members of a fused group are laid out in one tensor.

Four layouts, each a small tuple so it can be a constant in generated code:

- ``STACK = ("stack", 0)``: ``[N, *member_shape]``; what ``bmm`` and ``vmap`` want.
- ``fold(d) = ("fold", d)``: the member axis merged into dim ``d``, member-major:
  ``member_shape[:d] + (N * member_shape[d],) + member_shape[d+1:]``. This is what a
  grouped convolution reads and writes (``[B, N*C, H, W]``), what a wide linear
  produces (``[B, N*out]``), and what ``x[:, 20*i : 20*(i+1)]`` slices of one tensor
  already are. Conv -> BatchNorm -> ReLU chains stay in it with no copies.
- ``SHARED = ("shared", 0)``: every member reads the same tensor (of ``member_shape``).
- ``TRANSPOSED = ("transposed", 0)``: 2-d members (``[rows, features]``), each stored
  transposed: ``[N, features, rows]``. On the CPU a chain of fused Linears runs in it
  with no transposed operand: ``W @ x`` over ``[N, out, in]`` weight stacks and
  ``[N, in, rows]`` activations; ATen's CPU batched matmul runs slower with an operand
  that is a transposed view (the stacked ``xs @ W^T``: 1.5x the time for 32 critics'
  64 -> 64 layer at 16 rows). Chosen by the Linear builder only (see
  ``builders.transposed_output``).

Conversions are views where the memory allows, copies otherwise.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

__all__ = ["STACK", "SHARED", "TRANSPOSED", "fold", "to_stack", "to_fold", "aligned_stack", "Layout"]

Layout = Tuple[str, int]
STACK: Layout = ("stack", 0)
SHARED: Layout = ("shared", 0)
TRANSPOSED: Layout = ("transposed", 0)


def fold(dim: int) -> Layout:
    return ("fold", dim)


def to_stack(x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``[N, *shape]`` from any layout (a view unless the memory forbids it)."""
    kind, d = layout
    if kind == "stack":
        return x
    if kind == "fold":
        split = shape[:d] + (n, shape[d]) + shape[d + 1 :]
        return x.reshape(split).movedim(d, 0)
    if kind == "transposed":
        if shape[1] == 1 and x.is_contiguous():
            # One feature: [N, 1, rows] is the stack's own memory; viewed as the stack,
            # with the strides torch.stack gives ([rows, 1, 1], not [rows, 1, rows]).
            return x.view((n,) + tuple(shape))
        return x.transpose(1, 2)
    return x.expand((n,) + tuple(shape))


def transposer(layout: Layout, n: int, shape: tuple[int, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function that reads a value of ``layout`` as ``[N, shape[1], shape[0]]`` (2-d
    members), chosen once for a kernel: a ``TRANSPOSED`` value as it is, a stack or a
    fold of the features as one view, anything else as a view of its stack where the
    memory allows."""
    if layout == TRANSPOSED:
        return _as_is
    if layout == STACK:
        return _swap_last_two
    rows, features = shape
    if layout == ("fold", 1):  # [rows, N * features]

        def fold_transposed(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(rows, n, features).permute(1, 2, 0)

        return fold_transposed

    def transposed(x: torch.Tensor) -> torch.Tensor:
        return to_stack(x, layout, n, shape).transpose(1, 2)

    return transposed


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _swap_last_two(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def to_fold(x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """The member axis merged into ``dim`` (member-major)."""
    if layout == ("fold", dim):
        return x
    s = to_stack(x, layout, n, shape).movedim(0, dim)
    return s.reshape(shape[:dim] + (n * shape[dim],) + shape[dim + 1 :])


def aligned_stack(x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], ndim: int) -> torch.Tensor:
    """``[N, 1, ..., *shape]`` with member dims padded on the left to ``ndim``, so that
    member-wise broadcasting still lines up once the member axis is in front."""
    s = to_stack(x, layout, n, shape)
    pad = ndim - len(shape)
    if pad > 0:
        s = s.reshape((n,) + (1,) * pad + tuple(shape))
    return s


def unstack(
    x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], use: Any = None
) -> tuple[torch.Tensor, ...]:
    """The N member values (views). ``use``: a
    :class:`~streamsched.passes.fusion.member_use.MemberUse` that records which of them a
    backward reaches."""
    parts = to_stack(x, layout, n, shape).unbind(0)
    if use is not None:
        use.watch(parts[0])
    return parts


def member_copy(parts: tuple[torch.Tensor, ...], index: int) -> torch.Tensor:
    """Member ``index``'s value (of its group's ``unstack`` / ``split`` parts) in storage of
    its own, for a consumer that writes it in place, or the caller, who may. A view would
    not do under autograd: the views of one ``unbind`` may not be written at all, and
    writing a ``select`` view moves the version counter that every other member's view
    shares, failing the backward of whatever saved one of them. Copied from the parts
    every other member reads, so that one autograd node hands out every member's value
    (see :mod:`streamsched.passes.fusion.member_use`)."""
    part = parts[index]
    return part.clone(memory_format=_eager_format(part))


def for_caller(x: torch.Tensor) -> torch.Tensor:
    """A fused group's value the graph returns (a member's part, a whole group's stack or
    cat), as eager's is: a tensor of its own, in storage of its own, which the caller may
    write in place, resize or hand on. With autograd on, a copy (eager's ``cat`` /
    ``stack`` is a copy too): the kernel's output, or a view of it, is what its last op
    may have saved for the backward (a ``Tanh``'s or ``ReLU``'s result), and the caller's
    write failed that backward. Without autograd, the same memory made no view where that
    memory is the value's alone (a view made under ``no_grad`` may not be written once
    gradients are on, "A view was created in no_grad mode", and eager's value may be);
    a member's part, one slice of its group's storage, is copied: every sibling shares
    that storage, so ``resize_``, an ``out=`` that resizes it, ``set_`` on its storage
    or ``untyped_storage().resize_(0)`` reached the other members' values, which eager's
    separate outputs never share."""
    if x.requires_grad or not _owns_storage(x):
        return x.clone()
    return x.detach() if x._is_view() else x


def _owns_storage(x: torch.Tensor) -> bool:
    """Whether ``x`` spans its whole storage (nothing else can be a slice of it); ``False``
    for a tensor without storage of its own to ask (torch.func's batched tensors, wrapper
    subclasses): copied, then."""
    try:
        return x.storage_offset() == 0 and x.untyped_storage().nbytes() == x.numel() * x.element_size()
    except (NotImplementedError, RuntimeError):
        return False


def eager_strides(x: torch.Tensor) -> torch.Tensor:
    """A member's part of its group's output with the strides eager's own value has: the
    part itself when dense (a slice of a stack), else a copy laid out as its strides
    suggest (contiguous, or channels_last after a channels_last convolution): a ``view``
    of it then works where eager's works."""
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x
    return x.clone(memory_format=_eager_format(x))


def _eager_format(x: torch.Tensor) -> torch.memory_format:
    """How a copy of a member's part is laid out to have eager's strides: contiguous for
    fewer than 4 dims (a part of a ``TRANSPOSED`` group is dense but transposed, which
    ``preserve_format`` would keep), else as its strides suggest (channels_last after a
    channels_last convolution)."""
    return torch.contiguous_format if x.dim() < 4 else torch.preserve_format


def cat_members(x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """``torch.cat(members, dim)`` without unstacking; contiguous like ``cat``'s result."""
    dim = dim % len(shape)
    return to_fold(x, layout, n, shape, dim).contiguous()


def stack_members(x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """``torch.stack(members, dim)`` without unstacking; contiguous like ``stack``'s result."""
    dim = dim % (len(shape) + 1)
    return to_stack(x, layout, n, shape).movedim(0, dim).contiguous()


def select_members(
    x: torch.Tensor, layout: Layout, n: int, shape: tuple[int, ...], index: torch.Tensor
) -> torch.Tensor:
    """Some members, in another order: ``STACK`` layout ``[len(index), *shape]``."""
    return to_stack(x, layout, n, shape).index_select(0, _index_on(index, x.device))


def _index_on(index: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``index`` (a host tensor baked into the plan) on ``device``, copied on first use only:
    a host-to-device copy in every call synchronises the stream, which CUDA graph capture
    forbids."""
    if index.device == device:
        return index
    copies = index.__dict__.setdefault("_ss_on_device", {})
    on_device = copies.get(device)
    if on_device is None:
        on_device = copies[device] = index.to(device)
    return on_device


def _stack_gather(layout: Layout, n: int, shape: tuple[int, ...], dim: int, fresh: bool) -> Callable:
    dim = dim % (len(shape) + 1)
    if layout == STACK and dim == 0:
        # A kernel's own result nobody else reads, already [N, *shape]: contiguous() is
        # all stack_members does to it (the same tensor when contiguous, as a fresh
        # torch.stack would be, a copy otherwise). Anything else keeps its view.
        return torch.Tensor.contiguous if fresh else lambda x: x.movedim(0, 0).contiguous()
    if layout == TRANSPOSED and dim == 0 and shape[1] == 1:
        # One feature: [N, 1, rows] is the stack's memory, one view where it is contiguous
        # (what reads a transposed group of more features is a fused Linear).
        size = (n,) + tuple(shape)

        def stack_one_feature(x: torch.Tensor) -> torch.Tensor:
            return x.view(size) if x.is_contiguous() else x.transpose(1, 2).contiguous()

        if not fresh:
            return stack_one_feature
        # The kernel's own result, read by nothing else: restrided in place, it is the
        # stack itself rather than a view of it (a view costs a microsecond, and the
        # caller's copy of it, for_caller, another). A value that takes a gradient is
        # viewed (autograd must see the view).
        stride = (shape[0], 1, 1)

        def restride_one_feature(x: torch.Tensor) -> torch.Tensor:
            if x.requires_grad or not x.is_contiguous():
                return stack_one_feature(x)
            return x.as_strided_(size, stride)

        return restride_one_feature

    def stack(x: torch.Tensor) -> torch.Tensor:
        return to_stack(x, layout, n, shape).movedim(0, dim).contiguous()

    return stack


def _cat_gather(layout: Layout, n: int, shape: tuple[int, ...], dim: int, fresh: bool) -> Callable:
    dim = dim % len(shape)
    if layout == ("fold", dim):
        return torch.Tensor.contiguous  # to_fold is the tensor itself
    if layout == STACK:
        folded = shape[:dim] + (n * shape[dim],) + shape[dim + 1 :]

        def cat_stacked(x: torch.Tensor) -> torch.Tensor:  # to_fold of a stack, then contiguous
            return x.movedim(0, dim).reshape(folded).contiguous()

        return cat_stacked

    def cat(x: torch.Tensor) -> torch.Tensor:
        return to_fold(x, layout, n, shape, dim).contiguous()

    return cat


_GATHERS: dict[Callable, Callable[..., Callable]] = {stack_members: _stack_gather, cat_members: _cat_gather}


def specialise_gather(fn: Any, args: tuple, fresh: bool) -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """``lambda x: fn(x, *args)`` for :func:`stack_members` / :func:`cat_members` with
    constant layout arguments ``args``, the layout's branches taken once; ``None`` for any
    other function. ``fresh``: ``x`` is a kernel's own result that nothing else reads."""
    try:
        build = _GATHERS.get(fn)
    except TypeError:  # an unhashable target
        return None
    if build is None or len(args) != 4:
        return None
    layout, n, shape, dim = args
    if not (isinstance(layout, tuple) and isinstance(n, int) and isinstance(shape, tuple) and isinstance(dim, int)):
        return None
    return build(layout, n, tuple(shape), dim, fresh)
