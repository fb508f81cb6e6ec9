"""Horizontal fusion: run structurally identical independent nodes as one batched node.

Two phases, as in ``torch.fx``'s partitioner: *propose* groups, then *rewrite*. The
modules named below are submodules of this package (``streamsched.passes.fusion``).

**Propose** (``propose``). A node is a candidate when it is a module call of a kind with
a batched kernel (Linear, Conv, BatchNorm, LayerNorm, elementwise activations and
dropout, or any module ``vmap`` can batch) or an elementwise function. Candidates are
bucketed by *signature* (module type and configuration, parameter and buffer shapes and
dtypes, input shapes, constant arguments, train/eval) and by *level* (longest path from
the inputs). Nodes on one level never depend on each other, and contracting same-level
nodes cannot create a cycle, so every bucket of at least ``fuse_min_size`` nodes is a
valid group. Linear/Conv nodes that read the *same* tensor with *different* output
widths (multi-task heads, Inception's 1x1 convolutions) form a "wide" group first.

**Rewrite** (``builders``, ``rewrite``). Each group becomes one node calling a kernel
from ``kernels``, built by its kind's builder. Its inputs are found, in order of
preference, as: the output of an earlier group (stays in that group's layout, no
unstacking between layers), one tensor all members read (``SHARED``), equal consecutive
slices of one tensor (``x[:, 20*i : 20*(i+1)]``, ``split``/``chunk``/``unbind`` parts: a
view), and only as a last resort a ``torch.stack`` of the members' inputs. A
``torch.cat`` / ``torch.stack`` of a whole group's outputs in order becomes a reshape of
the stacked output; any other consumer reads a view from one ``unbind``.

The pass never fuses a module with hooks (they must fire per member), a BatchNorm
with ``momentum=None``, or an in-place op whose input anyone else could observe; each
such decision is logged at debug level and listed in the plan (``Plan.unfused``).
``fuse`` runs the two phases (:func:`fuse_graph`).

What the fused graph runs with: ``kernels`` (the batched kernels), ``layout`` (how N
members share one tensor), ``params`` (the members' parameters aliased into one stacked
tensor, kept the truth), ``stacked`` (one leaf parameter per group, for
``fused_parameters()``), and :class:`FusionContext` (``context``), which owns all of that
for one model across its plans. ``report`` holds the records the plan shows
(:class:`FusedGroupInfo`, :class:`UnfusedGroup`).
"""

from __future__ import annotations

from .context import FusionContext
from .fuse import FuseResult, fuse_graph
from .kernels import FusedKernel
from .params import GatherStacked, StackedTensors
from .report import FusedGroupInfo, UnfusedGroup
from .stacked import StackedLayoutError, StackedParameter, layout_version, stacked_owner

__all__ = [
    "FusionContext",
    "fuse_graph",
    "FuseResult",
    "FusedKernel",
    "StackedTensors",
    "GatherStacked",
    "StackedParameter",
    "StackedLayoutError",
    "stacked_owner",
    "layout_version",
    "FusedGroupInfo",
    "UnfusedGroup",
]
