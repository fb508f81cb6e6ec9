"""Seeing the schedule: NVTX ranges for Nsight Systems, measured timelines (Chrome trace
and Gantt chart).

Both are *observers*: objects with ``push(task, stream)`` and ``pop(task, stream)``, which
the executors call right before and right after each task, on the thread (and with the
CUDA stream current) that runs it; an observer with ``ran(schedule)`` is also told, after
each call, which schedule ran. ``sm.observing(observer)`` installs one for the calls made
inside the block. Schedule profiles (:mod:`.profiles`) are measured the same way.

Example::

    >>> from streamsched.observe import timeline
    >>> tl = timeline(sm, x, path="out/model")      # doctest: +SKIP
    >>> print(tl.summary())                          # doctest: +SKIP
"""

from .nvtx_ranges import NvtxRanges
from .observable import Observable
from .timeline import IdleGap, TaskSpan, Timeline, timeline

__all__ = ["NvtxRanges", "Observable", "Timeline", "TaskSpan", "IdleGap", "timeline"]
