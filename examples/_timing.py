"""Interleaved timing for the examples: median of several rounds, variants alternated so
that machine noise hits them alike; and the intra-op thread count every speed figure is
printed with (a CPU ratio depends on it: the loop of 1000 small MLPs is about 170x slower
than its fused form on 1 thread, and only a few times on 2, where the loop's own kernels
use both cores)."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    """``--threads N``: the intra-op thread count (``torch.set_num_threads``)."""
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help=f"intra-op CPU threads (default: PyTorch's, {torch.get_num_threads()} here); "
        "the README's CPU figures use 1",
    )


def apply_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)


def cpu_threads() -> str:
    """The intra-op thread count for a heading: ``"1 CPU thread"``, ``"2 CPU threads"``."""
    n = torch.get_num_threads()
    return f"{n} CPU thread{'s' if n != 1 else ''}"


def threads_note(device: torch.device) -> str:
    """What a speed figure was measured with: ``"cpu, 2 intra-op threads"``."""
    n = torch.get_num_threads()
    return f"{device}, {n} intra-op thread{'s' if n != 1 else ''}"


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
