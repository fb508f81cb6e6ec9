"""The timeline of one call: per-task spans, per-stream busy time, overlap, idle gaps and
the measured critical path, with its exports (a Chrome trace, a text summary, and
through :mod:`.gantt` a PNG Gantt chart)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field

from ...errors import user_stacklevel
from ...planning.plan import _count
from .gantt import draw_gantt
from .spans import IdleGap, TaskSpan, fmt_us

__all__ = ["Timeline"]


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
                stacklevel=user_stacklevel(),
            )
        else:
            written.append(png_path)
        return written

    # --- text ---------------------------------------------------------------------

    def summary(self, gaps: int = 5) -> str:
        """Wall time, overlap, busy time per stream, critical path and the largest idle gaps."""
        lines = [
            self._title(),
            f"  wall {fmt_us(self.wall_us)} (fastest of {_count(self.runs, 'run')}); "
            f"{_count(len(self.entries), 'task')} on {_count(len(self.streams), 'stream')}; "
            f"overlap {self.overlap:.2f} (busy time of all streams / wall time)",
        ]
        for stream in self.streams:
            busy = self.busy_us.get(stream, 0.0)
            share = 100.0 * busy / self.wall_us if self.wall_us > 0 else 0.0
            count = sum(1 for e in self.entries if e.stream == stream)
            lines.append(f"  stream {stream}: {count} tasks, busy {fmt_us(busy)} ({share:.0f}% of wall)")
        names = {e.task: e.name for e in self.entries}
        path = self.critical_path
        shown = " -> ".join(names.get(t, str(t)) for t in (path if len(path) <= 4 else [path[0], path[-1]]))
        if len(path) > 4:
            shown = shown.replace(" -> ", f" -> ... ({len(path) - 2} more) -> ")
        share = 100.0 * self.critical_path_us / self.wall_us if self.wall_us > 0 else 0.0
        lines.append(
            f"  measured critical path: {fmt_us(self.critical_path_us)} ({share:.0f}% of wall), "
            f"{len(path)} tasks: {shown}"
        )
        if self.gaps and gaps > 0:
            lines.append(f"  largest idle gaps (of {len(self.gaps)}):")
            for gap in self.gaps[:gaps]:
                lines.append(
                    f"    stream {gap.stream}: {fmt_us(gap.duration_us)} at {fmt_us(gap.start_us)}, "
                    f"after '{names.get(gap.after_task, gap.after_task)}', "
                    f"before '{names.get(gap.before_task, gap.before_task)}'"
                )
        return "\n".join(lines)

    def _title(self) -> str:
        where = self.device if self.device_name in ("", self.device) else f"{self.device} ({self.device_name})"
        return f"{self.model} {self.signature} on {where}, executor {self.executor}"
