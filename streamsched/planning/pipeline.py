"""Planning passes and the runner that applies them in order.

A :class:`PlanningPass` is a name, a function over the one shared
:class:`PlanningContext` (the inputs of planning and what the passes before it
produced), and two optional hooks: ``check`` verifies what the pass produced and raises
:class:`~streamsched.errors.PlanError` if it is wrong, ``dump`` renders it as text. The
planner's sequence is a list of them (:data:`streamsched.planning.planner.PASSES`),
applied by :func:`run_passes`.

Checks and dumps cost time, so they run only inside :func:`pass_instruments`::

    with pass_instruments(check=True, dump=lambda name, text: print(name, text)):
        sm(x)  # plans a new signature: every pass is checked and dumped
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import fx

from ..config import SchedulerConfig
from ..errors import PlanError
from ..frontend.effects import Effects
from ..frontend.meta import ValueMeta
from ..frontend.trace import Traced

__all__ = ["PlanningContext", "PlanningPass", "run_passes", "pass_instruments"]


@dataclass(eq=False)
class PlanningContext:
    """What every planning pass reads and writes: the inputs of planning first, then the
    results of the passes, ``None`` (or empty) until the pass that makes them ran."""

    traced: Traced
    metas: dict[fx.Node, ValueMeta]
    """Shape and dtype of every value (keyed by :attr:`graph`'s nodes once it is copied)."""
    config: SchedulerConfig
    inputs: list[torch.Tensor]
    fusion: Any
    """The module's :class:`~streamsched.passes.fusion.FusionContext`, or ``None``."""
    measured: Optional[dict[str, float]]
    """Measured task costs (microseconds by task name) from a profile."""
    effects: Effects
    device: torch.device
    device_model: Any
    """The :class:`~streamsched.ir.cost.DeviceModel` the estimates use."""
    graph: Optional[fx.Graph] = None
    """The copy of the traced graph the passes rewrite."""
    fused_groups: list[Any] = field(default_factory=list)
    unfused: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    stacks: list[Any] = field(default_factory=list)
    fusion_reuse: Any = None
    task_graph: Any = None
    """The :class:`~streamsched.ir.graph.TaskGraph` over :attr:`graph`."""
    stream_bound: int = 1
    assignment: Any = None
    """The :class:`~streamsched.planning.assign.Assignment` of the tasks."""
    executor: str = ""
    reason: str = ""
    critical_path: list[int] = field(default_factory=list)
    tasks: list[Any] = field(default_factory=list)
    """The :class:`~.schedule.ScheduledTask` list (the handoff's)."""
    plan: Any = None
    """The :class:`~.plan.Plan` derived from :attr:`tasks`."""

    @property
    def root(self) -> torch.nn.Module:
        return self.traced.root


@dataclass(frozen=True)
class PlanningPass:
    """One step of planning."""

    name: str
    run: Callable[[PlanningContext], None]
    """Reads and extends the context."""
    check: Optional[Callable[[PlanningContext], None]] = None
    """Raises :class:`~streamsched.errors.PlanError` where what the pass produced is
    inconsistent (run under ``pass_instruments(check=True)``)."""
    dump: Optional[Callable[[PlanningContext], str]] = None
    """What the pass produced, as text (under ``pass_instruments(dump=...)``)."""


@dataclass
class _Instruments:
    check: bool = False
    dump: Optional[Callable[[str, str], None]] = None


_current = threading.local()


def _instruments() -> Optional[_Instruments]:
    return getattr(_current, "value", None)


@contextlib.contextmanager
def pass_instruments(check: bool = False, dump: Optional[Callable[[str, str], None]] = None) -> Iterator[None]:
    """Inside the block (on this thread), plans made run every pass's ``check`` (with
    ``check``) and hand every pass's ``dump`` text to ``dump(name, text)``."""
    previous = _instruments()
    _current.value = _Instruments(check, dump)
    try:
        yield
    finally:
        _current.value = previous


def run_passes(passes: Sequence[PlanningPass], ctx: PlanningContext) -> PlanningContext:
    """Apply ``passes`` to ``ctx`` in order, with the checks and dumps the enclosing
    :func:`pass_instruments` asks for."""
    instruments = _instruments()
    if instruments is None:
        for p in passes:
            p.run(ctx)
        return ctx
    for p in passes:
        p.run(ctx)
        if instruments.check and p.check is not None:
            try:
                p.check(ctx)
            except PlanError as exc:
                raise PlanError(f"planning pass {p.name!r}: {exc}") from exc
        if instruments.dump is not None and p.dump is not None:
            instruments.dump(p.name, p.dump(ctx))
    return ctx
