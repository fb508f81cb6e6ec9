"""The Gantt chart of a timeline, drawn with matplotlib into a PNG: one lane per stream,
the task names where they fit (:func:`fit_label`), the measured critical path outlined,
and a band with the model's top-level parts (:func:`model_parts`) above the lanes.

matplotlib is optional: it is imported only when a chart is drawn.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Callable, Protocol, Union

from .spans import TaskSpan, fmt_us

__all__ = ["GanttSource", "draw_gantt", "fit_label", "label_candidates", "model_parts", "part_rows"]


class GanttSource(Protocol):
    """What :func:`draw_gantt` reads of a :class:`~streamsched.observe.timeline.Timeline`.

    A protocol rather than the class itself: a timeline draws its own chart
    (``Timeline.save``), so the model imports this module and this one must not import it.
    """

    @property
    def streams(self) -> Sequence[int]: ...

    @property
    def entries(self) -> Sequence[TaskSpan]: ...

    @property
    def wall_us(self) -> float: ...

    @property
    def busy_us(self) -> Mapping[int, float]: ...

    @property
    def overlap(self) -> float: ...

    @property
    def critical_path(self) -> Sequence[int]: ...

    @property
    def critical_path_us(self) -> float: ...

    @property
    def runs(self) -> int: ...

    def _title(self) -> str:
        """The heading: model, input signature, device and executor."""
        ...


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


def model_parts(entries: Sequence[TaskSpan]) -> list[tuple[str, float, float]]:
    """The top-level parts of the model (first component of the task names: ``Mixed_5b``)
    with the time each took from its first task's start to its last task's end, in order."""
    spans: dict[str, list[float]] = {}
    for entry in entries:
        part = _BRACKETS.sub("", entry.name).split(".", 1)[0].strip()
        lo_hi = spans.setdefault(part, [entry.start_us, entry.end_us])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], entry.start_us), max(lo_hi[1], entry.end_us)
    return sorted(((part, lo, hi) for part, (lo, hi) in spans.items()), key=lambda p: p[1])


def part_rows(parts: Sequence[tuple[str, float, float]]) -> list[int]:
    """A row of the "model parts" band for each part (as :func:`model_parts` orders them),
    such that no two parts on one row overlap in time: parts run side by side on several
    streams, so alternating two rows drew overlapping parts on top of each other. Each
    part takes the lowest row free at its start; there are as many rows as parts overlap
    at most."""
    row_ends: list[float] = []  # per row, where its last part ends
    rows = []
    for _part, lo, hi in parts:
        row = next((r for r, end in enumerate(row_ends) if end <= lo), len(row_ends))
        if row == len(row_ends):
            row_ends.append(hi)
        row_ends[row] = hi
        rows.append(row)
    return rows


def draw_gantt(tl: GanttSource, path: Union[str, Path]) -> Path:
    """Draw ``tl`` as a Gantt chart into a PNG at ``path``: one lane per stream, the task
    names where they fit, the measured critical path outlined, and above the lanes a band
    with the model's top-level parts.

    Raises ``ImportError`` when matplotlib is not installed.
    """
    # Lazy: matplotlib is optional (the plot extra) and slow to import, so only drawing loads it.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure  # lazy, as above

    lanes = list(tl.streams)
    lane_y = {s: len(lanes) - 1 - i for i, s in enumerate(lanes)}  # stream 0 on top
    parts = model_parts(tl.entries)
    rows = part_rows(parts)
    band_rows = max(rows, default=0) + 1
    dpi = 110
    fig = Figure(figsize=(20.0, 2.1 + 0.85 * len(lanes) + 0.25 * band_rows), dpi=dpi, layout="constrained")
    canvas = FigureCanvasAgg(fig)  # no pyplot: no global state, safe off the main thread
    band, ax = fig.subplots(2, 1, sharex=True, height_ratios=[0.25 * max(band_rows, 2), len(lanes)])
    span_us = max(tl.wall_us, max((e.end_us for e in tl.entries), default=0.0), 1e-3)
    _draw_task_bars(ax, tl, lane_y, span_us)
    _draw_parts_band(band, parts, rows)
    ax.set_xlim(0, span_us * 1.005)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    band.set_ylim(max(band_rows, 2) - 0.4, -0.6)
    band.set_yticks([(band_rows - 1) / 2])
    band.set_yticklabels(["model parts"], fontsize=8)
    band.tick_params(axis="x", bottom=False)
    for side in ("top", "right", "bottom"):
        band.spines[side].set_visible(False)
    _label_what_fits(canvas, ax, band, tl, lane_y, parts, rows, span_us)
    _describe_axes(ax, band, tl, lanes, lane_y, span_us)
    out = Path(path)
    fig.savefig(out)
    return out


def _draw_task_bars(ax: Any, tl: GanttSource, lane_y: dict[int, int], span_us: float) -> None:
    """One bar per task in its stream's lane and colour, the critical path outlined."""
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


def _draw_parts_band(band: Any, parts: Sequence[tuple[str, float, float]], rows: Sequence[int]) -> None:
    """One grey bar per top-level part of the model, on its row of the band."""
    for i, ((_part, lo, hi), row) in enumerate(zip(parts, rows)):
        band.barh(row, hi - lo, left=lo, height=0.9, color="0.55" if i % 2 else "0.75", edgecolor="white")


def _label_what_fits(
    canvas: Any,
    ax: Any,
    band: Any,
    tl: GanttSource,
    lane_y: dict[int, int],
    parts: Sequence[tuple[str, float, float]],
    rows: Sequence[int],
    span_us: float,
) -> None:
    """Labels on the bars where they fit, measured in pixels once the layout is final."""
    from matplotlib.font_manager import FontProperties  # lazy, as in draw_gantt

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
    for (part, lo, hi), row in zip(parts, rows):
        label(band, lo, hi, row, part)


def _describe_axes(
    ax: Any, band: Any, tl: GanttSource, lanes: list[int], lane_y: dict[int, int], span_us: float
) -> None:
    """The time axis, each lane's stream and busy time, where the call returned, and the
    title with the run's figures."""
    from matplotlib.ticker import FuncFormatter  # lazy, as in draw_gantt

    scale, unit = (1e3, "ms") if span_us >= 2000 else (1.0, "us")
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / scale:g}"))
    ax.set_xlabel(f"time since the call started ({unit})")
    ax.set_yticks([lane_y[s] for s in lanes])
    ax.set_yticklabels(
        [
            f"{'stream 0 (caller)' if s == 0 else f'stream {s}'}\n"
            f"busy {fmt_us(tl.busy_us.get(s, 0.0))} ({100.0 * tl.busy_us.get(s, 0.0) / max(tl.wall_us, 1e-9):.0f}%)"
            for s in lanes
        ],
        fontsize=8,
    )
    ax.axvline(tl.wall_us, color="0.3", linestyle="--", linewidth=0.8)
    ax.grid(axis="x", color="0.85", linewidth=0.6)
    ax.set_axisbelow(True)
    band.set_title(
        f"{tl._title()}\nwall {fmt_us(tl.wall_us)}, overlap {tl.overlap:.2f}, "
        f"measured critical path {fmt_us(tl.critical_path_us)} ({len(tl.critical_path)} tasks, outlined in black); "
        f"fastest of {tl.runs} run(s); dashed line: the call returned",
        fontsize=10,
    )
