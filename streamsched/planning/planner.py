"""The pipeline from a trace to a schedule, as a named list of planning passes.

Everything that depends on input shapes happens here, once per input signature.
:data:`PASSES` is the sequence (copy the graph, fuse, tasks, coarsen, measured costs,
assign streams, choose the executor, ..., the plan), each pass a
:class:`~.pipeline.PlanningPass` over one :class:`~.pipeline.PlanningContext`, applied by
:func:`~.pipeline.run_passes`. The result, a :class:`~.schedule.Schedule` (a flat list
of scheduled tasks and what they run in), is the one contract between planning and the
runtime, which compiles it (:func:`streamsched.runtime.program.compile_program`);
nothing here imports the runtime.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional

import torch
from torch import fx

from .._gc import cyclic_gc_paused
from ..config import SchedulerConfig
from ..errors import PlanError
from ..frontend import node_meta
from ..frontend.effects import Effects
from ..frontend.fx_fast import set_arguments
from ..frontend.meta import ValueMeta
from ..frontend.nodes import resolving_submodules
from ..frontend.trace import Traced
from ..ir.cost import device_model_for
from ..ir.graph import TaskGraph
from ..passes.coarsen import coarsen
from .assign import Assignment, assign_streams
from .choice import choose_executor
from .pipeline import PlanningContext, PlanningPass, run_passes
from .plan import assemble_plan, signature_text
from .schedule import Schedule, ScheduledTask

__all__ = ["PASSES", "Schedule", "ScheduledTask", "make_schedule", "copy_graph", "device_of", "signature_text"]

log = logging.getLogger(__name__)


def copy_graph(graph: fx.Graph, metas: dict[fx.Node, ValueMeta]) -> tuple[fx.Graph, dict[fx.Node, ValueMeta]]:
    """A copy of ``graph`` (passes rewrite it) and the metadata keyed by the new nodes.

    As ``Graph.graph_copy`` makes it, node by node, except that each node is created
    without arguments and given them after: ``create_node`` walks the arguments of
    every call (pytree) to warn of raw symbolic ints, which the original graph's nodes
    were checked for when they were made, and that walk was half of the copy. The
    arguments and ``meta`` are set without ``Node.__setattr__``, which takes the node
    out of the graph's lookup table and puts it back on every assignment
    (``fx_fast.set_arguments``)."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    load = env.__getitem__
    out = None
    for node in graph.nodes:
        if node.op == "output":
            out = fx.node.map_arg(node.args[0], load)
            break
        copied = new.create_node(node.op, node.target, None, None, node.name, node.type)
        if node.args or node.kwargs:
            set_arguments(copied, fx.node.map_arg(node.args, load), fx.node.map_arg(node.kwargs, load))
        if type(node.meta) is dict and not copied.meta:
            copied.meta.update(node.meta)  # copy.copy of the dict, without Node.__setattr__
        else:
            copied.meta = copy.copy(node.meta)
        env[node] = copied
    new.output(out)
    new_metas = {env[n]: m for n, m in metas.items() if n in env}
    return new, new_metas


def device_of(inputs: list[torch.Tensor], root: torch.nn.Module) -> torch.device:
    for t in inputs:
        if t.device.type != "cpu":
            return t.device
    for p in root.parameters():
        return p.device
    return inputs[0].device if inputs else torch.device("cpu")


def _single_stream(tg: TaskGraph) -> Assignment:
    n = len(tg)
    return Assignment(
        stream=[0] * n,
        order=list(range(n)),
        waits=[[] for _ in range(n)],
        records=[False] * n,
        num_streams=1,
        chains=[list(range(n))],
        est_parallel_us=0.0,
        est_serial_us=0.0,
    )


# --- the passes ---------------------------------------------------------------------


def _copy_graph(ctx: PlanningContext) -> None:
    """The graph the passes rewrite, with the nodes in-place effects involve marked."""
    ctx.graph, ctx.metas = copy_graph(ctx.traced.graph, ctx.metas)
    involved = ctx.effects.involved
    parameter_writers = ctx.effects.parameter_writers
    written = ctx.effects.outputs_written
    after = ctx.effects.after
    for node in ctx.graph.nodes:
        if node.name in involved:
            node_meta.set_effect(node)
            deps = after.get(node.name)
            if deps:
                node_meta.set_effect_after(node, tuple(sorted(deps)))
        if node.name in written:
            node_meta.set_output_written(node)
        if node.name in parameter_writers:
            node_meta.set_writes_parameter(node)


