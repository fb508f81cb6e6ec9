"""How far a variant's result is from eager's: one number per row, and the verdict.

Outputs may be tensors or nested lists, tuples and dicts of tensors (a multi-task model
returns a dict). A difference in structure, shape or dtype is not a small error: it is
reported as an infinite error with the reason, so the row is marked WRONG.

Example::

    >>> import torch
    >>> round(compare(torch.ones(2), torch.ones(2) + 1e-3).max_abs_err, 6)
    0.001
    >>> compare({"a": torch.ones(2)}, {"a": torch.ones(3)}).reason
    "['a']: shape (2,) vs (3,)"
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

__all__ = ["Comparison", "compare", "tolerance", "max_abs"]


@dataclass(frozen=True)
class Comparison:
    max_abs_err: float
    reason: Optional[str] = None
    """Why the error is infinite (structure, shape, dtype, NaN), or ``None``."""

    def worst(self, other: Comparison) -> Comparison:
        return self if self.max_abs_err >= other.max_abs_err else other


def _leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from _leaves(value[key], f"{path}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    else:
        yield path, value


def compare(actual: Any, expected: Any) -> Comparison:
    """Largest absolute elementwise difference between two (nested) outputs."""
    got, want = list(_leaves(actual)), list(_leaves(expected))
    if [p for p, _ in got] != [p for p, _ in want]:
        return Comparison(math.inf, f"output structure differs: {[p for p, _ in got]} vs {[p for p, _ in want]}")
    worst = 0.0
    for (path, a), (_, e) in zip(got, want):
        where = path or "output"
        if not isinstance(e, torch.Tensor):
            if a != e:
                return Comparison(math.inf, f"{where}: {a!r} vs {e!r}")
            continue
        if not isinstance(a, torch.Tensor):
            return Comparison(math.inf, f"{where}: got {type(a).__name__}, expected a tensor")
        if a.shape != e.shape:
            return Comparison(math.inf, f"{where}: shape {tuple(a.shape)} vs {tuple(e.shape)}")
        if a.dtype != e.dtype:
            return Comparison(math.inf, f"{where}: dtype {a.dtype} vs {e.dtype}")
        if a.numel() == 0:
            continue
        a64, e64 = a.detach().double(), e.detach().double().to(a.device)
        nan_a, nan_e = torch.isnan(a64), torch.isnan(e64)
        if not torch.equal(nan_a, nan_e):
            return Comparison(math.inf, f"{where}: NaN where eager has none (or the reverse)")
        # Equal values (infinities included) and NaN in the same places agree.
        diff = torch.where(a64 == e64, torch.zeros_like(a64), (a64 - e64).abs()).masked_fill(nan_a, 0.0)
        worst = max(worst, float(diff.max()))
    return Comparison(worst)


def max_abs(value: Any) -> float:
    """Largest absolute value over the tensors of a (nested) output (0.0 if none)."""
    best = 0.0
    for _, leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.numel() > 0 and leaf.is_floating_point():
            best = max(best, float(leaf.detach().abs().max()))
    return best


def tolerance(reference: Any, rtol: float) -> float:
    """The largest error that still counts as correct: ``rtol`` relative to the output's
    scale (at least 1), so that fused kernels' different summation order passes and a
    wrong result does not."""
    return rtol * max(1.0, max_abs(reference))
