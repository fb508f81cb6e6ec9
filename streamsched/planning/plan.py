"""The plan: which task runs on which stream, what waits for what, what was fused.

A :class:`Plan` is plain data (a pydantic model): it round-trips through JSON, prints as a
table, and can be compared between runs. The runnable form of a plan is a
:class:`~streamsched.runtime.program.Program`, built alongside it.

Example::

    >>> sm = StreamScheduledModule(model)    # doctest: +SKIP
    >>> y = sm(x)                            # doctest: +SKIP
    >>> print(sm.plan)                       # doctest: +SKIP
    Plan for Inception3 (float32[1, 3, 299, 299] on cpu): executor serial [traced]
      ...
    >>> Plan.from_json(sm.plan.to_json()) == sm.plan   # doctest: +SKIP
    True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from ..errors import PlanError
from ..frontend.leafcalls import opaque_leaf_calls, traced_coverage
from ..passes.fusion.report import FusedGroupInfo, UnfusedGroup

if TYPE_CHECKING:
    from .pipeline import PlanningContext

__all__ = [
    "Plan",
    "PlannedTask",
    "FusedGroupInfo",
    "OpaqueModule",
    "UnfusedGroup",
    "ExecutorTrial",
    "assemble_plan",
    "signature_text",
    "signature_text_of",
]


# The summary lists this many groups left unfused and opaque calls; the fields hold all.
_LISTED = 10


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


class OpaqueModule(BaseModel):
    """A module call that runs as written because tracing its class failed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: str
    reason: str


class OpaqueFunctionCall(BaseModel):
    """A plain function whose calls run as written (one opaque call each) because the
    trace could not go through it (``frontend.opaque_functions``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    function: str
    reason: str


class ExecutorTrial(BaseModel):
    """What the first calls of a signature measured (``executor="auto"``).

    The candidates are the plan's executor, ``serial`` and ``eager`` (the model's own
    forward, run as written). Each call of the trial runs one candidate, in turn; a
    candidate far behind the leader is dropped early, the rest get ``rounds`` calls each
    (up to ``max_rounds`` where the schedule and the forward are close). The figures are
    each candidate's fastest call.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    best_us: dict[str, float]
    """Candidate -> its fastest timed call, in microseconds."""
    calls: dict[str, int]
    """Candidate -> how many calls it was timed over."""
    rounds: int
    """Calls each candidate gets unless it is dropped earlier."""
    max_rounds: int = 0
    """Up to how many calls each where the schedule and the model's forward were close."""
    margin: float
    """How much faster (a fraction) the model's own forward must be to replace the schedule."""
    chosen: str
    """What runs this signature from now on: an executor name, or ``eager``."""
    schedule_executor: str
    """The faster executor of the schedule: what runs when the schedule does (``chosen``
    itself, unless that is ``eager``; observers, ``sync_log`` and ``chaos`` always run the
    schedule)."""