def _fuse(ctx: PlanningContext) -> None:
    """:meth:`FusionContext.fuse <streamsched.passes.fusion.FusionContext.fuse>` as a pass:
    the graph rewritten in place, and the groups, notes and stacked parameters."""
    config = ctx.config
    if not config.fuse or ctx.fusion is None:
        return
    result = ctx.fusion.fuse(ctx.graph, ctx.root, ctx.metas, config, ctx.device_model, source=ctx.traced.graph)
    ctx.fusion_reuse = result.reuse
    ctx.fused_groups = result.groups
    ctx.unfused = result.unfused
    ctx.notes.extend(result.notes)
    seen: set[int] = set()
    for kernel in result.kernels:
        for stack in kernel.params:
            if id(stack) not in seen:
                seen.add(id(stack))
                ctx.stacks.append(stack)
    if config.grad_handoff == "direct" and any(s.alias for s in ctx.stacks):
        if any(s.grad_handoff == "unavailable" for s in ctx.stacks):
            ctx.notes.append(
                "grad_handoff='direct' needs the native extension (streamsched._C); "
                "fused members' gradients go through autograd"
            )
        else:
            ctx.notes.append(
                "grad_handoff='direct': fused members' .grad are written in one native call per "
                "stacked tensor (members with gradient hooks go through autograd)"
            )


def _tasks(ctx: PlanningContext) -> None:
    """One task per call node, with data and effect edges."""
    ctx.task_graph = TaskGraph.from_fx(ctx.graph, ctx.root, ctx.metas, ctx.device_model, after=ctx.effects.after)


def _coarsen(ctx: PlanningContext) -> None:
    """:func:`~streamsched.passes.coarsen.coarsen` as a pass: cheap tasks join a neighbour."""
    ctx.task_graph = coarsen(ctx.task_graph, cheap_us=ctx.device_model.launch_us * 1.5)


def _measured_costs(ctx: PlanningContext) -> None:
    # Profiles time whole tasks, named after coarsening (which decided on the
    # estimates, so the same tasks come out): apply the measurements here.
    measured = ctx.measured
    if measured:
        for task in ctx.task_graph.tasks:
            task.cost = measured.get(task.name, task.cost)


def _assign(ctx: PlanningContext) -> None:
    tg, config = ctx.task_graph, ctx.config
    ctx.stream_bound = config.resolved_streams(max(1, tg.width()))
    ctx.assignment = assign_streams(tg, ctx.stream_bound, float(config.min_task_cost), ctx.device_model.launch_us)


def _choose_executor(ctx: PlanningContext) -> None:
    """The executor; a serial plan runs every task on the caller's stream in id order."""
    ctx.executor, ctx.reason = choose_executor(ctx.config, ctx.device, ctx.assignment)
    if ctx.executor == "serial":
        est_serial = ctx.assignment.est_serial_us
        ctx.assignment = _single_stream(ctx.task_graph)
        ctx.assignment.est_parallel_us = est_serial
        ctx.assignment.est_serial_us = est_serial


def _cuda_graph_note(ctx: PlanningContext) -> None:
    cuda_graph = ctx.config.cuda_graph
    if cuda_graph is False:
        return
    if ctx.device.type == "cuda":
        ctx.notes.append(
            "CUDA graph: inference calls replay one captured graph of this schedule"
            + (" (from its second call)" if cuda_graph == "auto" else "")
            + "; calls that need gradients run on plain streams"
        )
    else:
        ctx.notes.append(f"cuda_graph is ignored: the tensors are on {ctx.device}")


def _critical_path(ctx: PlanningContext) -> None:
    ctx.critical_path = ctx.task_graph.critical_path()


