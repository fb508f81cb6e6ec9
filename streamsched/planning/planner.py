"""The pipeline from a trace to something runnable: fuse -> tasks -> coarsen -> assign -> compile.

Everything that depends on input shapes happens here, once per input signature; the
result (a :class:`Schedule`) is cached by the module and reused on every later call with
the same signature.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import fx

from ..config import SchedulerConfig
from ..errors import ConfigError
from ..frontend.effects import Effects
from ..frontend.meta import ValueMeta
from ..frontend.trace import Traced
from ..ir.cost import device_model_for
from ..ir.graph import TaskGraph
from ..passes.coarsen import coarsen
from ..runtime.program import Program, compile_program
from .assign import Assignment, assign_streams
from .plan import FusedGroupInfo, OpaqueModule, Plan, PlannedTask, UnfusedGroup

__all__ = ["Schedule", "make_schedule", "copy_graph"]

log = logging.getLogger(__name__)

# Host cost of handing work to another CPU lane and of one cross-lane wait (measured
# on a 2-core machine: queue hand-off plus threading.Event round trips).
_THREAD_LANE_US = 40.0
_THREAD_WAIT_US = 10.0


@dataclass
class Schedule:
    """A plan and its compiled program, for one input signature."""

    plan: Plan
    program: Program
    graph: fx.Graph
    task_graph: TaskGraph
    stacks: list[Any] = field(default_factory=list)
    """Stacked parameters the fused kernels read; checked before every call."""
    trial: Any = None
    """With ``executor="auto"``: the timing of this plan's executor against serial and the
    model's own forward, until decided."""
    eager: bool = False
    """Decided by the trial: calls with this signature run the model's own forward."""
    rebuild: Callable[[Any], Any] = field(default=lambda leaves: leaves)
    """Builds the model's own output (its container types) from the program's flat leaves."""
    alias_pattern: Optional[tuple] = None
    """Where the graph writes in place: how the inputs shared storage on the planning call
    (the effect edges hold for that aliasing only)."""


def copy_graph(graph: fx.Graph, metas: dict[fx.Node, ValueMeta]) -> tuple[fx.Graph, dict[fx.Node, ValueMeta]]:
    """A copy of ``graph`` (passes rewrite it) and the metadata keyed by the new nodes."""
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = new.graph_copy(graph, env)
    new.output(out)
    new_metas = {env[n]: m for n, m in metas.items() if n in env}
    return new, new_metas


def _device_of(inputs: list[torch.Tensor], root: torch.nn.Module) -> torch.device:
    for t in inputs:
        if t.device.type != "cpu":
            return t.device
    for p in root.parameters():
        return p.device
    return inputs[0].device if inputs else torch.device("cpu")


def _choose_executor(config: SchedulerConfig, device: torch.device, a: Assignment) -> tuple[str, str]:
    requested = config.executor
    if requested == "threads" and device.type == "cuda":
        raise ConfigError(
            f"executor='threads' runs CPU tensors, but this call's tensors are on {device}; "
            "use executor='streams' (or 'auto') for CUDA"
        )
    if requested == "serial":
        return "serial", "requested (executor='serial')"
    if requested == "streams":
        if device.type != "cuda":
            return "streams", (
                "requested (executor='streams'); the tensors are on the CPU, so streams are "
                "simulated: tasks run in issue order and every synchronisation is still decided and logged"
            )
        return "streams", "requested (executor='streams')"
    if requested == "threads":
        return "threads", "requested (executor='threads')"
    # auto
    if a.num_streams <= 1:
        return "serial", "no independent branches worth a stream of their own"
    if device.type == "cuda":
        if a.est_parallel_us < 0.95 * a.est_serial_us:
            return "streams", (
                f"independent branches: estimated {a.est_parallel_us:.0f} us on {a.num_streams} streams "
                f"vs {a.est_serial_us:.0f} us on one"
            )
        return "serial", (
            f"streams would not pay: estimated {a.est_parallel_us:.0f} us on {a.num_streams} streams "
            f"vs {a.est_serial_us:.0f} us on one"
        )
    overhead = _THREAD_LANE_US * (a.num_streams - 1) + _THREAD_WAIT_US * sum(len(w) for w in a.waits)
    threaded = a.est_parallel_us + overhead
    if threaded < 0.7 * a.est_serial_us and a.est_serial_us - threaded > 1000.0:
        return "threads", (
            f"independent CPU branches: estimated {threaded:.0f} us on {a.num_streams} threads "
            f"vs {a.est_serial_us:.0f} us serial"
        )
    return "serial", (
        f"threads would not pay on CPU: estimated {threaded:.0f} us on {a.num_streams} threads "
        f"(with hand-off costs) vs {a.est_serial_us:.0f} us serial"
    )


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


def make_schedule(
    traced: Traced,
    metas: dict[fx.Node, ValueMeta],
    config: SchedulerConfig,
    inputs: list[torch.Tensor],
    fusion: Any = None,
    measured: Optional[dict[str, float]] = None,
    effects: Optional[Effects] = None,
) -> Schedule:
    """Plan and compile one input signature of a traced model.

    ``fusion`` is the module's :class:`~streamsched.fusion.FusionContext` (it owns the
    stacked parameters shared by all plans); ``measured`` maps task names to measured
    microseconds from a profile; ``effects`` the in-place effects recorded on the first
    call (their nodes keep eager order and are never fused).
    """
    root = traced.root
    graph, metas = copy_graph(traced.graph, metas)
    effects = effects or Effects()
    involved = effects.involved
    for node in graph.nodes:
        if node.name in involved:
            node.meta["streamsched_effect"] = True
    device = _device_of(inputs, root)
    dev = device_model_for(device)
    groups: list[FusedGroupInfo] = []
    unfused: list[UnfusedGroup] = []
    notes: list[str] = []
    stacks: list[Any] = []
    if config.fuse and fusion is not None:
        result = fusion.fuse(graph, root, metas, config, dev)
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
    executor, reason = _choose_executor(config, device, assignment)
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
    program = compile_program(
        graph,
        root,
        [t.nodes for t in tg.tasks],
        [t.name for t in tg.tasks],
        assignment.stream,
        assignment.order,
        assignment.waits,
        assignment.records,
        assignment.num_streams,
        effects=effects,
    )
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
        effect_edges=sum(len(v) for v in effects.after.values()),
        unfused=unfused,
    )
    log.debug(
        "planned %s: %d tasks, %d streams, executor %s (%s)", plan.model, len(tasks), plan.num_streams, executor, reason
    )
    return Schedule(plan, program, graph, tg, stacks)
