"""Interleaved timing for the examples: median of several rounds, variants alternated so
that machine noise hits them alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_variants(
    variants: dict[str, Callable[[], object]], device: torch.device, rounds: int = 7, inner: int = 10, warmup: int = 3
) -> dict[str, float]:
    """Median milliseconds per call of each variant, measured in interleaved rounds."""
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    sync(device)
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            sync(device)
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            sync(device)
            samples[name].append((time.perf_counter() - start) * 1e3 / inner)
    return {name: statistics.median(v) for name, v in samples.items()}
