"""Compare two source trees of streamsched on the same CPU cases, in interleaved rounds.

    .venv/bin/python benchmarks/tree_compare.py --tree /tmp/old --tree . [--rounds 7]

For a change that should not move performance (a restructuring): each round runs one
child process per tree, in alternating order, and each child times every case (the
fastest of several loops of calls, one intra-op thread), wrapped and eager. Printed: per
case, the median over the rounds of each tree's wrapped time, the ratio of the second
tree to the first, and each tree's median speed-up over eager (so machine drift, which
moves both, shows apart from a real change). Build the extension in each tree first, or
set ``STREAMSCHED_DISABLE_EXT=1`` for both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

CASES = [
    "linear call",
    "ParallelFCN(100) b1",
    "3 branches threads",
    "Inception3 b1 149px",
    "ParallelFCN(100) b64 train",
]


def _zoo() -> Any:
    try:
        import benchmarks.zoo as zoo  # this layout
    except ImportError:  # an older tree: the zoo lived in the package
        import streamsched.models as zoo  # type: ignore[no-redef]
    return zoo


def _best(fn: Callable[[], Any], calls: int, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def child() -> None:
    import torch
    from torch import nn

    import streamsched as ss

    torch.set_num_threads(1)
    torch.manual_seed(0)
    zoo = _zoo()

    class ThreeBranches(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.branches = nn.ModuleList(
                nn.Sequential(*[m for _ in range(3) for m in (nn.Linear(384, 384), nn.ReLU())]) for _ in range(3)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return sum(b(x) for b in self.branches)

    results: dict[str, dict[str, float]] = {}

    def case(name: str, model: nn.Module, make: Callable[[], tuple], calls: int, train: bool = False, **cfg: Any):
        sm = ss.StreamScheduledModule(model, **cfg)
        inputs = make()
        if train:

            def step(m: nn.Module) -> Callable[[], None]:
                def run() -> None:
                    m.zero_grad(set_to_none=True)
                    m(*inputs).sum().backward()

                return run

            eager_fn, wrapped_fn = step(model), step(sm)
        else:

            def eager_fn() -> Any:
                with torch.no_grad():
                    return model(*inputs)

            def wrapped_fn() -> Any:
                with torch.no_grad():
                    return sm(*inputs)

        for _ in range(20):  # planning, the auto trial, warm-up
            wrapped_fn()
        eager_fn()
        results[name] = {"wrapped_us": _best(wrapped_fn, calls), "eager_us": _best(eager_fn, calls)}

    case("linear call", nn.Linear(4, 4), lambda: (torch.randn(2, 4),), 2000, executor="serial")
    case("ParallelFCN(100) b1", zoo.ParallelFCN(100).eval(), lambda: (torch.randn(1, 2000),), 50)
    case("3 branches threads", ThreeBranches().eval(), lambda: (torch.randn(256, 384),), 20, executor="threads")
    case("Inception3 b1 149px", zoo.Inception3().eval(), lambda: (torch.randn(1, 3, 149, 149),), 3)
    case("ParallelFCN(100) b64 train", zoo.ParallelFCN(100).train(), lambda: (torch.randn(64, 2000),), 10, train=True)
    print(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", required=True, help="a source tree (twice)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child()
        return
    trees = [str(Path(t).resolve()) for t in args.tree]
    assert len(trees) == 2, "give --tree twice"
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--tree", tree, "--tree", tree, "--child"],
                cwd=tree,
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            runs[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    a, b = trees
    print(f"A = {a}\nB = {b}\n{args.rounds} interleaved rounds, 1 intra-op thread; medians over rounds\n")
    print("| case | A wrapped us | B wrapped us | B / A | A speed-up over eager | B speed-up over eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in CASES:
        wa = statistics.median(r[name]["wrapped_us"] for r in runs[a])
        wb = statistics.median(r[name]["wrapped_us"] for r in runs[b])
        sa = statistics.median(r[name]["eager_us"] / r[name]["wrapped_us"] for r in runs[a])
        sb = statistics.median(r[name]["eager_us"] / r[name]["wrapped_us"] for r in runs[b])
        print(f"| {name} | {wa:.1f} | {wb:.1f} | {wb / wa:.3f} | {sa:.3f}x | {sb:.3f}x |")


if __name__ == "__main__":
    main()
