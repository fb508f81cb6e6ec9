"""Recognising the members' inputs as parts of one tensor, so a group reads a view.

Models written as loops over branches often feed branch ``i`` a slice of one tensor
(``x[:, 20*i : 20*(i+1)]``), a part of a ``split``/``chunk``, or item ``i`` of an
``unbind``. When the members' inputs are all the parts of one tensor, in order, the fused
node can read that tensor itself (or one narrow of it) in a ``fold`` or ``STACK`` layout
instead of copying the parts together with ``torch.stack``. These are pure functions of
the graph and its value metadata; :meth:`Rewriter.source
<streamsched.passes.fusion.rewrite.Rewriter.source>` uses them.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

from torch import fx

from ...frontend.meta import TensorMeta, ValueMeta

__all__ = ["consecutive_slices", "unbound_parts"]


def consecutive_slices(args: list[fx.Node], metas: dict[fx.Node, ValueMeta]) -> Optional[tuple[fx.Node, int, int, int]]:
    """``(base, dim, start, width)`` when ``args`` are equal, consecutive, in-order
    slices of one tensor along one dim."""
    parts = []
    for a in args:
        info = _slice_of(a, metas)
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


def _slice_of(node: fx.Node, metas: dict[fx.Node, ValueMeta]) -> Optional[tuple[fx.Node, int, int, int]]:
    """``(base, dim, start, stop)`` when ``node`` is a plain slice of one dim of base."""
    if node.op != "call_function" or node.target is not operator.getitem:
        return None
    base, index = node.args
    if not isinstance(base, fx.Node):
        return None
    base_meta = metas.get(base)
    if isinstance(base_meta, tuple):
        return _split_part(base, index, metas)
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


def _split_part(split: fx.Node, index: Any, metas: dict[fx.Node, ValueMeta]) -> Optional[tuple[fx.Node, int, int, int]]:
    """Part ``index`` of ``split``/``chunk`` as a slice of the split tensor."""
    if not isinstance(index, int):
        return None
    name = split.target if split.op == "call_method" else getattr(split.target, "__name__", "")
    if name not in ("split", "chunk"):
        return None
    src = split.args[0]
    if not isinstance(src, fx.Node):
        return None
    # split(x, size, dim) and chunk(x, n, dim) both take the dim third.
    dim = split.kwargs.get("dim", split.args[2] if len(split.args) > 2 else 0)
    parts = metas.get(split)
    src_meta = metas.get(src)
    if not isinstance(parts, tuple) or not isinstance(src_meta, TensorMeta) or not isinstance(dim, int):
        return None
    dim = dim % len(src_meta.shape)
    sizes = [p.shape[dim] for p in parts if isinstance(p, TensorMeta)]
    if len(sizes) != len(parts):
        return None
    start = sum(sizes[:index])
    return src, dim, start, start + sizes[index]


def unbound_parts(args: list[fx.Node], metas: dict[fx.Node, ValueMeta]) -> Optional[tuple[fx.Node, int]]:
    """``(base, dim)`` when ``args`` are all the parts of one ``unbind``, in order."""
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
    parts = metas.get(ub)
    if not isinstance(parts, tuple) or len(parts) != len(args):
        return None
    dim = ub.kwargs.get("dim", ub.args[1] if len(ub.args) > 1 else 0)
    src_meta = metas.get(ub.args[0])
    if not isinstance(src_meta, TensorMeta):
        return None
    return ub.args[0], dim % len(src_meta.shape)
