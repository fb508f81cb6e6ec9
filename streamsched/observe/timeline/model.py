"""What actually ran when: measured per-task start and end times of a scheduled call.

:func:`timeline` warms a :class:`~streamsched.StreamScheduledModule` up, runs it a few
times with a recorder attached (CUDA events on the GPU, the host clock on the CPU) and
keeps the fastest run as a :class:`Timeline`: one span per task, per-stream busy time,
the overlap achieved, the idle gaps of each stream and the measured critical path. A
timeline saves as a Chrome trace (open it in https://ui.perfetto.dev or
``chrome://tracing``) and as a PNG Gantt chart with one lane per stream.

Example::

    >>> import streamsched as ss
    >>> from streamsched.observe import timeline
    >>> sm = ss.StreamScheduledModule(model, executor="threads")      # doctest: +SKIP
    >>> tl = timeline(sm, x, path="out/model")    # writes out/model.json and out/model.png  # doctest: +SKIP
    >>> print(tl.summary())                                            # doctest: +SKIP
"""

from __future__ import annotations

import json
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Timeline", "TaskSpan", "IdleGap", "ObservedCall", "timeline", "record_runs", "draw_gantt"]


# --- the data ---------------------------------------------------------------------------


class TaskSpan(BaseModel):
    """One task of the kept run, in microseconds since the call started."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    task: int
    name: str
    stream: int
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


class IdleGap(BaseModel):
    """Time a stream sat idle between two consecutive tasks of its own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stream: int
    after_task: int
    before_task: int
    start_us: float
    end_us: float

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


