"""The plan: which task runs on which stream, what waits for what, what was fused.

A :class:`Plan` is plain data (a pydantic model): it round-trips through JSON, prints as a
table, and can be compared between runs. The runnable form of a plan is a
:class:`~streamsched.runtime.program.Program`, built alongside it.

Example::

    >>> sm = StreamScheduledModule(model)
    >>> y = sm(x)
    >>> print(sm.plan)                       # doctest: +SKIP
    Plan for Inception (float32[1, 3, 299, 299] on cpu): executor serial
      ...
    >>> Plan.from_json(sm.plan.to_json()) == sm.plan   # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from .errors import PlanError

__all__ = ["Plan", "PlannedTask", "FusedGroupInfo", "OpaqueModule", "UnfusedGroup"]


class PlannedTask(BaseModel):
    """One task of a plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: int
    name: str
    """Module path (or branch name, or ``scope.op``) of the task's main node(s)."""
    nodes: list[str]
    """The fx node names the task runs, in order."""
    stream: int
    """0 is the caller's stream; 1.. are the module's pool streams (or CPU lanes)."""
    waits: list[int] = Field(default_factory=list)
    """Tasks on other streams whose events this task waits on before it starts."""
    records: bool = False
    """Whether this task records an event (some other stream, or the join, waits on it)."""
    cost_us: float
    """Estimated (or measured, with a profile) duration in microseconds."""
    fused_group: Optional[int] = None


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


class OpaqueModule(BaseModel):
    """A module call that runs as written because tracing its class failed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    reason: str


class UnfusedGroup(BaseModel):
    """Structurally identical independent nodes that were *not* fused, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: str
    size: int
    members: list[str]
    reason: str


class Plan(BaseModel):
    """A schedule for one model and one input signature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    signature: str
    device: str
    mode: Literal["traced", "eager-dispatch"] = "traced"
    executor: str
    reason: str
    """Why this executor was chosen."""
    stream_bound: int
    num_streams: int
    order: list[int]
    """Issue order of the tasks (task ids)."""
    tasks: list[PlannedTask]
    fused_groups: list[FusedGroupInfo] = Field(default_factory=list)
    critical_path: list[int]
    critical_path_us: float
    est_serial_us: float
    est_parallel_us: float
    cross_stream_waits: int
    notes: list[str] = Field(default_factory=list)
    opaque: list[OpaqueModule] = Field(default_factory=list)
    """Module calls made opaque automatically (their class could not be traced)."""
    effect_edges: int = 0
    """Ordering edges added for in-place writes on shared storage (beyond data edges)."""
    unfused: list[UnfusedGroup] = Field(default_factory=list)
    """Candidate groups the fusion pass left alone, with the reason."""

    # --- serialisation ------------------------------------------------------------

    def to_json(self, indent: Optional[int] = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            return cls.model_validate_json(text)
        except Exception as exc:
            raise PlanError(f"not a valid streamsched plan: {exc}") from exc

    # --- queries ------------------------------------------------------------------

    def task(self, task_id: int) -> PlannedTask:
        for t in self.tasks:
            if t.id == task_id:
                return t
        raise KeyError(task_id)

    def streams(self) -> dict[int, list[int]]:
        """Task ids per stream, in issue order."""
        by_id = {t.id: t for t in self.tasks}
        out: dict[int, list[int]] = {}
        for t in self.order:
            out.setdefault(by_id[t].stream, []).append(t)
        return out

    # --- text ---------------------------------------------------------------------

    def summary(self) -> str:
        lines = [
            f"Plan for {self.model} ({self.signature} on {self.device}): executor {self.executor} [{self.mode}]",
            f"  why: {self.reason}",
            f"  {len(self.tasks)} tasks on {self.num_streams} stream(s) (bound {self.stream_bound}); "
            f"{self.cross_stream_waits} cross-stream wait(s)",
            f"  estimated: serial {_us(self.est_serial_us)}, with this plan {_us(self.est_parallel_us)}, "
            f"critical path {_us(self.critical_path_us)} ({len(self.critical_path)} tasks)",
        ]
        if self.fused_groups:
            total = sum(g.size for g in self.fused_groups)
            lines.append(f"  fused: {len(self.fused_groups)} group(s) of {total} branches")
            for g in self.fused_groups:
                members = ", ".join(g.members[:3]) + (f", ... ({g.size} in all)" if g.size > 3 else "")
                lines.append(f"    g{g.id}: {g.kind} x{g.size} as {g.kernel}: {members}")
        for u in self.unfused:
            members = ", ".join(u.members[:3]) + (f", ... ({u.size} in all)" if u.size > 3 else "")
            lines.append(f"  not fused: {u.kind} x{u.size} ({members}): {u.reason}")
        if self.opaque:
            lines.append(f"  opaque: {len(self.opaque)} module call(s) run as written (tracing their class failed)")
            for o in self.opaque[:10]:
                lines.append(f"    {o.path}: {o.reason}")
            if len(self.opaque) > 10:
                lines.append(f"    ... {len(self.opaque) - 10} more")
        if self.effect_edges:
            lines.append(f"  in-place effects: {self.effect_edges} ordering edge(s) keep writes in eager order")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def table(self, limit: Optional[int] = 40) -> str:
        """The tasks in issue order: id, stream, waits, estimated cost, name."""
        by_id = {t.id: t for t in self.tasks}
        rows = [f"  {'task':>5} {'stream':>6} {'waits':<14} {'est.us':>9}  name"]
        shown = self.order if limit is None else self.order[:limit]
        for tid in shown:
            t = by_id[tid]
            waits = ",".join(str(w) for w in t.waits) or "-"
            if len(waits) > 14:
                waits = waits[:11] + "..."
            mark = " *" if tid in self.critical_path else ""
            group = f" [g{t.fused_group}]" if t.fused_group is not None else ""
            rows.append(f"  {tid:>5} {'s' + str(t.stream):>6} {waits:<14} {t.cost_us:>9.1f}  {t.name}{group}{mark}")
        if limit is not None and len(self.order) > limit:
            rows.append(f"  ... {len(self.order) - limit} more tasks (plan.table(limit=None) lists all)")
        rows.append("  (* = on the critical path)")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.summary() + "\n" + self.table()


def _us(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.2f} ms"
    return f"{value:.1f} us"
