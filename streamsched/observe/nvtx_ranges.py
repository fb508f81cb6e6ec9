"""NVTX ranges around every task, so Nsight Systems shows the schedule as it ran.

Each task becomes one range named ``"<task name> [s<stream>]"`` in the NVTX domain
``streamsched``, coloured by stream. While ``torch.profiler`` is recording, each range is
paired with a ``record_function`` of the same name, so a Chrome trace and the Nsight
timeline name the same slices.

The observer is cheap enough to leave on: the event attributes of each (task, stream)
are built once, so the hot path is one dict lookup and ``domain.push_range(attr)``; with
no tool attached the ``nvtx`` package hands out a do-nothing domain. ``NVTX_DISABLE=1``
(or the ``nvtx`` package being absent) turns it off entirely: :meth:`NvtxRanges.create`
returns ``None``. :meth:`NvtxRanges.wanted` says whether anyone would see the ranges right
now (a tool attached, or the torch profiler recording), for callers that install the
observer per call.

Example::

    >>> ranges = NvtxRanges.create()
    >>> with sm.observing(ranges):              # doctest: +SKIP
    ...     sm(x)                               # one range per task, on its stream
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

import torch

__all__ = ["NvtxRanges", "DOMAIN", "STREAM_COLORS", "range_name"]

DOMAIN = "streamsched"
"""The one NVTX domain every streamsched range belongs to."""

STREAM_COLORS: tuple[int, ...] = (
    0xFF1F77B4,  # stream 0 (the caller's): blue
    0xFFFF7F0E,
    0xFF2CA02C,
    0xFFD62728,
    0xFF9467BD,
    0xFF8C564B,
    0xFFE377C2,
    0xFF17BECF,
)
"""ARGB colour of each stream's ranges (streams beyond the eighth reuse them in turn)."""


def range_name(task_name: str, stream: int, where: str = "") -> str:
    """The name of a task's range: ``"Mixed_5b.branch1x1.conv [s1]"``; a task of a nested
    child's plan (``where``, the child's path in the wrapped model, ``"blocks.0"``) is
    ``"blocks.0: heads.*.fc [x16 baddbmm] [s0]"``, its task's name in
    ``sm.nested_plans["blocks.0"]`` after the path."""
    return f"{where}: {task_name} [s{stream}]" if where else f"{task_name} [s{stream}]"


_autograd_profiler = torch.autograd.profiler
if hasattr(_autograd_profiler, "_is_profiler_enabled"):

    def _profiler_active() -> bool:
        # A module-level flag torch flips when a profiler starts and stops: one attribute read.
        return _autograd_profiler._is_profiler_enabled

else:  # older releases: ask the C++ side

    def _profiler_active() -> bool:
        return torch.autograd._profiler_enabled()


class _Scopes(threading.local):
    """Per thread, the ``record_function`` scopes opened by ``push`` and not yet closed."""

    def __init__(self) -> None:
        # threading.local runs __init__ once per thread: the list always exists, so the
        # hot path never pays for a failed attribute lookup.
        self.stack: list[tuple[str, int, Any]] = []


_MISSING = object()


class NvtxRanges:
    """An observer (``push(task, stream)`` / ``pop(task, stream)``) that opens one NVTX range
    per task. Thread-safe: NVTX keeps one range stack per thread, as does this class for
    its paired ``record_function`` scopes.

    Args:
        domain: an ``nvtx`` domain (``nvtx.get_domain("streamsched")``), or any object with
            ``get_event_attributes(message=, color=)``, ``push_range(attr)`` and ``pop_range()``.
        where: the module path of a nested child whose plan's tasks these ranges name
            (:func:`range_name`); ``""`` for the wrapped model's own plan.
    """

    def __init__(self, domain: Any, where: str = ""):
        self.domain = domain
        self.where = where
        self._push_range = domain.push_range
        self._pop_range = domain.pop_range
        # Keyed by what the attributes hold (name, stream) rather than the task id: task
        # ids restart with every plan, and one observer may serve all plans of a module.
        self._attributes: dict[tuple[str, int], Any] = {}
        self._lock = threading.Lock()
        self._scopes = _Scopes()
        # nvtx hands out a do-nothing domain when no tool (Nsight Systems) is attached.
        self.tool_attached = type(domain).__name__ != "DummyDomain"

    def wanted(self) -> bool:
        """Whether anything would see the ranges now: an NVTX tool is attached, or the torch
        profiler is recording. A caller may skip installing the observer when not."""
        # Asked on every call of a wrapped model: one attribute, then torch's flag.
        return self.tool_attached or _profiler_active()

    @classmethod
    def create(cls, where: str = "") -> Optional[NvtxRanges]:
        """Ranges in the ``streamsched`` domain, or ``None`` when NVTX is off: ``NVTX_DISABLE``
        is set to anything non-empty (as the ``nvtx`` package reads it) or ``nvtx`` is not
        installed."""
        if os.environ.get("NVTX_DISABLE"):
            return None
        try:
            import nvtx  # lazy: only when ranges are asked for; without it NVTX is just off
        except ImportError:
            return None
        return cls(nvtx.get_domain(DOMAIN), where)

    def attributes(self, name: str, stream: int) -> Any:
        """The event attributes of a task's range, built on first use and then reused
        (``None`` from a do-nothing domain, when no tool is attached)."""
        key = (name, stream)
        attr = self._attributes.get(key, _MISSING)
        if attr is _MISSING:
            with self._lock:
                attr = self._attributes.get(key, _MISSING)
                if attr is _MISSING:
                    color = STREAM_COLORS[stream % len(STREAM_COLORS)]
                    attr = self._attributes[key] = self.domain.get_event_attributes(
                        message=range_name(name, stream, self.where), color=color
                    )
        return attr

    def push(self, task: Any, stream: int) -> None:
        """Open the task's range on the calling thread (right before the task runs)."""
        attr = self._attributes.get((task.name, stream), _MISSING)
        if attr is _MISSING:
            attr = self.attributes(task.name, stream)
        self._push_range(attr)
        if _profiler_active():
            scope = torch.profiler.record_function(range_name(task.name, stream, self.where))
            scope.__enter__()
            self._scopes.stack.append((task.name, stream, scope))

    def pop(self, task: Any, stream: int) -> None:
        """Close the task's range (called in ``finally``: also when the task raised)."""
        self._pop_range()
        stack = self._scopes.stack
        if stack and stack[-1][0] == task.name and stack[-1][1] == stream:
            stack.pop()[2].__exit__(None, None, None)
