"""Horizontal fusion support: stacked parameters, layouts and batched kernels.

The pass itself lives in :mod:`streamsched.passes.fuse`; this package holds what the
fused graph runs with, and :class:`FusionContext`, which owns the stacked parameters of
one wrapped model across all its plans (so two plans never stack the same weights twice).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import fx, nn

from .params import GatherStacked, StackedTensors

__all__ = ["FusionContext", "StackedTensors", "GatherStacked"]

log = logging.getLogger(__name__)


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is the only view of its whole storage (so it can be re-pointed)."""
    if t.grad_fn is not None or t.is_sparse:
        return False
    if t.device.type == "meta":
        return True
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return t.storage_offset() == 0 and t.is_contiguous() and storage.nbytes() == t.numel() * t.element_size()


class FusionContext:
    """The stacked tensors of one model, shared by all of its plans."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.alias = True
        self.direct_grads = False
        self._stacks: dict[tuple, StackedTensors] = {}
        self._claimed: dict[int, tuple] = {}

    def stack_for(self, owners: Sequence[tuple[nn.Module, str]], concat: bool = False) -> StackedTensors:
        key = (tuple((id(m), n) for m, n in owners), concat)
        existing = self._stacks.get(key)
        if existing is not None:
            return existing
        tensors = [getattr(m, n) for m, n in owners]
        unique = len({id(t) for t in tensors}) == len(tensors)
        claimed = any(id(t) in self._claimed for t in tensors)
        alias = self.alias and unique and not claimed and all(_owns_storage(t) for t in tensors)
        if not alias:
            reason = (
                "tensors shared between members"
                if not unique
                else "already stacked for another group"
                if claimed
                else "fuse_params='copy'"
                if not self.alias
                else "parameters do not own their storage"
            )
            log.debug("fusion: %d x %s stacked per call (%s)", len(tensors), owners[0][1], reason)
        stack = StackedTensors(owners, concat=concat, alias=alias, direct_grads=self.direct_grads)
        self._stacks[key] = stack
        if alias:
            for t in tensors:
                self._claimed[id(t)] = key
        return stack

    def fuse(self, graph: fx.Graph, root: nn.Module, metas: dict, config: Any, device: Any):
        from ..passes.fuse import fuse_graph

        self.alias = config.fuse_params == "alias"
        self.direct_grads = config.grad_handoff == "direct"
        return fuse_graph(graph, root, metas, self, device, config.fuse_min_size)

    def check_all(self, full: bool = False) -> None:
        for stack in self._stacks.values():
            stack.check(full)

    def invalidate(self) -> None:
        self._stacks.clear()
        self._claimed.clear()
