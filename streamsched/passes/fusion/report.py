"""What the fusion pass reports: the groups it fused, and the ones it left alone and why.

Plain pydantic records, so a :class:`~streamsched.planning.plan.Plan` can hold them and
round-trip through JSON. They live here, next to the pass that makes them, because passes
sit below planning and must not import it; :mod:`streamsched.planning.plan` re-exports
both (``streamsched.FusedGroupInfo`` is public).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["FusedGroupInfo", "UnfusedGroup"]


class FusedGroupInfo(BaseModel):
    """A group of structurally identical branches run as one batched kernel."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int
    kind: str
    """What was fused: the module type (``Linear``) or function name (``relu``)."""
    kernel: str
    """How it runs: ``baddbmm``, ``grouped conv2d``, ``wide linear``, ``vmap`` ..."""
    size: int
    members: list[str]
    node: str
    """The fx node that runs the whole group."""


class UnfusedGroup(BaseModel):
    """Structurally identical independent nodes that were *not* fused, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    size: int
    members: list[str]
    reason: str
