"""Input prefetching: a loader-bound training loop with and without ``Prefetcher``.

    python benchmarks/prefetch_bench.py [--out prefetch.json] [--batch 64] [--size 224]
                                        [--steps 16] [--rounds 7] [--device cuda]

Each step takes a CPU batch ``(images [batch, 3, size, size] float32, labels [batch])``
(38.5 MB of images at the defaults), moves it to the GPU and runs one training step of
a small CNN (two strided convolutions, pooling, a linear layer; SGD). The copy is most
of the step: the loop is loader-bound. Variants, all timed in the same interleaved
rounds (CUDA events around a pass of ``--steps`` steps, median over rounds):

- ``.to(device)``: pageable source, ``batch.to(device)`` on the compute stream: the host
  blocks on every copy and the GPU waits for it before the step.
- ``.to(device, non_blocking)``, pinned source: the host no longer blocks, but the copy is
  still on the compute stream, in front of the step that reads it.
- ``Prefetcher``, pageable source: batch k+1 pinned (on the host, in the loop's thread)
  and copied on a side stream while step k runs.
- ``Prefetcher``, pinned source (what ``DataLoader(pin_memory=True)`` hands out): only
  the side-stream copy.
- ``on device already``: the same steps on batches already on the GPU, the lower bound.

Prints a table and, with ``--out``, writes JSON (environment, options, every sample).
Before timing, one pass through the Prefetcher is checked against the source batches.
Without CUDA it says that it needs a GPU and exits 0 (``--device cpu`` runs the same
loop on the CPU, where the Prefetcher is a pass-through: a check of this script, not a
measurement of overlap).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

# The repository root, last on the path: benchmarks.suite and benchmarks.zoo come from this
# checkout; streamsched from PYTHONPATH (another tree, to compare) or the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks.suite.report import environment  # noqa: E402
from benchmarks.suite.timing import Clock, measure_interleaved  # noqa: E402
from streamsched.prefetch import Prefetcher  # noqa: E402

SCHEMA = "streamsched.prefetch_bench/1"
DISTINCT_BATCHES = 4  # cycled: enough that no batch is still in a cache, few enough to fit in host memory


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 7, stride=4, padding=3)
        self.conv2 = nn.Conv2d(32, 64, 3, stride=2, padding=1)
        self.fc = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv2(F.relu(self.conv1(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


def make_step(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()

    return step


def cycled(batches: list, steps: int) -> list:
    """A loader of ``steps`` batches cycling through ``batches`` (a list: iterable again and again)."""
    return [batches[k % len(batches)] for k in range(steps)]


def check_prefetched(loader: Iterable, device: torch.device) -> bool:
    """Whether every batch the Prefetcher hands out equals its source, read on the caller's stream."""
    sums = [(x.double().sum(), y.sum()) for x, y in Prefetcher(loader, device)]
    expected = [(x.double().sum(), y.sum()) for x, y in loader]
    if len(sums) != len(expected):
        return False
    return all(
        torch.allclose(s.cpu(), e, rtol=1e-9, atol=1e-6) and int(ys) == int(ye)
        for (s, ys), (e, ye) in zip(sums, expected)
    )


def variants(
    step: Callable, pageable: list, pinned: list, on_device: list, device: torch.device
) -> dict[str, Callable[[], None]]:
    def to_device() -> None:
        for x, y in pageable:
            step(x.to(device), y.to(device))

    def to_device_non_blocking() -> None:
        for x, y in pinned:
            step(x.to(device, non_blocking=True), y.to(device, non_blocking=True))

    def prefetch_pageable() -> None:
        for x, y in Prefetcher(pageable, device):
            step(x, y)

    def prefetch_pinned() -> None:
        for x, y in Prefetcher(pinned, device):
            step(x, y)

    def already_there() -> None:
        for x, y in on_device:
            step(x, y)

    return {
        ".to(device), pageable": to_device,
        ".to(device, non_blocking), pinned": to_device_non_blocking,
        "Prefetcher, pageable source": prefetch_pageable,
        "Prefetcher, pinned source": prefetch_pinned,
        "on device already (bound)": already_there,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON to this file")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=16, help="steps per timed pass")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2, help="untimed passes per variant")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    for name in ("batch", "size", "steps", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("prefetch_bench: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing measured.")
        return 0
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.backends.cudnn.benchmark = True

    torch.manual_seed(0)
    source = [
        (torch.randn(args.batch, 3, args.size, args.size), torch.randint(0, 10, (args.batch,)))
        for _ in range(DISTINCT_BATCHES)
    ]
    pinned_source = [(x.pin_memory(), y.pin_memory()) for x, y in source] if device.type == "cuda" else source
    device_source = [(x.to(device), y.to(device)) for x, y in source]
    pageable = cycled(source, args.steps)
    pinned = cycled(pinned_source, args.steps)
    on_device = cycled(device_source, args.steps)

    check_ok = check_prefetched(pageable, device) and check_prefetched(pinned, device)
    model = SmallCNN().to(device)
    fns = variants(make_step(model), pageable, pinned, on_device, device)
    clock = Clock(device)
    results = measure_interleaved(fns, clock, rounds=args.rounds, warmup=args.warmup, target_sample_s=0.0)

    mb = source[0][0].numel() * source[0][0].element_size() / 2**20
    print(f"prefetch_bench on {environment(device)['device_name']} ({device}), torch {torch.__version__}")
    shape = f"{args.batch}x3x{args.size}x{args.size}"
    print(f"batch {shape} float32 ({mb:.1f} MiB) + labels, {args.steps} steps per pass, {args.rounds} rounds")
    print(f"Prefetcher output checked against the source: {'ok' if check_ok else 'MISMATCH'}")
    if device.type != "cuda":
        print("(CPU: the Prefetcher is a pass-through; these numbers check the script, they measure no overlap)")
    baseline = results[".to(device), pageable"].stats.median_ms / args.steps
    print(f"\n{'variant':<38} {'ms/step':>9} {'p10':>8} {'p90':>8} {'vs .to(device)':>15}")
    rows = []
    for name, measurement in results.items():
        stats = measurement.stats
        per_step = stats.median_ms / args.steps
        print(
            f"{name:<38} {per_step:>9.3f} {stats.p10_ms / args.steps:>8.3f} {stats.p90_ms / args.steps:>8.3f}"
            f" {baseline / per_step:>14.2f}x"
        )
        rows.append(
            {
                "name": name,
                "ms_per_step": {k: v / args.steps for k, v in stats.to_dict().items()},
                "speedup_vs_to_device": baseline / per_step,
                "samples_ms_per_pass": measurement.samples_ms,
            }
        )
    if args.out is not None:
        report: dict[str, Any] = {
            "schema": SCHEMA,
            "environment": environment(device),
            "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "batch_mib": mb,
            "check": "ok" if check_ok else "MISMATCH",
            "rows": rows,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0 if check_ok else 1


if __name__ == "__main__":
    sys.exit(main())
