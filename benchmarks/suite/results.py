"""The results of a case, in the shape the JSON file stores them.

Every row carries its correctness figure (``max_abs_err`` against eager on the same
inputs, and the ``tolerance`` it was held to) and every raw sample; ratios are computed
from the medians when the report is written. Row statuses:

- ``ok``: ran and agrees with eager within the tolerance;
- ``WRONG``: ran, and disagrees (timed all the same, and shown, never hidden);
- ``n/a``: the peer cannot run this model (``torch.jit.script`` on a model that does not
  script), ``skipped``: deliberately not run (the reason says why), ``error``: it raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from .timing import Stats

__all__ = ["Row", "CaseResult", "RowStatus", "MEASURED"]

RowStatus = Literal["ok", "WRONG", "n/a", "skipped", "error"]
MEASURED = ("ok", "WRONG")
"""Statuses of rows that ran and carry samples."""


def _finite(value: Optional[float]) -> Optional[float]:
    # JSON has no infinity: an infinite error (shape mismatch) is stored as null with
    # the reason beside it.
    if value is None or not math.isfinite(value):
        return None
    return value


@dataclass
class Row:
    name: str
    status: RowStatus
    reason: Optional[str] = None
    detail: Optional[str] = None
    max_abs_err: Optional[float] = None
    tolerance: Optional[float] = None
    setup_s: Optional[float] = None
    setup_what: Optional[str] = None
    samples_ms: list[float] = field(default_factory=list)
    calls_per_sample: Optional[int] = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def stats(self) -> Optional[Stats]:
        return Stats.of(self.samples_ms) if self.samples_ms else None

    def to_dict(self, eager_median_ms: Optional[float]) -> dict[str, Any]:
        stats = self.stats
        speedup = None
        if stats is not None and eager_median_ms is not None and stats.median_ms > 0:
            speedup = eager_median_ms / stats.median_ms
        return {
            "name": self.name,
            "status": self.status,
            "reason": self.reason,
            "detail": self.detail,
            "max_abs_err": _finite(self.max_abs_err),
            "max_abs_err_is_inf": self.max_abs_err is not None and math.isinf(self.max_abs_err),
            "tolerance": self.tolerance,
            "setup_s": self.setup_s,
            "setup_what": self.setup_what,
            "stats": stats.to_dict() if stats is not None else None,
            "speedup_vs_eager": speedup,
            "calls_per_sample": self.calls_per_sample,
            "samples_ms": list(self.samples_ms),
            "info": self.info,
        }


@dataclass
class CaseResult:
    id: str
    family: str
    label: str
    kind: str
    params: dict[str, Any]
    input_shapes: list[list[int]]
    rounds: int
    warmup: int
    correctness: str
    """What ``max_abs_err`` measures for this case (outputs, or gradients)."""
    rows: list[Row]
    notes: list[str] = field(default_factory=list)

    @property
    def eager_median_ms(self) -> Optional[float]:
        for row in self.rows:
            if row.name == "eager" and row.status == "ok" and row.samples_ms:
                return Stats.of(row.samples_ms).median_ms
        return None

    def to_dict(self) -> dict[str, Any]:
        base = self.eager_median_ms
        return {
            "id": self.id,
            "family": self.family,
            "label": self.label,
            "kind": self.kind,
            "params": self.params,
            "input_shapes": self.input_shapes,
            "rounds": self.rounds,
            "warmup": self.warmup,
            "correctness": self.correctness,
            "eager_median_ms": base,
            "rows": [row.to_dict(base) for row in self.rows],
            "notes": list(self.notes),
        }
