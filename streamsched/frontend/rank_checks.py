"""What the trace baked in from ranks, checked on the recording call.

Where the tracer answers ``x.dim()``, ``len(x.shape)`` or iterates ``x.shape[:-1]`` from
the ranks it tracks (``frontend.ranks``), the answer becomes part of the graph: a view
to ``(*x.shape[:-1], 2, -1)`` has as many size arguments as the rank said. A rank rule
that is wrong for some operation would make a graph that computes something else, and
the recording call returns what the graph computes. So each value whose rank, length or
dtype (``x.dtype`` answered: ``torch.finfo(x.dtype)``, ``if x.dtype == ...``) the trace
relied on is marked on its node (:func:`rely_on`), and the recording call
(``frontend.meta``) compares the mark with the real value as soon as the node has run
(:func:`check_relied`): a difference raises :class:`RankAssumptionError`, naming the node
and both figures, before any result is returned. A trace is made per rank and dtype of
every input, and each new size of a signature is recorded before it is planned, so every
graph the wrapper runs was checked on a call of its own sizes. What the marks rest on
beyond the inputs (a parameter's dtype, a rule for an opaque call's output) is checked on
every call besides (``frontend.ranks``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from ..errors import TraceError
from . import node_meta

__all__ = ["rely_on", "check_relied", "real_of", "RankAssumptionError", "RELIED"]

# node.meta key: {"rank" | "length" | "dtype": what the trace used}
RELIED = node_meta.RELIED_RANK


class RankAssumptionError(RuntimeError):
    """A rank (or a length, or a dtype) the trace was made with differs from the real
    value's: the graph would not compute what the model does."""


def rely_on(node: fx.Node, kind: str, number: Any) -> None:
    """Mark that the trace used ``node``'s rank (``kind="rank"``), length (``"length"``)
    or dtype (``"dtype"``)."""
    node_meta.note_relied(node, kind, number)


def real_of(kind: str, value: Any) -> Any:
    """The rank, length or dtype of ``value`` (``None`` where it has none), or its class
    (``"class"``)."""
    if kind == "class":
        return type(value)
    if kind == "rank":
        return value.dim() if isinstance(value, torch.Tensor) else None
    if kind == "dtype":
        return value.dtype if isinstance(value, torch.Tensor) else None
    return len(value) if isinstance(value, (tuple, list, torch.Size)) else None


def check_relied(node: fx.Node, value: Any) -> None:
    """Raise if ``value``, the real value of ``node``, is not what the trace relied on."""
    for kind, number in (node_meta.relied(node) or {}).items():
        real = real_of(kind, value)
        if real is not number and kind == "class":
            # The model's code tested the value's type: the trace's path is not the
            # model's, and the call runs as written (``new_signatures``).
            raise TraceError(
                f"the forward tested the type of '{node.name}' ({node.format_node()}), taken for "
                f"{number.__name__} while tracing, but the call gave {type(value).__name__}"
            )
        if real != number:
            raise RankAssumptionError(
                f"streamsched traced '{node.name}' ({node.format_node()}) assuming its {kind} is {number}, "
                f"but the call gave {real if real is not None else type(value).__name__}: the traced graph would "
                "not compute what the model does, so the call is refused. This is a gap in streamsched's rank and "
                "dtype rules (frontend/ranks.py): please report it; meanwhile, listing the module that computes "
                "this value in leaf_modules keeps it out of the trace"
            )