class Timeline(BaseModel):
    """The measured schedule of one call (the fastest of several runs)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str
    signature: str
    device: str
    """The plan's device (``cpu``, ``cuda:0``)."""
    device_name: str
    """What that device is (the GPU's name, or the CPU's)."""
    executor: str
    streams: list[int]
    """The streams (CPU lanes) of the plan; stream 0 is the caller's."""
    entries: list[TaskSpan]
    """One span per task, in issue order."""
    wall_us: float
    """From just before the call to just after it returned (on CUDA: on the caller's stream)."""
    busy_us: dict[int, float]
    """Per stream, the time some task of it was running."""
    overlap: float
    """Busy time of all streams over wall time: 1.0 is one stream always busy (or two each
    busy half the time); above 1 streams ran side by side."""
    gaps: list[IdleGap]
    """Per stream, idle time between consecutive tasks (largest first)."""
    critical_path: list[int]
    """The longest chain of dependent tasks (data dependencies and stream order) by measured time."""
    critical_path_us: float
    runs: int = Field(ge=1)
    """How many observed runs the kept one is the fastest of."""

    # --- queries ------------------------------------------------------------------

    def span(self, task_id: int) -> TaskSpan:
        for entry in self.entries:
            if entry.task == task_id:
                return entry
        raise KeyError(task_id)

    # --- export -------------------------------------------------------------------

    def to_chrome_trace(self) -> dict[str, Any]:
        """The timeline as a Chrome trace (``{"traceEvents": [...]}``): one complete event
        (``ph="X"``) per task, ``ts``/``dur`` in microseconds, thread ``tid`` = stream."""
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 1, "tid": 0, "args": {"name": self._title()}},
        ]
        for stream in self.streams:
            label = "stream 0 (caller)" if stream == 0 else f"stream {stream}"
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": stream, "args": {"name": label}})
            events.append(
                {"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": stream, "args": {"sort_index": stream}}
            )
        critical = set(self.critical_path)
        for entry in self.entries:
            events.append(
                {
                    "name": entry.name,
                    "cat": "task",
                    "ph": "X",
                    "pid": 1,
                    "tid": entry.stream,
                    "ts": entry.start_us,
                    "dur": entry.duration_us,
                    "args": {"task": entry.task, "stream": entry.stream, "critical_path": entry.task in critical},
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "model": self.model,
                "signature": self.signature,
                "device": self.device,
                "device_name": self.device_name,
                "executor": self.executor,
                "wall_us": self.wall_us,
                "overlap": self.overlap,
                "critical_path_us": self.critical_path_us,
            },
        }

    def save(self, path: Union[str, Path]) -> list[Path]:
        """Write ``<path>.json`` (Chrome trace) and ``<path>.png`` (Gantt chart); return the
        paths written. A ``.json``/``.png`` suffix on ``path`` is ignored.

        Without matplotlib only the JSON is written, with a warning saying how to get the PNG.
        """
        base = Path(path)
        if base.suffix in (".json", ".png"):
            base = base.with_suffix("")
        base.parent.mkdir(parents=True, exist_ok=True)
        json_path = base.with_name(base.name + ".json")
        json_path.write_text(json.dumps(self.to_chrome_trace()))
        written = [json_path]
        png_path = base.with_name(base.name + ".png")
        try:
            draw_gantt(self, png_path)
        except ImportError as exc:
            warnings.warn(
                f"timeline: wrote {json_path} but not {png_path}: the Gantt chart needs matplotlib "
                f"({exc}); `pip install matplotlib` to get it",
                RuntimeWarning,
                stacklevel=2,
            )
        else:
            written.append(png_path)
        return written

    # --- text ---------------------------------------------------------------------

    def summary(self, gaps: int = 5) -> str:
        """Wall time, overlap, busy time per stream, critical path and the largest idle gaps."""
        lines = [
            self._title(),
            f"  wall {_fmt_us(self.wall_us)} (fastest of {self.runs} run(s)); {len(self.entries)} tasks on "
            f"{len(self.streams)} stream(s); overlap {self.overlap:.2f} (busy time of all streams / wall time)",
        ]
        for stream in self.streams:
            busy = self.busy_us.get(stream, 0.0)
            share = 100.0 * busy / self.wall_us if self.wall_us > 0 else 0.0
            count = sum(1 for e in self.entries if e.stream == stream)
            lines.append(f"  stream {stream}: {count} tasks, busy {_fmt_us(busy)} ({share:.0f}% of wall)")
        names = {e.task: e.name for e in self.entries}
        path = self.critical_path
        shown = " -> ".join(names.get(t, str(t)) for t in (path if len(path) <= 4 else [path[0], path[-1]]))
        if len(path) > 4:
            shown = shown.replace(" -> ", f" -> ... ({len(path) - 2} more) -> ")
        share = 100.0 * self.critical_path_us / self.wall_us if self.wall_us > 0 else 0.0
        lines.append(
            f"  measured critical path: {_fmt_us(self.critical_path_us)} ({share:.0f}% of wall), "
            f"{len(path)} tasks: {shown}"
        )
        if self.gaps and gaps > 0:
            lines.append(f"  largest idle gaps (of {len(self.gaps)}):")
            for gap in self.gaps[:gaps]:
                lines.append(
                    f"    stream {gap.stream}: {_fmt_us(gap.duration_us)} at {_fmt_us(gap.start_us)}, "
                    f"after '{names.get(gap.after_task, gap.after_task)}', "
                    f"before '{names.get(gap.before_task, gap.before_task)}'"
                )
        return "\n".join(lines)

    def _title(self) -> str:
        where = self.device if self.device_name in ("", self.device) else f"{self.device} ({self.device_name})"
        return f"{self.model} {self.signature} on {where}, executor {self.executor}"


def _fmt_us(value: float) -> str:
    if abs(value) >= 1000:
        return f"{value / 1000:.2f} ms"
    return f"{value:.1f} us"


# --- recording ----------------------------------------------------------------------------


@dataclass
class ObservedCall:
    """One observed call: the schedule it ran (``sm._ss.last``: ``.plan``, and for traced
    models ``.program`` and ``.task_graph``) and what was measured."""

    schedule: Any
    wall_us: float
    spans: list[TaskSpan]


class _ClockRecorder:
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


class _CudaEventRecorder:
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


def record_runs(sm: Any, *inputs: Any, runs: int = 3, warmup: int = 2, **kwargs: Any) -> list[ObservedCall]:
    """Warm ``sm`` up, then observe ``runs`` calls of ``sm(*inputs, **kwargs)``.

    Used by :func:`timeline` (which keeps the fastest call) and by
    :func:`streamsched.observe.profiles.measure_profile` (which takes medians). With
    ``cuda_graph``, observed calls run the plain streams schedule (a replayed graph has
    no per-task points to observe).
    """
    from ...module import StreamScheduledModule

    if not isinstance(sm, StreamScheduledModule):
        raise TypeError(f"timelines observe a StreamScheduledModule, got {type(sm).__name__}; wrap the model first")
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
        raise ValueError(f"warmup must be an int >= 1 (the first call plans, it runs no schedule), got {warmup!r}")
    name = type(sm.module).__name__
    for _ in range(warmup):
        sm(*inputs, **kwargs)
    planned = sm._ss.last
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
        schedule = sm._ss.last
        if program is not None and schedule is not planned:
            raise RuntimeError(
                f"{name}: the plan changed between calls (the module was re-planned); "
                "call it with the same inputs and do not modify it while timing"
            )
        wall_us, spans = recorder.resolve()
        if not spans:
            raise RuntimeError(
                f"{name}: no task reported to the observer (plan mode {schedule.plan.mode!r}, executor "
                f"{schedule.plan.executor!r}); this configuration cannot be timed task by task"
            )
        observed.append(ObservedCall(schedule, wall_us, spans))
    return observed


