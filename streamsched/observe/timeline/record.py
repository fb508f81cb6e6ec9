"""Recording: observers that time each task of a call on the stream it ran on, and
:func:`record_runs`, which warms a module up and observes a few calls.

On the CPU a task is done when it returns, so the host clock times it
(:class:`_ClockRecorder`); on the GPU the host returns long before the work is done, so
CUDA events recorded on each task's stream do (:class:`_CudaEventRecorder`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from ..observable import Observable, is_observable
from .spans import TaskSpan

__all__ = ["ObservedCall", "record_runs"]


@dataclass
class ObservedCall:
    """One observed call: the schedule it ran (``.plan``, and for traced models
    ``.program`` and ``.tasks``; handed over by the module's ``observer.ran``) and
    what was measured."""

    schedule: Any
    wall_us: float
    spans: list[TaskSpan]


class _LastSchedule:
    """An observer that only keeps the schedule each call ran."""

    schedule: Any = None

    def push(self, task: Any, stream: int) -> None:
        pass

    def pop(self, task: Any, stream: int) -> None:
        pass

    def ran(self, schedule: Any) -> None:
        self.schedule = schedule


class _ClockRecorder(_LastSchedule):
    """Task start/end on the host clock: right for CPU work, which is done when the task
    returns. Thread-safe: lanes write disjoint keys and ``list.append`` is atomic."""

    def prepare(self, program: Any) -> None:
        self._starts: dict[int, int] = {}
        self._spans: list[tuple[int, str, int, int, int]] = []

    def begin(self) -> None:
        self._origin = time.perf_counter_ns()

    def push(self, task: Any, stream: int) -> None:
        self._starts[task.id] = time.perf_counter_ns()

    def pop(self, task: Any, stream: int) -> None:
        end = time.perf_counter_ns()
        self._spans.append((task.id, task.name, stream, self._starts.pop(task.id, end), end))

    def end(self) -> None:
        self._finish = time.perf_counter_ns()

    def resolve(self) -> tuple[float, list[TaskSpan]]:
        origin = self._origin
        spans = [
            TaskSpan(task=tid, name=name, stream=stream, start_us=(s - origin) / 1e3, end_us=(e - origin) / 1e3)
            for tid, name, stream, s, e in self._spans
        ]
        return (self._finish - origin) / 1e3, spans


class _CudaEventRecorder(_LastSchedule):
    """Task start/end as CUDA events on the stream each task was issued to.

    The host returns long before the GPU is done, so host clocks would time the issue,
    not the work. ``push``/``pop`` run with the task's stream current (the executors make
    it so), and an event recorded there completes when the stream reaches that point.
    All times are taken relative to one event recorded on the caller's stream before the
    call; the streams executor forks every side stream from that stream afterwards, so no
    task starts before it. Events (timing enabled) are made before the call where the
    program is known, so that the hot path only records them.
    """

    def __init__(self, device: torch.device):
        self.device = device

    @staticmethod
    def _event() -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=True)

    def prepare(self, program: Any) -> None:
        tasks = program.tasks if program is not None else []
        self._start = {t.id: self._event() for t in tasks}
        self._end = {t.id: self._event() for t in tasks}
        self._origin = self._event()
        self._finish = self._event()
        self._ran: list[tuple[int, str, int]] = []

    def _stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def _record(self, events: dict[int, torch.cuda.Event], task_id: int) -> None:
        event = events.get(task_id)
        if event is None:  # eager dispatch: the branches are known only as they launch
            event = events[task_id] = self._event()
        event.record(self._stream())

    def begin(self) -> None:
        self._origin.record(self._stream())

    def push(self, task: Any, stream: int) -> None:
        self._record(self._start, task.id)

    def pop(self, task: Any, stream: int) -> None:
        self._record(self._end, task.id)
        self._ran.append((task.id, task.name, stream))

    def end(self) -> None:
        # After the call the caller's stream has joined every side stream, so this event
        # completes only once all the call's work is done.
        self._finish.record(self._stream())

    def resolve(self) -> tuple[float, list[TaskSpan]]:
        torch.cuda.synchronize(self.device)
        origin = self._origin
        spans = [
            TaskSpan(
                task=tid,
                name=name,
                stream=stream,
                start_us=origin.elapsed_time(self._start[tid]) * 1e3,
                end_us=origin.elapsed_time(self._end[tid]) * 1e3,
            )
            for tid, name, stream in self._ran
        ]
        return origin.elapsed_time(self._finish) * 1e3, spans


def record_runs(sm: Observable, *inputs: Any, runs: int = 3, warmup: int = 2, **kwargs: Any) -> list[ObservedCall]:
    """Warm ``sm`` up, then observe ``runs`` calls of ``sm(*inputs, **kwargs)``.

    Used by :func:`timeline` (which keeps the fastest call) and by
    :func:`streamsched.observe.schedule_profiles.measure_profile` (which takes medians). With
    ``cuda_graph``, observed calls run the plain streams schedule (a replayed graph has
    no per-task points to observe).
    """
    if not is_observable(sm):
        raise TypeError(f"timelines observe a StreamScheduledModule, got {type(sm).__name__}; wrap the model first")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (the first call plans, it runs no schedule), got {warmup!r}")
    name = type(sm.module).__name__
    for _ in range(warmup):
        sm(*inputs, **kwargs)
    warm = _LastSchedule()
    with sm.observing(warm):  # told what the last warm-up call ran; calls nothing
        pass
    planned = warm.schedule
    if planned is None:
        raise RuntimeError(f"{name}: no schedule after {warmup} warm-up call(s); nothing to observe")
    # A traced plan is fixed per input signature; eager dispatch plans each call anew.
    program = getattr(planned, "program", None)
    device = torch.device(planned.plan.device)
    recorder: Any = _CudaEventRecorder(device) if device.type == "cuda" else _ClockRecorder()
    observed = []
    for _ in range(runs):
        recorder.prepare(program)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # start from an idle device, as a fresh call would
        with sm.observing(recorder):
            recorder.begin()
            sm(*inputs, **kwargs)
            recorder.end()
        schedule = recorder.schedule
        if program is not None and schedule is not planned:
            raise RuntimeError(
                f"{name}: the plan changed between calls (the module was re-planned); "
                "call it with the same inputs and do not modify it while timing"
            )
        wall_us, spans = recorder.resolve()
        if not spans:
            raise RuntimeError(
                f"{name}: no task reported to the observer (plan mode {schedule.plan.mode!r}, executor "
                f"{schedule.plan.executor!r}); this configuration cannot be timed task by task{_why_no_tasks(sm)}"
            )
        observed.append(ObservedCall(schedule, wall_us, spans))
    return observed


def _why_no_tasks(sm: Any) -> str:
    """What a call that reported no task ran instead, and what can be timed."""
    nested = list(getattr(sm, "nested_plans", {}) or {})
    if nested:
        listed = ", ".join(nested[:3]) + (", ..." if len(nested) > 3 else "")
        return (
            f": its forward runs as written and its children are scheduled by plans of their own "
            f"(sm.nested_plans: {listed}), which an observer of the model does not see; time a child by "
            f"wrapping it on its own (timeline(StreamScheduledModule(model.get_submodule({nested[0]!r})), its "
            "input)), or see "
            "every child's tasks as NVTX ranges"
        )
    return ": its forward runs as written and made no @streamsched.branch call, so there is no task to time"
