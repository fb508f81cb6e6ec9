"""The plan an eager-dispatch call reports: a record taken when the call ends, built into a
:class:`~streamsched.planning.plan.Plan` the first time it is asked for."""

from __future__ import annotations

import functools
from typing import Iterable, NamedTuple

import torch

from ...errors import first_line
from ...planning.plan import Plan, PlannedTask
from ...planning.planner import signature_text
from .launch import _Launch
from .policy import _Mode


class _TaskRecord(NamedTuple):
    """What the plan needs of one launch (no tensors: a record outlives its call)."""

    id: int
    name: str
    kind: str
    stream: int
    waits: tuple[int, ...]
    producers: tuple[int, ...]
    cost_us: float
    cross_waits: int
    cuda: bool


class _CallRecord(NamedTuple):
    """What the plan needs of one call, taken when the call ends."""

    model: str
    signature: str
    device: str
    reason: str
    mode: _Mode
    notes: tuple[str, ...]
    tasks: tuple[_TaskRecord, ...]

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        launches: list[_Launch],
        mode: _Mode,
        notes: Iterable[str],
        tensors: list[torch.Tensor],
        reason: BaseException,
        device: torch.device,
    ) -> _CallRecord:
        summary = first_line(reason)
        tasks = tuple(
            _TaskRecord(
                launch.id,
                launch.name,
                launch.kind,
                launch.stream,
                tuple(launch.waits),
                tuple(p.id for p in launch.producers),
                launch.cost_us,
                launch.cross_waits,
                launch.kind == "stream" and launch.backend.is_cuda,
            )
            for launch in launches
        )
        return cls(type(model).__name__, signature_text(tensors), str(device), summary, mode, tuple(notes), tasks)


class EagerSchedule:
    """What ``StreamScheduledModule.plan`` reports for a call run by eager dispatch.

    Every call makes one; its :class:`~streamsched.planning.plan.Plan` is built when first asked for.
    ``leaf_calls`` is ``(in branches, total, {nested child path: calls})`` leaf-module
    calls of the call structure, as counted on its first call (``Plan.coverage``).
    """

    def __init__(self, record: _CallRecord, leaf_calls: tuple = (0, 0, {})):
        self._record = record
        self._leaf_calls = leaf_calls

    @functools.cached_property
    def plan(self) -> Plan:
        return _build_plan(self._record, self._leaf_calls)


def _critical_path(tasks: tuple[_TaskRecord, ...]) -> list[int]:
    best: dict[int, tuple[float, list[int]]] = {}
    for task in tasks:
        before = max((best[p] for p in task.producers if p in best), default=(0.0, []), key=lambda b: b[0])
        best[task.id] = (before[0] + task.cost_us, before[1] + [task.id])
    return max(best.values(), key=lambda b: b[0], default=(0.0, []))[1]


def _executor_name(tasks: tuple[_TaskRecord, ...], cpu_mode: str) -> str:
    if not tasks:
        return {"lanes": "threads", "streams": "streams"}.get(cpu_mode, "serial")
    names = {"lane": "threads", "stream": "streams"}
    return "+".join(sorted({names[t.kind] for t in tasks if t.kind in names})) or "serial"


def _build_plan(record: _CallRecord, leaf_calls: tuple) -> Plan:
    tasks = record.tasks
    critical = _critical_path(tasks)
    per_stream: dict[int, float] = {}
    for task in tasks:
        per_stream[task.stream] = per_stream.get(task.stream, 0.0) + task.cost_us
    critical_us = sum(tasks[i].cost_us for i in critical)
    notes = [
        "eager dispatch plans describe the most recent call: another call may take another path through the "
        "forward and launch other branches (coverage counts the first call with these arguments)",
        *record.notes,
    ]
    if any(task.cuda for task in tasks):
        notes.append("cost_us of a CUDA branch is the host time to issue it")
    return Plan(
        model=record.model,
        signature=record.signature,
        device=record.device,
        mode="eager-dispatch",
        executor=_executor_name(tasks, record.mode.cpu),
        reason=f"eager dispatch: the model cannot be traced ({record.reason}); {record.mode.why}",
        stream_bound=record.mode.bound,
        num_streams=len({0} | {task.stream for task in tasks}),
        order=[task.id for task in tasks],
        tasks=[
            PlannedTask(
                id=task.id,
                name=task.name,
                nodes=[],
                stream=task.stream,
                waits=list(task.waits),
                records=task.kind != "inline",
                cost_us=round(task.cost_us, 3),
            )
            for task in tasks
        ],
        critical_path=critical,
        critical_path_us=round(critical_us, 3),
        est_serial_us=round(sum(per_stream.values()), 3),
        est_parallel_us=round(max([critical_us, *per_stream.values()], default=0.0), 3),
        cross_stream_waits=sum(task.cross_waits for task in tasks),
        notes=notes,
        leaf_calls_in_tasks=leaf_calls[0],
        leaf_calls=leaf_calls[1],
        nested_leaf_calls=dict(leaf_calls[2]) if len(leaf_calls) > 2 else {},
    )
