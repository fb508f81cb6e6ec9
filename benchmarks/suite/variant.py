"""What peers build and the suite measures: a :class:`Variant` of a case, the
:class:`BuiltCase` it runs on, and the :class:`SuiteContext` shared across cases."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn

from streamsched.testing import in_trial

from .cases import CaseSpec
from .timing import Clock

__all__ = ["Variant", "BuiltCase", "SuiteContext", "VariantStatus", "first_line", "settle"]

VariantStatus = Literal["ok", "n/a", "skipped", "error"]


def first_line(exc: BaseException, limit: int = 160) -> str:
    """``Type: first line of the message``, short enough for a table cell."""
    text = str(exc).strip().splitlines()
    msg = text[0] if text else ""
    out = f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__
    return out if len(out) <= limit else out[: limit - 3] + "..."


# Calls at most that :func:`settle` makes for an ``auto`` trial to decide (a trial takes
# 5 to 15 calls of each way it times).
TRIAL_CALLS = 64


def settle(sm: Any, call: Callable[[], Any], ctx: SuiteContext) -> tuple[int, float]:
    """Call ``call`` (a call or training step of ``sm``) until the executor trial of ``sm``
    has decided; the number of calls made and their wall seconds.

    A trial's calls run each way in turn (and, with ``cuda_graph``, none is replayed), so
    timed calls that fall in it measure the trial, not what the wrapper settles on: their
    cost is a one-off, reported with the first call's."""
    calls, seconds = 0, 0.0
    while calls < TRIAL_CALLS and in_trial(sm):
        _, took = ctx.timed(call)
        calls, seconds = calls + 1, seconds + took
    return calls, seconds


@dataclass
class Variant:
    """One way of running a case's model.

    ``call(*inputs)`` returns what the model would; ``status`` is ``"ok"`` when it can
    run, else ``"n/a"`` (does not apply, e.g. a model that does not script),
    ``"skipped"`` (deliberately not run, with the reason) or ``"error"``.
    """

    name: str
    call: Optional[Callable[..., Any]] = None
    status: VariantStatus = "ok"
    reason: Optional[str] = None
    detail: Optional[str] = None
    """The full error text behind ``reason``, for the JSON."""
    setup_s: Optional[float] = None
    """Seconds of the one-off cost before the first result: compile, script, or
    streamsched's first call (trace + record shapes + fuse + plan)."""
    setup_what: Optional[str] = None
    info: dict[str, Any] = field(default_factory=dict)
    info_after: Optional[Callable[[], dict[str, Any]]] = None
    """What to add to ``info`` once the variant was timed (a wrapper's plan after its
    executor trial: the executor its timed calls ran, not the one its first call chose)."""

    @classmethod
    def unavailable(
        cls, name: str, status: VariantStatus, reason: str, detail: Optional[str] = None, **info: Any
    ) -> Variant:
        if status == "ok":
            raise ValueError("benchmarks.suite: an unavailable variant needs a status other than 'ok'")
        return cls(name=name, status=status, reason=reason, detail=detail, info=dict(info))


@dataclass
class BuiltCase:
    """A case ready to run: the reference model (eval, on the device) and its inputs.

    Peers must not change ``model`` (it is the eager reference); a peer that rewrites
    or wraps a model in place takes :meth:`model_copy` instead.
    """

    spec: CaseSpec
    model: nn.Module
    inputs: tuple
    device: torch.device

    def model_copy(self) -> nn.Module:
        return copy.deepcopy(self.model)


@dataclass
class SuiteContext:
    """Options and state that outlive one case."""

    device: torch.device
    compile: Literal["auto", "on", "off"] = "auto"
    compile_budget_s: float = 120.0
    over_budget: dict[str, str] = field(default_factory=dict)
    """family -> why torch.compile is skipped for the rest of that family."""
    log: Callable[[str], None] = lambda message: None

    @property
    def clock(self) -> Clock:
        return Clock(self.device)

    def timed(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Run ``fn`` once; its result and wall seconds (device work included)."""
        clock = self.clock
        clock.sync()
        start = time.perf_counter()
        result = fn()
        clock.sync()
        return result, time.perf_counter() - start
