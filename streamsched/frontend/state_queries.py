"""Global torch settings a traced forward asks for, recorded so that the trace is kept
only while they hold.

``torch.get_default_dtype()``, ``torch.are_deterministic_algorithms_enabled()``,
``torch.get_num_threads()`` and their like return plain values: a forward that branches
on one (``if torch.are_deterministic_algorithms_enabled(): ...``) or computes with it is
traced for the value it had then, which fx bakes into the graph as a constant. A caller
that changes the setting later would get the old branch from the plan. While a trace
runs, the ``torch`` functions named in :data:`QUERIES` are stand-ins that note what
they returned to code outside torch and streamsched (torch's own code asks for some of
them for its own reasons); the trace then holds only while each still returns that
(``trace._query_guards``: compared on every call, a change re-traces).

Grad mode and inference mode are not among them: a trace is made, and kept, for one grad
mode and one inference mode (``new_signatures._trace_key``), so a forward asking
``torch.is_grad_enabled()`` is traced once per mode.

Only the functions looked up on ``torch`` at call time are seen: a function imported by
name before the trace (``from torch import get_default_dtype``) is not, nor are the
``torch.backends`` flags, which are attributes.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

import torch

from .trace_patches import PatchWhileTracing

__all__ = ["QUERIES", "QueryRecorder"]

# The global settings a forward may ask torch for (functions of no arguments).
QUERIES = (
    "get_default_dtype",
    "get_default_device",
    "are_deterministic_algorithms_enabled",
    "is_deterministic_algorithms_warn_only_enabled",
    "get_deterministic_debug_mode",
    "get_num_threads",
    "get_num_interop_threads",
    "get_float32_matmul_precision",
    "is_anomaly_enabled",
    "is_anomaly_check_nan_enabled",
    "is_warn_always_enabled",
)

# The recorders of the traces running on each thread, innermost last.
_active = threading.local()


def _library_caller(frame: Any) -> bool:
    """Whether the code that called a stand-in is torch's or streamsched's own."""
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name == "torch" or name.startswith(("torch.", "streamsched."))


def _recording(name: str, fn: Callable[[], Any]) -> Callable[..., Any]:
    def query(*args: Any, **kwargs: Any) -> Any:
        value = fn(*args, **kwargs)
        stack = getattr(_active, "stack", None)
        if stack and not args and not kwargs and not _library_caller(sys._getframe(1)):
            stack[-1].queries.setdefault(name, (fn, value))
        return value

    query.__wrapped__ = fn  # type: ignore[attr-defined]
    query.__name__ = name
    return query


def _install() -> dict[tuple[Any, str], Any]:
    originals: dict[tuple[Any, str], Any] = {}
    for name in QUERIES:
        fn = getattr(torch, name, None)
        if fn is not None:
            originals[(torch, name)] = fn
            setattr(torch, name, _recording(name, fn))
    return originals


_PATCH = PatchWhileTracing(_install)


class QueryRecorder:
    """Entered around one trace on its thread: :attr:`queries` holds, by function name,
    ``(function, value)`` for each setting the traced code asked for (the first answer;
    it cannot change while the trace runs)."""

    def __init__(self) -> None:
        self.queries: dict[str, tuple[Callable[[], Any], Any]] = {}

    def __enter__(self) -> QueryRecorder:
        _PATCH.begin()
        stack = getattr(_active, "stack", None)
        if stack is None:
            stack = _active.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            _active.stack.remove(self)
        finally:
            _PATCH.end()
