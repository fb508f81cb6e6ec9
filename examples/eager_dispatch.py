"""Eager dispatch: a model torch.fx cannot trace, with its towers still run side by side.

The forward below routes its input by a value it reads from the data (``if x.mean() > 0``)
and decides how many refinement towers to run with ``.item()``: no tracer can turn that into
a graph. With ``strict=False`` the wrapper runs the model's own forward and launches every
``@streamsched.branch`` call on a CPU lane (or a CUDA stream), so the towers of one call
overlap. The example checks the result against eager PyTorch on fresh random inputs, prints
the plan of the last call and times both.

    python examples/eager_dispatch.py [--towers 4] [--width 512] [--batch 256] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from _timing import add_threads_option, apply_threads, cpu_threads, threads_note, time_variants  # noqa: E402

import streamsched as ss  # noqa: E402


class Tower(nn.Module):
    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.GELU())])

    @ss.branch
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class RoutedTowers(nn.Module):
    """Two sets of towers chosen by the sign of the input's mean, then up to ``towers``
    refinement towers, as many as a value read from the data says."""

    def __init__(self, towers: int, width: int):
        super().__init__()
        self.up = nn.ModuleList(Tower(width, 3) for _ in range(towers))
        self.down = nn.ModuleList(Tower(width, 2) for _ in range(towers))
        self.refine = nn.ModuleList(Tower(width, 1) for _ in range(towers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        towers = self.up if x.mean() > 0 else self.down
        h = torch.stack([t(x) for t in towers]).sum(0)
        extra = 1 + int(h.abs().mean().item() * 100) % len(self.refine)
        h = h + torch.stack([t(h) for t in self.refine[:extra]]).sum(0)
        return self.head(h)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--towers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = RoutedTowers(args.towers, args.width).eval().to(device)
    sm = ss.StreamScheduledModule(model, strict=False)
    print(f"streamsched {ss.__version__}, torch {torch.__version__}, device {device}, {cpu_threads()}")
    print(f"{args.towers} towers of width {args.width}, batch {args.batch}; routed by the data, not traceable")

    with torch.no_grad():
        errors = []
        for sign in (1, -1, 1, -1):  # both routes, fresh random inputs each time
            x = sign * (torch.rand(args.batch, args.width, device=device) + 0.01)
            errors.append(float((sm(x) - model(x)).abs().max()))
        x = torch.rand(args.batch, args.width, device=device)
        times = time_variants(
            {"eager": lambda: model(x), "streamsched": lambda: sm(x)}, device, rounds=args.rounds, inner=3
        )
    print(sm.plan)  # the last call's: after the timing runs, "auto" has settled how to run branches
    print(f"max abs error vs eager: {max(errors):.2e} over {len(errors)} random inputs (both routes)")
    print(f"eager       {times['eager']:8.2f} ms per forward (median of {args.rounds} rounds)")
    print(
        f"streamsched {times['streamsched']:8.2f} ms per forward -> {times['eager'] / times['streamsched']:.2f}x "
        f"({threads_note(device)})"
    )
    if max(errors) > 1e-4:
        raise SystemExit("MISMATCH: the eager-dispatched model does not match eager")


if __name__ == "__main__":
    main()
