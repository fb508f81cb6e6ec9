"""The handoff from planning to the runtime: a flat list of scheduled tasks.

The planner (:mod:`.planner`) ends in a :class:`Schedule`; the runtime compiles it
(:func:`streamsched.runtime.program.compile_program`) and nothing here imports the runtime.
Every fact about one task lives once, in its :class:`ScheduledTask`: the fx nodes it runs,
its stream, its issue position, the tasks whose events it waits on, whether it records one,
and the storages it reads and writes in place. The :class:`~.plan.Plan` users read is
derived from the same list. Beside the list the schedule keeps what the tasks run in: the
rewritten graph, the root module, the recorded effects and the stacked parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ..frontend.effects import Effects
from .plan import Plan

__all__ = ["ScheduledTask", "Schedule"]


@dataclass(eq=False, slots=True)
class ScheduledTask:
    """One task of a schedule: what it runs, where, when, and how it synchronises."""

    id: int
    """Its index in :attr:`Schedule.tasks` (tasks are numbered in a topological order)."""
    name: str
    """Module path (or branch name, or ``scope.op``) of the task's main node(s)."""
    nodes: tuple[fx.Node, ...]
    """The fx nodes of the schedule's graph it runs, in order."""
    stream: int
    """0 is the caller's stream; 1.. the module's pool streams (or CPU lanes)."""
    position: int
    """Where it is issued: 0 first (:meth:`Schedule.issue_order`)."""
    waits: tuple[int, ...]
    """Tasks on other streams whose events it waits on before it starts."""
    records: bool
    """Whether it records an event (another stream, or the join, waits on it)."""
    storage_reads: tuple[int, ...]
    """Storages (:class:`~streamsched.frontend.effects.Effects` locations) its nodes read
    that some node writes in place."""
    storage_writes: tuple[int, ...]
    """Storages its nodes write in place."""
    deps: tuple[int, ...]
    """The tasks it depends on (data and effect edges): what a measured critical path
    follows."""
    cost_us: float
    """Estimated (or measured, with a profile) duration in microseconds."""


@dataclass(eq=False)
class Schedule:
    """What the planner hands the runtime for one input signature."""

    tasks: list[ScheduledTask]
    """Every task, by id."""
    num_streams: int
    plan: Plan
    """The report, derived from :attr:`tasks` (:func:`~.plan.assemble_plan`)."""
    graph: fx.Graph
    """The rewritten graph (fused kernels in place) whose nodes the tasks run."""
    root: torch.nn.Module
    effects: Effects
    """The in-place effects recorded on the planning call; the race checker reads which
    write each access must see (``effects.sees``)."""
    stacks: list[Any] = field(default_factory=list)
    """Stacked parameters the fused kernels read; checked before every call."""
    fusion_reuse: Any = None
    """What the fusion proposal took from the trace's plans at other input sizes
    (:class:`~streamsched.passes.fusion.fuse.FusionReuse`), or ``None`` without fusion."""

    def issue_order(self) -> list[int]:
        """Task ids in the order they are issued."""
        order = [0] * len(self.tasks)
        for t in self.tasks:
            order[t.position] = t.id
        return order