# --- analysis -----------------------------------------------------------------------------


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


def device_name(device: Union[str, torch.device]) -> str:
    """A human name for a device: the GPU's name, or the CPU's."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    if dev.type == "cpu":
        from ...envinfo import cpu_name

        return cpu_name()
    return str(dev)


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
    task_graph = getattr(call.schedule, "task_graph", None)  # none under eager dispatch: waits only
    preds = task_graph.preds if task_graph is not None else []
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
    sm: Any,
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


# --- the Gantt chart ----------------------------------------------------------------------

_LANE_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")
"""The same colour per stream as the NVTX ranges (see ``nvtx_ranges.STREAM_COLORS``)."""

_BRACKETS = re.compile(r"\s*\[[^\]]*\]")


def _label_forms(name: str) -> tuple[list[str], str]:
    """The informative short forms of a task name (longest first) and its bare leaf op."""
    text = _BRACKETS.sub("", name).strip()
    if " .. " in text:
        first, last = (part.split(".") for part in text.split(" .. ", 1))
        common = 0
        while common < min(len(first), len(last)) - 1 and first[common] == last[common]:
            common += 1
        parts = first[:common] + [".".join(first[common:]) + ".." + ".".join(last[common:])]
    else:
        parts = text.split(".")
    tails = [".".join(parts[k:]) for k in range(max(1, len(parts) - 1))]  # keep the leaf, drop the head
    middles = [".".join(parts[k:-1]) for k in range(len(parts) - 1)]  # drop the leaf (conv, bn, relu)
    forms: list[str] = []
    for candidate in tails + middles:
        # "*" stands for the members of a fused group: alone it names nothing.
        if candidate and not candidate.startswith("*") and candidate not in forms:
            forms.append(candidate)
    leaf = parts[-1] if len(parts) > 1 and not parts[-1].startswith("*") else ""
    return forms or [text], leaf


def label_candidates(name: str) -> list[str]:
    """Shorter and shorter forms of a task name, most informative first, for bars too
    narrow for the whole name.

    A module path keeps its distinguishing middle longest; a coarsened task
    (``"first .. last"``) is written once with its common prefix. For
    ``"Mixed_6b.branch7x7_2.conv .. Mixed_6b.branch7x7_2.relu"``::

        Mixed_6b.branch7x7_2.conv..relu, branch7x7_2.conv..relu, Mixed_6b.branch7x7_2,
        branch7x7_2, conv..relu
    """
    forms, leaf = _label_forms(name)
    return forms + ([leaf] if leaf and leaf not in forms else [])


def fit_label(name: str, room: float, width: Callable[[str], float] = len) -> str:
    """The most informative form of ``name`` no wider than ``room`` ("" if none fits).

    ``width`` measures a string (characters by default; pixels when drawing). Which part
    of the model a bar is says more than its last op, so a cut-down module path
    (``"branch7x…"``) is preferred to a bare leaf (``"conv"``) when six or more
    characters of it fit.
    """
    forms, leaf = _label_forms(name)
    for candidate in forms:
        if width(candidate) <= room:
            return candidate
    stem = forms[-1]
    for cut in range(len(stem) - 1, 5, -1):
        if width(stem[:cut] + "\u2026") <= room:
            return stem[:cut] + "\u2026"
    return leaf if leaf and width(leaf) <= room else ""


def model_parts(entries: list[TaskSpan]) -> list[tuple[str, float, float]]:
    """The top-level parts of the model (first component of the task names: ``Mixed_5b``)
    with the time each took from its first task's start to its last task's end, in order."""
    spans: dict[str, list[float]] = {}
    for entry in entries:
        part = _BRACKETS.sub("", entry.name).split(".", 1)[0].strip()
        lo_hi = spans.setdefault(part, [entry.start_us, entry.end_us])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], entry.start_us), max(lo_hi[1], entry.end_us)
    return sorted(((part, lo, hi) for part, (lo, hi) in spans.items()), key=lambda p: p[1])


def draw_gantt(tl: Timeline, path: Union[str, Path]) -> Path:
    """Draw ``tl`` as a Gantt chart into a PNG at ``path``: one lane per stream, the task
    names where they fit, the measured critical path outlined, and above the lanes a band
    with the model's top-level parts.

    Raises ``ImportError`` when matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.ticker import FuncFormatter

    lanes = list(tl.streams)
    lane_y = {s: len(lanes) - 1 - i for i, s in enumerate(lanes)}  # stream 0 on top
    dpi = 110
    fig = Figure(figsize=(20.0, 2.3 + 0.85 * len(lanes)), dpi=dpi, layout="constrained")
    canvas = FigureCanvasAgg(fig)  # no pyplot: no global state, safe off the main thread
    band, ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.5, len(lanes)])
    span_us = max(tl.wall_us, max((e.end_us for e in tl.entries), default=0.0), 1e-3)
    critical = set(tl.critical_path)
    for i, entry in enumerate(tl.entries):
        on_path = entry.task in critical
        ax.barh(
            lane_y[entry.stream],
            max(entry.duration_us, span_us * 1e-4),  # keep the tiniest task visible
            left=entry.start_us,
            height=0.72,
            color=_LANE_COLORS[entry.stream % len(_LANE_COLORS)],
            alpha=0.8 if i % 2 == 0 else 0.55,  # alternate shades: neighbours stay distinct
            edgecolor="black" if on_path else "white",
            linewidth=1.1 if on_path else 0.4,
        )
    parts = model_parts(tl.entries)
    for i, (_part, lo, hi) in enumerate(parts):
        band.barh(i % 2, hi - lo, left=lo, height=0.9, color="0.55" if i % 2 else "0.75", edgecolor="white")
    ax.set_xlim(0, span_us * 1.005)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    band.set_ylim(1.6, -0.6)
    band.set_yticks([0.5])
    band.set_yticklabels(["model parts"], fontsize=8)
    band.tick_params(axis="x", bottom=False)
    for side in ("top", "right", "bottom"):
        band.spines[side].set_visible(False)

    # Labels where they fit, measured in pixels once the layout is final.
    font = FontProperties(size=6.5)
    canvas.draw()
    renderer = canvas.get_renderer()
    px_per_us = ax.get_window_extent().width / span_us

    def text_px(text: str) -> float:
        return renderer.get_text_width_height_descent(text, font, ismath=False)[0]

    def label(axes: Any, x0: float, x1: float, y: float, name: str) -> None:
        room = (x1 - x0) * px_per_us - 4.0  # a little air at both ends
        text = fit_label(name, room, text_px) if room > 8.0 else ""
        if text:
            axes.text((x0 + x1) / 2, y, text, ha="center", va="center", fontproperties=font, clip_on=True)

    for entry in tl.entries:
        label(ax, entry.start_us, entry.end_us, lane_y[entry.stream], entry.name)
    for i, (part, lo, hi) in enumerate(parts):
        label(band, lo, hi, i % 2, part)

    scale, unit = (1e3, "ms") if span_us >= 2000 else (1.0, "us")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / scale:g}"))
    ax.set_xlabel(f"time since the call started ({unit})")
    ax.set_yticks([lane_y[s] for s in lanes])
    ax.set_yticklabels(
        [
            f"{'stream 0 (caller)' if s == 0 else f'stream {s}'}\n"
            f"busy {_fmt_us(tl.busy_us.get(s, 0.0))} ({100.0 * tl.busy_us.get(s, 0.0) / max(tl.wall_us, 1e-9):.0f}%)"
            for s in lanes
        ],
        fontsize=8,
    )
    ax.axvline(tl.wall_us, color="0.3", linestyle="--", linewidth=0.8)
    ax.grid(axis="x", color="0.85", linewidth=0.6)
    ax.set_axisbelow(True)
    band.set_title(
        f"{tl._title()}\nwall {_fmt_us(tl.wall_us)}, overlap {tl.overlap:.2f}, "
        f"measured critical path {_fmt_us(tl.critical_path_us)} ({len(tl.critical_path)} tasks, outlined in black); "
        f"fastest of {tl.runs} run(s); dashed line: the call returned",
        fontsize=10,
    )
    out = Path(path)
    fig.savefig(out)
    return out
