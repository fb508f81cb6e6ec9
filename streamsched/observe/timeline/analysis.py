"""Analysis: from the spans of one observed call to a :class:`~.model.Timeline` (busy time
and idle gaps per stream, overlap, the measured critical path), and :func:`timeline`,
which records a few calls and keeps the fastest."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

from ...envinfo import device_name
from ..observable import Observable
from .model import Timeline
from .record import ObservedCall, record_runs
from .spans import IdleGap, TaskSpan

__all__ = ["timeline", "build_timeline", "measured_critical_path"]


def _busy(spans: list[TaskSpan]) -> float:
    """Length of the union of the spans' intervals."""
    total, cur_start, cur_end = 0.0, None, None
    for span in sorted(spans, key=lambda s: s.start_us):
        if cur_end is None or span.start_us > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = span.start_us, span.end_us
        else:
            cur_end = max(cur_end, span.end_us)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _gaps(by_stream: dict[int, list[TaskSpan]]) -> list[IdleGap]:
    gaps = []
    for stream, spans in by_stream.items():
        ordered = sorted(spans, key=lambda s: s.start_us)
        for before, after in zip(ordered, ordered[1:]):
            if after.start_us > before.end_us:
                gaps.append(
                    IdleGap(
                        stream=stream,
                        after_task=before.task,
                        before_task=after.task,
                        start_us=before.end_us,
                        end_us=after.start_us,
                    )
                )
    gaps.sort(key=lambda g: -g.duration_us)
    return gaps


def measured_critical_path(plan: Any, preds: list[set[int]], durations: dict[int, float]) -> tuple[list[int], float]:
    """The longest chain of dependent tasks by measured duration.

    A task depends on its data producers (``preds``, the task graph's edges), on the
    producers it waits for, and on the previous task of its own stream (a stream runs its
    tasks in issue order). ``plan.order`` is a topological order of all three.
    """
    by_id = {t.id: t for t in plan.tasks}
    last_on_stream: dict[int, int] = {}
    length: dict[int, float] = {}
    parent: dict[int, Optional[int]] = {}
    for tid in plan.order:
        task = by_id[tid]
        deps = set(preds[tid]) if tid < len(preds) else set()
        deps.update(task.waits)
        if task.stream in last_on_stream:
            deps.add(last_on_stream[task.stream])
        last_on_stream[task.stream] = tid
        best, via = 0.0, None
        for dep in sorted(deps):
            if dep in length and length[dep] > best:
                best, via = length[dep], dep
        length[tid] = best + durations.get(tid, 0.0)
        parent[tid] = via
    if not length:
        return [], 0.0
    end = max(length, key=lambda t: length[t])
    path = [end]
    while parent[path[-1]] is not None:
        path.append(parent[path[-1]])  # type: ignore[arg-type]
    path.reverse()
    return path, length[end]


def build_timeline(call: ObservedCall, runs: int) -> Timeline:
    """Analyse one observed call into a :class:`Timeline` (``runs``: how many it was chosen from)."""
    plan = call.schedule.plan
    issue = {tid: i for i, tid in enumerate(plan.order)}
    entries = sorted(call.spans, key=lambda s: issue.get(s.task, len(issue)))
    streams = sorted({t.stream for t in plan.tasks} | {e.stream for e in entries})
    by_stream: dict[int, list[TaskSpan]] = {s: [] for s in streams}
    for entry in entries:
        by_stream[entry.stream].append(entry)
    busy = {s: _busy(spans) for s, spans in by_stream.items()}
    wall = call.wall_us
    tasks = getattr(call.schedule, "tasks", None)  # none under eager dispatch: waits only
    preds = [set(t.deps) for t in tasks] if tasks is not None else []
    path, path_us = measured_critical_path(plan, preds, {e.task: e.duration_us for e in entries})
    return Timeline(
        model=plan.model,
        signature=plan.signature,
        device=plan.device,
        device_name=device_name(plan.device),
        executor=plan.schedule_executor,
        streams=streams,
        entries=entries,
        wall_us=wall,
        busy_us=busy,
        overlap=sum(busy.values()) / wall if wall > 0 else 0.0,
        gaps=_gaps(by_stream),
        critical_path=path,
        critical_path_us=path_us,
        runs=runs,
    )


def timeline(
    sm: Observable,
    *inputs: Any,
    path: Union[str, Path, None] = None,
    runs: int = 3,
    warmup: int = 2,
    **kwargs: Any,
) -> Timeline:
    """Measure when each task of ``sm(*inputs, **kwargs)`` ran, on which stream.

    Warms the module up (``warmup`` calls: the first one plans), observes ``runs`` calls and
    keeps the fastest. With ``path``, also writes ``<path>.json`` (Chrome trace) and
    ``<path>.png`` (Gantt chart). Grad mode and autocast are the caller's: wrap the call in
    ``torch.no_grad()`` to time inference.

    Example::

        >>> with torch.no_grad():                                   # doctest: +SKIP
        ...     tl = timeline(sm, torch.randn(1, 3, 299, 299), path="inception")
        >>> tl.overlap, tl.wall_us                                  # doctest: +SKIP
        (1.62, 20512.3)
    """
    observed = record_runs(sm, *inputs, runs=runs, warmup=warmup, **kwargs)
    result = build_timeline(min(observed, key=lambda call: call.wall_us), runs=len(observed))
    if path is not None:
        result.save(path)
    return result