def _storages(names: list[str], located: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The storages the nodes named ``names`` access, each once, in node order."""
    out: list[int] = []
    for name in names:
        for loc in located.get(name, ()):
            if loc not in out:
                out.append(loc)
    return tuple(out)


def _scheduled_tasks(ctx: PlanningContext) -> None:
    """The handoff's flat task list, from the task graph, the assignment and the effects."""
    a, effects = ctx.assignment, ctx.effects
    position = [0] * len(a.order)
    for i, t in enumerate(a.order):
        position[t] = i
    loc_reads = effects.reads if effects else {}
    loc_writes = effects.writes if effects else {}
    tasks = []
    for t, preds in zip(ctx.task_graph.tasks, ctx.task_graph.preds):
        tid = t.id
        storage_reads = storage_writes = ()
        if loc_reads or loc_writes:
            names = [n.name for n in t.nodes]
            storage_reads, storage_writes = _storages(names, loc_reads), _storages(names, loc_writes)
        tasks.append(
            ScheduledTask(
                tid,
                t.name,
                tuple(t.nodes),
                a.stream[tid],
                position[tid],
                tuple(a.waits[tid]),
                a.records[tid],
                storage_reads,
                storage_writes,
                tuple(sorted(preds)),
                t.cost,
            )
        )
    ctx.tasks = tasks


def _plan(ctx: PlanningContext) -> None:
    ctx.plan = assemble_plan(ctx)


# --- checks and dumps -----------------------------------------------------------------


def _check_graph(ctx: PlanningContext) -> None:
    try:
        ctx.graph.lint()
    except Exception as exc:
        raise PlanError(f"the rewritten graph is malformed: {exc}") from exc


def _check_task_graph(ctx: PlanningContext) -> None:
    """Every call node of the graph in exactly one task; task ids a topological order."""
    tg = ctx.task_graph
    seen: dict[fx.Node, int] = {}
    for task in tg.tasks:
        for node in task.nodes:
            if node in seen:
                raise PlanError(f"node {node.name} is in tasks {seen[node]} and {task.id}")
            seen[node] = task.id
    for node in ctx.graph.nodes:
        if node.op not in ("placeholder", "get_attr", "output") and node not in seen:
            raise PlanError(f"node {node.name} is in no task")
    for task in tg.tasks:
        for node in task.nodes:
            for inp in node.all_input_nodes:
                if seen.get(inp, task.id) > task.id:
                    raise PlanError(f"task {task.id} reads {inp.name} of the later task {seen[inp]}")


def _check_assignment(ctx: PlanningContext) -> None:
    """The issue order is a permutation that issues each task after its dependencies;
    each wait names a task issued earlier on another stream, which records."""
    a, tg = ctx.assignment, ctx.task_graph
    n = len(tg)
    if sorted(a.order) != list(range(n)):
        raise PlanError(f"the issue order {a.order} is not a permutation of the {n} tasks")
    position = {t: i for i, t in enumerate(a.order)}
    for v, preds in enumerate(tg.preds):
        for u in preds:
            if position[u] > position[v]:
                raise PlanError(f"task {v} is issued before task {u} it depends on")
    for v, waits in enumerate(a.waits):
        for u in waits:
            if a.stream[u] == a.stream[v] or position[u] > position[v] or not a.records[u]:
                raise PlanError(f"task {v} waits on task {u}, which is not an earlier recorded task elsewhere")
    if any(not 0 <= s < a.num_streams for s in a.stream):
        raise PlanError(f"a stream outside 0..{a.num_streams - 1}: {a.stream}")


def _check_scheduled_tasks(ctx: PlanningContext) -> None:
    """The flat list says what the task graph and the assignment say."""
    a, tg = ctx.assignment, ctx.task_graph
    if [t.id for t in ctx.tasks] != list(range(len(tg))):
        raise PlanError("the scheduled tasks are not numbered by their place in the list")
    for t, task in zip(ctx.tasks, tg.tasks):
        if list(t.nodes) != task.nodes or t.stream != a.stream[t.id] or list(t.waits) != list(a.waits[t.id]):
            raise PlanError(f"scheduled task {t.id} differs from the task graph or the assignment")
        if a.order[t.position] != t.id:
            raise PlanError(f"scheduled task {t.id} has position {t.position}, issued at {a.order.index(t.id)}")


def _check_plan(ctx: PlanningContext) -> None:
    plan = ctx.plan
    if plan.order != [t.id for t in sorted(ctx.tasks, key=lambda t: t.position)]:
        raise PlanError("the plan's issue order is not the scheduled tasks'")
    for planned, t in zip(plan.tasks, ctx.tasks, strict=True):
        if planned.nodes != [n.name for n in t.nodes] or planned.stream != t.stream or planned.waits != list(t.waits):
            raise PlanError(f"the plan's task {planned.id} is not scheduled task {t.id}")


def _dump_graph(ctx: PlanningContext) -> str:
    return str(ctx.graph)


def _dump_task_graph(ctx: PlanningContext) -> str:
    tg = ctx.task_graph
    return "\n".join(
        f"{t.id}: {t.name} ({len(t.nodes)} nodes, {t.cost:.1f} us) after {sorted(tg.preds[t.id])}" for t in tg.tasks
    )


def _dump_assignment(ctx: PlanningContext) -> str:
    a = ctx.assignment
    head = f"{a.num_streams} stream(s) of {ctx.stream_bound}; executor {ctx.executor or '?'}"
    rows = [f"{t}: s{a.stream[t]} waits {a.waits[t]} records {a.records[t]}" for t in a.order]
    return "\n".join([head, *rows])


def _dump_plan(ctx: PlanningContext) -> str:
    return str(ctx.plan)


PASSES: tuple[PlanningPass, ...] = (
    PlanningPass("copy-graph", _copy_graph, _check_graph, _dump_graph),
    PlanningPass("fuse", _fuse, _check_graph, _dump_graph),
    PlanningPass("tasks", _tasks, _check_task_graph, _dump_task_graph),
    PlanningPass("coarsen", _coarsen, _check_task_graph, _dump_task_graph),
    PlanningPass("measured-costs", _measured_costs, None, _dump_task_graph),
    PlanningPass("assign-streams", _assign, _check_assignment, _dump_assignment),
    PlanningPass("choose-executor", _choose_executor, _check_assignment, _dump_assignment),
    PlanningPass("cuda-graph-note", _cuda_graph_note),
    PlanningPass("critical-path", _critical_path),
    PlanningPass("scheduled-tasks", _scheduled_tasks, _check_scheduled_tasks),
    PlanningPass("plan", _plan, _check_plan, _dump_plan),
)
"""The planning passes, in the order :func:`make_schedule` applies them."""


# Planning builds tens of thousands of small objects that all survive it (fx nodes,
# groups, tasks): on a 1,000-member model collections over them were a sixth of the call.
@cyclic_gc_paused
def make_schedule(
    traced: Traced,
    metas: dict[fx.Node, ValueMeta],
    config: SchedulerConfig,
    inputs: list[torch.Tensor],
    fusion: Any = None,
    measured: Optional[dict[str, float]] = None,
    effects: Optional[Effects] = None,
) -> Schedule:
    """Plan one input signature of a traced model: :data:`PASSES` over a fresh context.

    ``fusion`` is the module's :class:`~streamsched.passes.fusion.FusionContext` (it owns the
    stacked parameters shared by all plans); ``measured`` maps task names to measured
    microseconds from a profile; ``effects`` the in-place effects recorded on the first
    call (their nodes keep eager order and are never fused).
    """
    device = device_of(inputs, traced.root)
    ctx = PlanningContext(
        traced=traced,
        metas=metas,
        config=config,
        inputs=inputs,
        fusion=fusion,
        measured=measured,
        effects=effects or Effects(),
        device=device,
        device_model=device_model_for(device),
    )
    # Every pass looks up the modules of the graph's calls: each path is walked once.
    with resolving_submodules(traced.root):
        run_passes(PASSES, ctx)
    plan = ctx.plan
    log.debug(
        "planned %s: %d tasks, %d streams, executor %s (%s)",
        plan.model,
        len(plan.tasks),
        plan.num_streams,
        plan.executor,
        plan.reason,
    )
    return Schedule(
        ctx.tasks, ctx.assignment.num_streams, plan, ctx.graph, ctx.root, ctx.effects, ctx.stacks, ctx.fusion_reuse
    )
