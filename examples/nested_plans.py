"""Nested plans: a forward torch.fx cannot trace, whose blocks are still scheduled.

The model below checks its input's values in its own forward (``if x.abs().max() > clip``),
as library code does with attention masks: fx cannot trace that, so the forward runs as
written. Its blocks are ordinary modules (an ensemble of heads each), and each gets a
plan of its own while the forward runs: the heads of a block become one batched kernel.
No decorator is needed. The example checks outputs against eager PyTorch on fresh random
inputs, prints each nested plan's summary and the coverage (the share of the forward's
leaf-module calls that run as tasks of a plan), and times both.

    python examples/nested_plans.py [--blocks 4] [--heads 16] [--width 128] [--batch 64] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from _timing import add_threads_option, apply_threads, cpu_threads, threads_note, time_variants  # noqa: E402

import streamsched as ss  # noqa: E402


class HeadsBlock(nn.Module):
    """``heads`` small MLPs reading one tensor, averaged: one fused group when traced."""

    def __init__(self, heads: int, width: int):
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width // 2), nn.ReLU(), nn.Linear(width // 2, width)) for _ in range(heads)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.stack([h(x) for h in self.heads]).mean(0)


class Clipped(nn.Module):
    """Blocks behind a value check in the forward itself: untraceable as a whole."""

    def __init__(self, blocks: int, heads: int, width: int, clip: float = 50.0):
        super().__init__()
        self.blocks = nn.ModuleList(HeadsBlock(heads, width) for _ in range(blocks))
        self.head = nn.Linear(width, 10)
        self.clip = clip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if x.abs().max() > self.clip:  # a value check: fx cannot trace it
                x = x.clamp(-self.clip, self.clip)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    device = torch.device(args.device)

    torch.manual_seed(0)
    model = Clipped(args.blocks, args.heads, args.width).eval().to(device)
    with warnings.catch_warnings():
        # The forward cannot be traced: said once, as an UntraceableWarning.
        warnings.simplefilter("ignore", ss.UntraceableWarning)
        sm = ss.StreamScheduledModule(model)
        print(f"streamsched {ss.__version__}, torch {torch.__version__}, device {device}, {cpu_threads()}")
        print(f"{args.blocks} blocks of {args.heads} heads, width {args.width}, batch {args.batch}")
        with torch.no_grad():
            errors = []
            for _ in range(4):  # fresh random inputs; the first calls plan the blocks
                x = torch.randn(args.batch, args.width, device=device)
                errors.append(float((sm(x) - model(x)).abs().max()))
            x = torch.randn(args.batch, args.width, device=device)
            times = time_variants(
                {"eager": lambda: model(x), "streamsched": lambda: sm(x)}, device, rounds=args.rounds, inner=3
            )
    plan = sm.plan
    print(f"the model's own forward: {plan.mode}, {plan.executor}")
    for path, nested in sm.nested_plans.items():
        groups = ", ".join(f"{g.kind} x{g.size}" for g in nested.fused_groups) or "none"
        print(f"  nested plan of {path}: {len(nested.tasks)} tasks, executor {nested.executor}, fused: {groups}")
    print(plan.coverage_text())
    print(f"max abs error vs eager: {max(errors):.2e} over {len(errors)} random inputs")
    print(f"eager       {times['eager']:8.2f} ms per forward (median of {args.rounds} rounds)")
    print(
        f"streamsched {times['streamsched']:8.2f} ms per forward -> {times['eager'] / times['streamsched']:.2f}x "
        f"({threads_note(device)})"
    )
    if max(errors) > 1e-4:
        raise SystemExit("MISMATCH: the wrapped model does not match eager")


if __name__ == "__main__":
    main()
