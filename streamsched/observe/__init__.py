"""Seeing the schedule: NVTX ranges for Nsight Systems, measured timelines (Chrome trace
and Gantt chart).

Both are *observers*: objects with ``push(task, stream)`` and ``pop(task, stream)``, which
the executors call right before and right after each task, on the thread (and with the
CUDA stream current) that runs it; an observer with ``ran(schedule)`` is also told, after
each call, which schedule ran. ``sm.observing(observer)`` installs one for the calls made
inside the block. Schedule profiles (:mod:`.schedule_profiles`) are measured the same way.

Example::

    >>> from streamsched.observe import timeline
    >>> tl = timeline(sm, x, path="out/model")      # doctest: +SKIP
    >>> print(tl.summary())                          # doctest: +SKIP
"""

import sys

from . import schedule_profiles
from .nvtx_ranges import NvtxRanges
from .observable import Observable
from .timeline import IdleGap, TaskSpan, Timeline, timeline

# ``streamsched.observe.profiles`` is the documented import path of the schedule profiles
# (docs/observability.md); the module is named for what it holds, and this keeps the old
# path importing the same module object.
profiles = schedule_profiles
sys.modules[__name__ + ".profiles"] = schedule_profiles

__all__ = ["NvtxRanges", "Observable", "Timeline", "TaskSpan", "IdleGap", "timeline"]
