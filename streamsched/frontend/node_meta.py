"""Every key streamsched keeps in an fx node's ``meta``, with a getter and a setter per key.

Passes hand facts about a node to later passes through ``node.meta``; these accessors are
the only code that reads or writes those entries, so each key has one name and one type,
and the writers and readers of each are found by its accessor's name (docs/design.md,
"What a node carries in its meta"):

- ``streamsched_relied_rank``: written by tracing (``rank_checks.rely_on``), read by the
  recording call (``frontend.meta``, through ``rank_checks.check_relied``).
- ``streamsched_leaf_calls``: written by the recording call (``leafcalls.store_counts``),
  read by ``leafcalls`` (``traced_coverage``, ``opaque_leaf_calls``).
- ``streamsched_effect``: written by planning (``planning.planner``), read by fusion
  (``passes.fusion.propose``).
- ``streamsched_output_written``: written by planning (``planning.planner``), read by
  fusion (``passes.fusion.rewrite``).
- ``streamsched_label``: written by fusion (``rewrite``), read by ``frontend.nodes.node_label``.
- ``streamsched_glue``: written by fusion (``rewrite``), read by ``frontend.nodes.is_glue``
  and fusion (``rewrite``).
- ``streamsched_cost_us``: written by fusion (``rewrite``), read by
  ``ir.cost.estimate_node_cost`` and fusion (``rewrite``).

The keys themselves are unchanged strings, so a graph printed with its meta reads as before.
"""

from __future__ import annotations

from typing import Any, Optional

from torch import fx

__all__ = [
    "RELIED_RANK",
    "LEAF_CALLS",
    "EFFECT",
    "OUTPUT_WRITTEN",
    "LABEL",
    "GLUE",
    "COST_US",
    "relied",
    "note_relied",
    "leaf_calls",
    "set_leaf_calls",
    "has_effect",
    "set_effect",
    "effect_after",
    "set_effect_after",
    "output_written",
    "set_output_written",
    "fused_label",
    "set_fused_label",
    "is_inserted_glue",
    "set_inserted_glue",
    "fixed_cost_us",
    "set_fixed_cost_us",
]

RELIED_RANK = "streamsched_relied_rank"
LEAF_CALLS = "streamsched_leaf_calls"
EFFECT = "streamsched_effect"
WRITES_PARAMETER = "streamsched_writes_parameter"
EFFECT_AFTER = "streamsched_effect_after"
OUTPUT_WRITTEN = "streamsched_output_written"
LABEL = "streamsched_label"
GLUE = "streamsched_glue"
MEMBER_STACK = "streamsched_member_stack"
COST_US = "streamsched_cost_us"


# Tracing: the rank, length or dtype of this node's value the trace relied on, by kind.
def relied(node: fx.Node) -> Optional[dict[str, Any]]:
    """What the trace relied on about ``node``'s value (``{"rank": 4}``), or None."""
    return node.meta.get(RELIED_RANK)


def note_relied(node: fx.Node, kind: str, number: Any) -> None:
    node.meta.setdefault(RELIED_RANK, {})[kind] = number


# The recording call: how many leaf module calls ran inside this node.
def leaf_calls(node: fx.Node) -> int:
    return node.meta.get(LEAF_CALLS, 0)


def set_leaf_calls(node: fx.Node, count: int) -> None:
    node.meta[LEAF_CALLS] = count


# Planning, for fusion: the node writes a storage another node reads or writes (or reads
# one written in place), so it keeps its place in eager order.
def has_effect(node: fx.Node) -> bool:
    return bool(node.meta.get(EFFECT))


def set_effect(node: fx.Node) -> None:
    node.meta[EFFECT] = True


# Planning, for fusion: the node writes a parameter of the model in place (``Effects.
# parameter_writers``): a fused member's parameter is a view of its group's stack, which
# autograd refuses to see written.
def writes_parameter(node: fx.Node) -> bool:
    return bool(node.meta.get(WRITES_PARAMETER))


def set_writes_parameter(node: fx.Node) -> None:
    node.meta[WRITES_PARAMETER] = True


# Planning, for fusion: the names of the nodes this one must follow beyond its data
# inputs (the recording's effect edges: a shared storage written, a random draw).
def effect_after(node: fx.Node) -> tuple[str, ...]:
    return node.meta.get(EFFECT_AFTER, ())


def set_effect_after(node: fx.Node, names: tuple[str, ...]) -> None:
    node.meta[EFFECT_AFTER] = names


# Planning, for fusion: something writes this node's output in place.
def output_written(node: fx.Node) -> bool:
    return bool(node.meta.get(OUTPUT_WRITTEN))


def set_output_written(node: fx.Node) -> None:
    node.meta[OUTPUT_WRITTEN] = True


# Fusion: the name users see for a fused node (``node_label`` returns it).
def fused_label(node: fx.Node) -> Optional[str]:
    return node.meta.get(LABEL)


def set_fused_label(node: fx.Node, label: str) -> None:
    node.meta[LABEL] = label


# Fusion: a node fusion inserted that only views or unpacks values (``is_glue``).
def is_inserted_glue(node: fx.Node) -> bool:
    return bool(node.meta.get(GLUE))


def set_inserted_glue(node: fx.Node) -> None:
    node.meta[GLUE] = True


# Fusion: a ``torch.stack`` of a group's members' inputs, in member order, that fusion
# inserted (the source of last resort), which member tracking may gate.
def is_member_stack(node: fx.Node) -> bool:
    return bool(node.meta.get(MEMBER_STACK))


def set_member_stack(node: fx.Node) -> None:
    node.meta[MEMBER_STACK] = True


# Fusion: a fused node's estimated cost, which the cost model takes instead of its own.
def fixed_cost_us(node: fx.Node) -> Optional[float]:
    value = node.meta.get(COST_US)
    return None if value is None else float(value)


def set_fixed_cost_us(node: fx.Node, cost_us: float) -> None:
    node.meta[COST_US] = cost_us