class Plan(BaseModel):
    """A schedule for one model and one input signature."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    signature: str
    device: str
    mode: Literal["traced", "eager-dispatch", "as-written"] = "traced"
    executor: str
    """``serial``, ``streams``, ``threads``, or ``eager``: the model's own forward runs this
    signature because the first calls measured it faster than the schedule (``trial``
    has the figures)."""
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
    opaque_functions: list[OpaqueFunctionCall] = Field(default_factory=list)
    """Functions whose calls run as one opaque call each, because tracing them failed
    inside a traced forward (a mask builder); the forward around them is traced."""
    effect_edges: int = 0
    """Ordering edges added for in-place writes on shared storage (beyond data edges)."""
    unfused: list[UnfusedGroup] = Field(default_factory=list)
    """Candidate groups the fusion pass left alone, with the reason."""
    trial: Optional[ExecutorTrial] = None
    """With ``executor="auto"``, once the first calls have been timed: what they measured."""
    leaf_calls: int = 0
    """The forward's leaf-module calls, as counted once when the plan was made (see
    :attr:`coverage`); 0 where they were not counted (:meth:`as_written`)."""
    leaf_calls_in_tasks: int = 0
    """How many of :attr:`leaf_calls` are tasks of the schedule, or run inside a task the
    user declared one (see :attr:`coverage`)."""
    nested_leaf_calls: dict[str, int] = Field(default_factory=dict)
    """Of :attr:`leaf_calls`, those made inside each module call that may get a nested
    plan (an opaque call of a traced plan, a child of a forward run as written), by
    module path."""
    nested_in_tasks: int = 0
    """How many of :attr:`nested_leaf_calls` ran as tasks of the nested plans, as the
    wrapper reported the plan (``sm.plan``; see ``StreamScheduledModule.nested_plans``)."""

    @classmethod
    def as_written(cls, model: str, reason: str, signature: str = "", device: str = "") -> Plan:
        """The plan of a call that ran the model as written, with nothing planned."""
        return cls(
            model=model,
            signature=signature,
            device=device,
            mode="as-written",
            executor="eager",
            reason=reason,
            stream_bound=1,
            num_streams=1,
            order=[],
            tasks=[],
            critical_path=[],
            critical_path_us=0.0,
            est_serial_us=0.0,
            est_parallel_us=0.0,
            cross_stream_waits=0,
        )

    @property
    def coverage(self) -> float:
        """The share of the forward's leaf-module calls that run as tasks of this plan
        (0.0 to 1.0): how much of the model the scheduler sees.

        A *leaf-module call* is a call of a module with no child modules (``nn.Linear``,
        ``nn.ReLU``, a user module holding only parameters) or of a ``leaf_modules``
        class; a module called twice counts twice, and the calls a leaf module makes
        inside are part of its own. A module call that reaches no leaf module
        (``nn.MultiheadAttention``) counts as one itself.

        Scheduled are the calls that are tasks (fused group members included), the
        calls whose operations the trace went through, and the calls made inside a task
        the user declared one (a ``@streamsched.branch`` function or module, a
        ``torch.compile``'d module). Not scheduled: the calls made inside a module call
        that runs as one task without being declared one (a class that could not be
        traced, listed in :attr:`opaque`; a module with hooks; a ``torch.nn`` container
        such as ``nn.TransformerEncoderLayer``), and every call of a forward that runs as
        written (``executor == "eager"``: 0.0). Under eager dispatch, the calls made
        inside branch bodies are scheduled, the rest of the forward's are not, as
        counted on the first call of each call structure.

        A traced forward that makes no leaf-module call has nothing hidden: 1.0.
        :attr:`coverage_calls` gives the counts.
        """
        scheduled, total = self.coverage_calls
        if total == 0:
            return 0.0 if self.executor == "eager" else 1.0
        return scheduled / total

    @property
    def coverage_calls(self) -> tuple[int, int]:
        """``(scheduled, total)`` leaf-module calls of the forward (see :attr:`coverage`)."""
        own = 0 if self.executor == "eager" else self.leaf_calls_in_tasks
        return own + self.nested_in_tasks, self.leaf_calls

    def coverage_text(self) -> str:
        """One line: ``coverage 0.93 (52 of 56 leaf-module calls scheduled)``."""
        scheduled, total = self.coverage_calls
        nested = f", {self.nested_in_tasks} of them by nested plans" if self.nested_in_tasks else ""
        if self.executor == "eager" and self.nested_in_tasks:
            return (
                f"coverage {self.coverage:.2f} (the forward runs as written; {scheduled} of {total} leaf-module "
                "calls scheduled by nested plans)"
            )
        if self.executor == "eager":
            counted = f"; the forward makes {total}" if total else ""
            return (
                f"coverage {self.coverage:.2f} (the model runs as written: no leaf-module call is scheduled{counted})"
            )
        return f"coverage {self.coverage:.2f} ({scheduled} of {total} leaf-module calls scheduled{nested})"

    @property
    def schedule_executor(self) -> str:
        """The executor the schedule runs on (under ``eager``: the one it would use)."""
        if self.trial is not None:
            return self.trial.schedule_executor
        return self.executor

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
            f"  {_count(len(self.tasks), 'task')} on {_count(self.num_streams, 'stream')} "
            f"(at most {self.stream_bound}); {_count(self.cross_stream_waits, 'cross-stream wait')}",
            f"  estimated: serial {_us(self.est_serial_us)}, with this plan {_us(self.est_parallel_us)}, "
            f"critical path {_us(self.critical_path_us)} ({_count(len(self.critical_path), 'task')})",
            f"  {self.coverage_text()}",
        ]
        if self.executor == "eager" and self.tasks:
            # The plan of a call run as written: the schedule the trial found slower than
            # the model, or its call structure's plan at other sizes
            # (new_signatures._as_written_plan). Say that none of it ran.
            lines.append("  the model ran as written: none of the tasks below ran (the schedule it would run)")
        if self.fused_groups:
            total = sum(g.size for g in self.fused_groups)
            lines.append(f"  fused: {_count(len(self.fused_groups), 'group')} of {_count(total, 'branch')}")
            for g in self.fused_groups:
                members = ", ".join(g.members[:3]) + (f", ... ({g.size} in all)" if g.size > 3 else "")
                lines.append(f"    g{g.id}: {g.kind} x{g.size} as {g.kernel}: {members}")
        for u in self.unfused[:_LISTED]:
            members = ", ".join(u.members[:3]) + (f", ... ({u.size} in all)" if u.size > 3 else "")
            lines.append(f"  not fused: {u.kind} x{u.size} ({members}): {u.reason}")
        if len(self.unfused) > _LISTED:
            lines.append(f"  ... {len(self.unfused) - _LISTED} more groups not fused (plan.unfused lists all)")
        if self.opaque:
            lines.append(
                f"  opaque: {_count(len(self.opaque), 'module call')} run as written (tracing their class failed)"
            )
            for o in self.opaque[:_LISTED]:
                lines.append(f"    {o.path}: {o.reason}")
            if len(self.opaque) > _LISTED:
                lines.append(f"    ... {len(self.opaque) - _LISTED} more (plan.opaque lists all)")
        if self.opaque_functions:
            lines.append(
                f"  opaque functions: {_count(len(self.opaque_functions), 'function')} run as written "
                "(tracing them failed)"
            )
            for f in self.opaque_functions[:_LISTED]:
                lines.append(f"    {f.function}: {f.reason}")
        if self.trial is not None:
            timed = ", ".join(
                f"{name} {_us(us)}" for name, us in sorted(self.trial.best_us.items(), key=lambda kv: kv[1])
            )
            lines.append(f"  measured (fastest of the first calls): {timed} -> {self.trial.chosen}")
        if self.effect_edges:
            lines.append(f"  in-place effects: {_count(self.effect_edges, 'ordering edge')} keep writes in eager order")
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


def signature_text(tensors: list[torch.Tensor]) -> str:
    return signature_text_of([(t.shape, t.dtype) for t in tensors[:4]], len(tensors))


def signature_text_of(metas: Sequence[tuple], count: Optional[int] = None, any_size: bool = False) -> str:
    """:func:`signature_text` of ``(shape, dtype, ...)`` tuples, as a call's plan key
    holds them (no tensor kept); ``count``: how many inputs there are in all;
    ``any_size``: each shape written as its number of dimensions (``float32[3-d]``), for
    what stands for calls of every size."""
    count = len(metas) if count is None else count
    parts = []
    for shape, dtype, *_ in metas[:4]:
        dt = str(dtype).replace("torch.", "")
        parts.append(f"{dt}[{len(shape)}-d]" if any_size else f"{dt}[{', '.join(map(str, shape))}]")
    if count > 4:
        parts.append(f"... {count} inputs")
    return ", ".join(parts) or "no tensor inputs"


def assemble_plan(ctx: PlanningContext) -> Plan:
    """The plan of a planning context whose passes have run: its tasks, issue order,
    streams and waits are the scheduled tasks' (``ctx.tasks``)."""
    traced, a = ctx.traced, ctx.assignment
    # Counted by the recording call that preceded this planning (frontend.leafcalls).
    in_tasks, leaf_calls = traced_coverage(traced)
    group_of_node = {g.node: g.id for g in ctx.fused_groups}
    tasks = []
    order = [0] * len(ctx.tasks)
    for t in ctx.tasks:
        order[t.position] = t.id
        names = [n.name for n in t.nodes]
        tasks.append(
            PlannedTask(
                id=t.id,
                name=t.name,
                nodes=names,
                stream=t.stream,
                waits=list(t.waits),
                records=t.records,
                cost_us=round(t.cost_us, 3),
                fused_group=next((group_of_node[n] for n in names if n in group_of_node), None),
            )
        )
    critical = ctx.critical_path
    return Plan(
        model=type(traced.model).__name__,
        signature=signature_text(ctx.inputs),
        device=str(ctx.device),
        executor=ctx.executor,
        reason=ctx.reason,
        stream_bound=ctx.stream_bound,
        num_streams=a.num_streams,
        order=order,
        tasks=tasks,
        fused_groups=ctx.fused_groups,
        critical_path=critical,
        critical_path_us=round(sum(ctx.tasks[t].cost_us for t in critical), 3),
        est_serial_us=round(a.est_serial_us, 3),
        est_parallel_us=round(a.est_parallel_us, 3),
        cross_stream_waits=sum(len(t.waits) for t in ctx.tasks),
        notes=ctx.notes,
        opaque=[OpaqueModule(path=p, reason=r) for p, r in traced.opaque_paths().items()],
        opaque_functions=[OpaqueFunctionCall(function=f, reason=r) for f, r in traced.opaque_functions.items()],
        effect_edges=sum(len(v) for v in ctx.effects.after.values()),
        unfused=ctx.unfused,
        leaf_calls=leaf_calls,
        leaf_calls_in_tasks=in_tasks,
        nested_leaf_calls=opaque_leaf_calls(traced),
    )


def _count(n: int, noun: str) -> str:
    """``"1 task"``, ``"3 tasks"``, ``"2 branches"``."""
    if n == 1:
        return f"1 {noun}"
    return f"{n} {noun}es" if noun.endswith(("ch", "sh", "s", "x")) else f"{n} {noun}s"


def _us(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:.2f} ms"
    return f"{value:.1f} us"
