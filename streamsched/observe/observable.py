"""What observing needs of a scheduled module, as a protocol.

Timelines and profiles run a wrapped model with an observer attached and read back the
schedule each call ran. :class:`streamsched.StreamScheduledModule` is such a module; this
layer names only what it uses of it (:class:`Observable`), so that it does not import the
layer that defines the wrapper.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol

from torch import nn

from ..planning.plan import Plan

__all__ = ["Observable", "ObservedSchedule", "is_observable"]


class ObservedSchedule(Protocol):
    """The schedule a call ran. Beside its plan, a traced model's schedule has ``program``
    (the compiled tasks) and ``tasks`` (the scheduled tasks, with their dependencies); eager dispatch has
    neither, and observing does without them."""

    @property
    def plan(self) -> Plan: ...


class Observable(Protocol):
    """A module whose calls can be observed task by task.

    Calling it runs the model; ``observing(observer)`` is a context manager during which
    the executors call ``observer.push(task, stream)`` and ``observer.pop(task, stream)``
    around every task, and the module calls ``observer.ran(schedule)`` with the
    :class:`ObservedSchedule` the most recent call ran, on entering the block and after
    each call in it (``sm.plan`` is only that schedule's
    report); ``module`` is the wrapped model, whose class names the timeline.
    """

    @property
    def module(self) -> nn.Module: ...

    def observing(self, observer: Any) -> AbstractContextManager[Any]: ...

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def is_observable(obj: object) -> bool:
    """Whether ``obj`` has what :class:`Observable` names (a plain ``nn.Module`` has no
    ``observing``). Checked by attribute: ``isinstance`` against a runtime-checkable
    protocol looks attributes up statically from Python 3.12 on, and would miss
    ``module``, which ``nn.Module`` keeps in ``_modules``."""
    return callable(obj) and callable(getattr(obj, "observing", None)) and hasattr(obj, "module")
