"""The pass itself: propose groups, build each group's kernel, rewrite the graph.

A group whose kernel cannot (or should not) be built is left as it was, and the
plan says why (:class:`~streamsched.passes.fusion.report.UnfusedGroup`); nothing a failed
group inserted stays in the graph.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from torch import fx, nn

from ...frontend.meta import ValueMeta
from ...frontend.nodes import node_label, submodule, target_name
from ...frontend.trace_guard import autocast_state
from ...ir.cost import DeviceModel
from .builders import BUILDERS, Group
from .kernels import FusedKernel
from .member_links import link_member_use
from .propose import FusionSupport, StaticSignatures, propose
from .report import FusedGroupInfo, UnfusedGroup
from .rewrite import Rewriter, resort

__all__ = ["fuse_graph", "FuseResult", "FusionReuse"]

log = logging.getLogger(__name__)


@dataclass
class FuseResult:
    groups: list[FusedGroupInfo]
    notes: list[str]
    kernels: list[FusedKernel]
    unfused: list[UnfusedGroup] = field(default_factory=list)
    modules: list[nn.Module] = field(default_factory=list)
    """The module calls the kernels replaced: their configuration is baked into the kernels."""
    structures: dict[int, tuple[nn.Module, tuple]] = field(default_factory=dict)
    """``(module, structure_signature(module))`` by id, as the proposal read them."""
    reuse: Optional[FusionReuse] = None
    """What the proposal took from earlier plans of the same trace."""


class FusionReuse(NamedTuple):
    """What a proposal took from the earlier plans of its trace (other input sizes)."""

    signatures: bool
    """The size-independent halves of the signatures were cached (and still valid)."""
    groups: bool
    """The groups came out as the previous plan's: same kinds, same members."""


def _unfused(root: nn.Module, reason: str, members: list[fx.Node]) -> UnfusedGroup:
    """The record that a proposed group stays unfused, and why (shown in the plan)."""
    labels = [node_label(m) for m in members]
    m = members[0]
    kind = type(submodule(root, m.target)).__name__ if m.op == "call_module" else target_name(m)
    log.debug("fuse: %d x %s not fused: %s", len(members), labels[0], reason)
    return UnfusedGroup(kind=kind, size=len(members), members=labels, reason=reason)


def fuse_graph(
    graph: fx.Graph,
    root: nn.Module,
    metas: dict[fx.Node, ValueMeta],
    stacks: Any,
    device: DeviceModel,
    min_size: int = 2,
    statics: Optional[StaticSignatures] = None,
) -> FuseResult:
    """Fuse ``graph`` in place; ``stacks`` provides the stacked parameter holders;
    ``statics`` the size-independent halves of the fusion signatures of earlier plans of
    the same trace (:class:`~streamsched.passes.fusion.propose.StaticSignatures`)."""
    support = FusionSupport(root, metas, statics)
    proposals = propose(graph, support, min_size)
    statics = support.statics
    names = [(kind, tuple(n.name for n in members)) for kind, members in proposals.groups]
    reuse = FusionReuse(support.reused, support.reused and names == statics.groups)
    statics.groups = names
    unfused = [_unfused(root, reason, nodes) for reason, nodes in proposals.excluded]
    # The plan is made inside the call that recorded ``metas``, under the autocast state
    # its trace (and so every later call running this plan) is keyed by.
    rw = Rewriter(graph, root, metas, stacks, device, autocast_state(), torch.is_grad_enabled())
    rw.proposals = proposals.groups
    fused_modules: list[nn.Module] = []
    for kind, members in proposals.groups:
        rw.inserted = []
        reason = ""
        try:
            group = Group(rw, members)
            built = BUILDERS[kind](group)
            reason = group.reason
            if built is not None:
                # The kernel checks every result against what the members returned.
                built.kernel.out_dtype = group.out_dtype
            alike = kind != "wide"  # members of one signature (a wide group's differ in width)
            kernel = None if built is None else rw.emit(members, built.kernel, built.inputs, built.sizes, alike)
        except Exception as exc:  # noqa: BLE001 - a group that cannot be built stays unfused
            reason = f"building its kernel failed: {type(exc).__name__}: {exc}"
            kernel = None
        if kernel is None:
            rw.discard_inserted()
            unfused.append(_unfused(root, reason or "no batched kernel for these arguments", members))
        else:
            fused_modules.extend(submodule(root, m.target) for m in members if m.op == "call_module")
    if not rw.kernels:
        return FuseResult([], [], [], unfused, reuse=reuse)
    rw.rewrite_consumers()
    rw.erase_members()
    link_member_use(graph)
    resort(graph, rw.position)
    graph.lint()
    return FuseResult(rw.groups, [], rw.kernels, unfused, fused_modules, proposals.structures, reuse)
