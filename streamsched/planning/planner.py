"""The pipeline from a trace to a plan: fuse -> tasks -> coarsen -> assign -> choose.

Everything that depends on input shapes happens here, once per input signature. The
result, a :class:`Schedule`, is the one contract between planning and the runtime: the
:class:`~streamsched.planning.plan.Plan` users read, and the rewritten graph, task graph
and stream assignment that plan describes. The runtime compiles it
(:func:`streamsched.runtime.program.compile_program`); nothing here imports the runtime.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import fx

from .._gc import cyclic_gc_paused
from ..config import SchedulerConfig
from ..frontend import node_meta
from ..frontend.effects import Effects
from ..frontend.fx_fast import set_arguments
from ..frontend.leafcalls import opaque_leaf_calls, traced_coverage
from ..frontend.meta import ValueMeta
from ..frontend.nodes import resolving_submodules
from ..frontend.trace import Traced
from ..ir.cost import device_model_for
from ..ir.graph import TaskGraph
from ..passes.coarsen import coarsen
from .assign import Assignment, assign_streams
from .choice import choose_executor
from .plan import FusedGroupInfo, OpaqueFunctionCall, OpaqueModule, Plan, PlannedTask, UnfusedGroup

__all__ = ["Schedule", "make_schedule", "copy_graph", "device_of", "signature_text"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Schedule:
    """What the planner hands the runtime for one input signature.

    ``plan`` is the report; the rest is what it describes, in the form the runtime
    compiles: the rewritten ``graph`` (fused kernels in place), the ``task_graph`` over
    it (task ``i`` is the nodes ``task_graph.tasks[i].nodes``), and the ``assignment``
    (stream, issue order, waits and records of every task), exactly as ``plan.tasks``
    lists them.
    """

    plan: Plan
    graph: fx.Graph
    task_graph: TaskGraph
    assignment: Assignment
    root: torch.nn.Module
    effects: Effects
    """The in-place effects recorded on the planning call (their storages are logged)."""
    stacks: list[Any] = field(default_factory=list)
    """Stacked parameters the fused kernels read; checked before every call."""
    fusion_reuse: Any = None
    """What the fusion proposal took from the trace's plans at other input sizes
    (:class:`~streamsched.passes.fusion.fuse.FusionReuse`), or ``None`` without fusion."""


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


def signature_text(tensors: list[torch.Tensor]) -> str:
    parts = []
    for t in tensors[:4]:
        dt = str(t.dtype).replace("torch.", "")
        parts.append(f"{dt}[{', '.join(map(str, t.shape))}]")
    if len(tensors) > 4:
        parts.append(f"... {len(tensors)} inputs")
    return ", ".join(parts) or "no tensor inputs"


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
    """Plan one input signature of a traced model.

    ``fusion`` is the module's :class:`~streamsched.passes.fusion.FusionContext` (it owns the
    stacked parameters shared by all plans); ``measured`` maps task names to measured
    microseconds from a profile; ``effects`` the in-place effects recorded on the first
    call (their nodes keep eager order and are never fused).
    """
    # Every pass looks up the modules of the graph's calls: each path is walked once.
    with resolving_submodules(traced.root):
        return _make_schedule(traced, metas, config, inputs, fusion, measured, effects)


def _make_schedule(
    traced: Traced,
    metas: dict[fx.Node, ValueMeta],
    config: SchedulerConfig,
    inputs: list[torch.Tensor],
    fusion: Any,
    measured: Optional[dict[str, float]],
    effects: Optional[Effects],
) -> Schedule:
    root = traced.root
    graph, metas = copy_graph(traced.graph, metas)
    effects = effects or Effects()
    involved = effects.involved
    for node in graph.nodes:
        if node.name in involved:
            node_meta.set_effect(node)
        if node.name in effects.outputs_written:
            node_meta.set_output_written(node)
    device = device_of(inputs, root)
    dev = device_model_for(device)
    groups: list[FusedGroupInfo] = []
    unfused: list[UnfusedGroup] = []
    notes: list[str] = []
    stacks: list[Any] = []
    reuse = None
    if config.fuse and fusion is not None:
        result = fusion.fuse(graph, root, metas, config, dev, source=traced.graph)
        reuse = result.reuse
        groups = result.groups
        unfused = result.unfused
        notes.extend(result.notes)
        seen: set[int] = set()
        for kernel in result.kernels:
            for stack in kernel.params:
                if id(stack) not in seen:
                    seen.add(id(stack))
                    stacks.append(stack)
        if config.grad_handoff == "direct" and any(s.alias for s in stacks):
            if any(s.grad_handoff == "unavailable" for s in stacks):
                notes.append(
                    "grad_handoff='direct' needs the native extension (streamsched._C); "
                    "fused members' gradients go through autograd"
                )
            else:
                notes.append(
                    "grad_handoff='direct': fused members' .grad are written in one native call per "
                    "stacked tensor (members with gradient hooks go through autograd)"
                )
    tg = TaskGraph.from_fx(graph, root, metas, dev, after=effects.after)
    tg = coarsen(tg, cheap_us=dev.launch_us * 1.5)
    if measured:
        # Profiles time whole tasks, named after coarsening (which decided on the
        # estimates, so the same tasks come out): apply the measurements here.
        for task in tg.tasks:
            task.cost = measured.get(task.name, task.cost)
    bound = config.resolved_streams(max(1, tg.width()))
    assignment = assign_streams(tg, bound, float(config.min_task_cost), dev.launch_us)
    executor, reason = choose_executor(config, device, assignment)
    if executor == "serial":
        est_serial = assignment.est_serial_us
        assignment = _single_stream(tg)
        assignment.est_parallel_us = est_serial
        assignment.est_serial_us = est_serial

    if config.cuda_graph is not False:
        if device.type == "cuda":
            notes.append(
                "CUDA graph: inference calls replay one captured graph of this schedule"
                + (" (from its second call)" if config.cuda_graph == "auto" else "")
                + "; calls that need gradients run on plain streams"
            )
        else:
            notes.append(f"cuda_graph is ignored: the tensors are on {device}")
    critical = tg.critical_path()
    # Counted by the recording call that preceded this planning (frontend.leafcalls).
    in_tasks, leaf_calls = traced_coverage(traced)
    nested_leaf_calls = opaque_leaf_calls(traced)
    group_of_node = {g.node: g.id for g in groups}
    tasks = []
    for t in tg.tasks:
        fused = next((group_of_node[n.name] for n in t.nodes if n.name in group_of_node), None)
        tasks.append(
            PlannedTask(
                id=t.id,
                name=t.name,
                nodes=[n.name for n in t.nodes],
                stream=assignment.stream[t.id],
                waits=list(assignment.waits[t.id]),
                records=assignment.records[t.id],
                cost_us=round(t.cost, 3),
                fused_group=fused,
            )
        )
    plan = Plan(
        model=type(traced.model).__name__,
        signature=signature_text(inputs),
        device=str(device),
        executor=executor,
        reason=reason,
        stream_bound=bound,
        num_streams=assignment.num_streams,
        order=list(assignment.order),
        tasks=tasks,
        fused_groups=groups,
        critical_path=critical,
        critical_path_us=round(sum(tg.tasks[t].cost for t in critical), 3),
        est_serial_us=round(assignment.est_serial_us, 3),
        est_parallel_us=round(assignment.est_parallel_us, 3),
        cross_stream_waits=sum(len(w) for w in assignment.waits),
        notes=notes,
        opaque=[OpaqueModule(path=p, reason=r) for p, r in traced.opaque_paths().items()],
        opaque_functions=[OpaqueFunctionCall(function=f, reason=r) for f, r in traced.opaque_functions.items()],
        effect_edges=sum(len(v) for v in effects.after.values()),
        unfused=unfused,
        leaf_calls=leaf_calls,
        leaf_calls_in_tasks=in_tasks,
        nested_leaf_calls=nested_leaf_calls,
    )
    log.debug(
        "planned %s: %d tasks, %d streams, executor %s (%s)", plan.model, len(tasks), plan.num_streams, executor, reason
    )
    return Schedule(plan, graph, tg, assignment, root, effects, stacks, reuse)
