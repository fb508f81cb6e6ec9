"""What actually ran when: measured per-task start and end times of a scheduled call.

:func:`timeline` warms a :class:`~streamsched.StreamScheduledModule` up, runs it a few
times with a recorder attached (CUDA events on the GPU, the host clock on the CPU) and
keeps the fastest run as a :class:`Timeline`: one span per task, per-stream busy time,
the overlap achieved, the idle gaps of each stream and the measured critical path. A
timeline saves as a Chrome trace (open it in https://ui.perfetto.dev or
``chrome://tracing``) and as a PNG Gantt chart with one lane per stream.

The modules, each one job: :mod:`.spans` (a task's span, an idle gap), :mod:`.model`
(the :class:`Timeline` and its Chrome trace, summary and ``save``), :mod:`.record` (the
recorders and :func:`record_runs`), :mod:`.analysis` (from spans to a timeline, and
:func:`timeline` itself) and :mod:`.gantt` (the chart).

Example::

    >>> import streamsched as ss
    >>> from streamsched.observe import timeline
    >>> sm = ss.StreamScheduledModule(model, executor="threads")      # doctest: +SKIP
    >>> tl = timeline(sm, x, path="out/model")    # writes out/model.json and out/model.png  # doctest: +SKIP
    >>> print(tl.summary())                                            # doctest: +SKIP
"""

from __future__ import annotations

from .analysis import _gaps as _gaps  # a private helper tests/test_observe.py checks directly
from .analysis import build_timeline, measured_critical_path, timeline
from .gantt import draw_gantt, fit_label, label_candidates, model_parts, part_rows
from .model import Timeline
from .record import ObservedCall, record_runs
from .spans import IdleGap, TaskSpan

__all__ = [
    "Timeline",
    "TaskSpan",
    "IdleGap",
    "ObservedCall",
    "timeline",
    "record_runs",
    "draw_gantt",
    "build_timeline",
    "measured_critical_path",
    "model_parts",
    "part_rows",
    "fit_label",
    "label_candidates",
]
