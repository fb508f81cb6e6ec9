"""Interleaved timing: every variant of a case measured in the same rounds.

Machine noise (another process taking a core, a frequency change) comes in bursts.
Measuring variant A for a minute and then variant B would charge a burst to one of
them; measuring them round-robin, a few calls each per round and with the order rotated
every round, spreads it over all of them alike. Each *sample* is the mean time of one
call over ``calls`` back-to-back calls in one round; the statistics are over the
samples (median, min, p10, p90).

On CUDA a sample is timed with CUDA events around the calls, after a synchronize, so it
measures the GPU's work and not only the host's issuing; on CPU with ``perf_counter``.

Example::

    >>> import torch
    >>> clock = Clock(torch.device("cpu"))
    >>> result = measure_interleaved({"a": lambda: sum(range(100))}, clock, rounds=3, warmup=1)
    >>> len(result["a"].samples_ms)
    3
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

__all__ = ["Stats", "Clock", "Measurement", "measure_interleaved", "percentile"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between order statistics
    (numpy's default), so that two samples give a value between them."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must lie in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Stats:
    """Summary of per-call times in milliseconds."""

    median_ms: float
    min_ms: float
    p10_ms: float
    p90_ms: float

    @property
    def spread_ms(self) -> float:
        """p90 - p10: how far apart the typical fast and slow samples are."""
        return self.p90_ms - self.p10_ms

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Stats:
        return cls(
            median_ms=percentile(samples_ms, 50.0),
            min_ms=min(samples_ms),
            p10_ms=percentile(samples_ms, 10.0),
            p90_ms=percentile(samples_ms, 90.0),
        )

    def to_dict(self) -> dict[str, float]:
        return {
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "spread_ms": self.spread_ms,
        }


class Clock:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls on one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def per_call_s(self, fn: Callable[[], Any], calls: int) -> float:
        if self.is_cuda:
            # Events on the current stream bracket the GPU work of all calls; the
            # synchronize before makes sure no earlier work is charged to them.
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            self.sync()
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3 / calls
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - begin) / calls


@dataclass
class Measurement:
    """Raw samples of one variant: per-call milliseconds, one per round."""

    samples_ms: list[float]
    calls_per_sample: int

    @property
    def stats(self) -> Stats:
        return Stats.of(self.samples_ms)


def _calls_for(clock: Clock, fn: Callable[[], Any], target_s: float, max_calls: int) -> int:
    """Enough back-to-back calls that one sample lasts about ``target_s``."""
    estimate = min(clock.per_call_s(fn, 1) for _ in range(2))
    if estimate <= 0.0:
        return max_calls
    return max(1, min(max_calls, math.ceil(target_s / estimate)))


def measure_interleaved(
    fns: dict[str, Callable[[], Any]],
    clock: Clock,
    rounds: int,
    warmup: int = 3,
    target_sample_s: float = 0.0,
    max_calls: int = 200,
) -> dict[str, Measurement]:
    """Time every function in ``fns`` in ``rounds`` interleaved rounds.

    Each function is first called ``warmup`` times; then the number of calls per sample
    is chosen per function so that a sample lasts about ``target_sample_s`` (at least one
    call, at most ``max_calls``): fast variants get many calls per sample, slow ones
    one. Round ``r`` visits the functions in an order rotated by ``r``.
    """
    if rounds < 1:
        raise ValueError(f"benchmarks.suite: rounds must be at least 1, got {rounds}")
    if warmup < 0:
        raise ValueError(f"benchmarks.suite: warmup must be >= 0, got {warmup}")
    names = list(fns)
    for name in names:
        for _ in range(warmup):
            fns[name]()
    clock.sync()
    calls = {name: _calls_for(clock, fns[name], target_sample_s, max_calls) for name in names}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            samples[name].append(clock.per_call_s(fns[name], calls[name]) * 1e3)
    return {name: Measurement(samples[name], calls[name]) for name in names}
