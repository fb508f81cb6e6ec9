"""The fused plan (``executor="serial"``, no_grad, asserted to run the plan) beside the
model rewritten by hand with stacked weights, CPU time of the calling thread, one
intra-op thread, min over interleaved rounds:

    .venv/bin/python profiles/cpu/transposed-layout/fused_vs_hand.py

``CriticEnsemble(32)`` at 16 rows against ``benchmarks.zoo.HandStackedCritics``
(weights stored ``[N, in, out]``), ``ParallelFCN(1000)`` at 1, 16 and 64 rows against
``StackedFCN``. To time another tree, put it first on ``sys.path`` (see the README).
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.append(str(ROOT))
sys.path.append(str(ROOT / "benchmarks"))


import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble, HandStackedCritics, ParallelFCN, StackedFCN  # noqa: E402
from streamsched.testing import last_path  # noqa: E402


def best_us(fn, n: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n)
    return best * 1e6


def row(label: str, model, hand, x, n: int, rounds: int = 3) -> str:
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    with torch.no_grad():
        for _ in range(4):
            sm(x)
        assert last_path(sm) == "plan:serial", last_path(sm)
        fresh = torch.randn(x.shape)
        torch.testing.assert_close(sm(fresh), model(fresh), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(hand(fresh), model(fresh), rtol=1e-4, atol=1e-5)
        fused = written = float("inf")
        for _ in range(rounds):
            fused = min(fused, best_us(lambda: sm(x), n))
            written = min(written, best_us(lambda: hand(x), n))
    kernels = [g.kernel for g in sm.plan.fused_groups if "Linear" in g.kind or "linear" in g.kernel]
    return f"{label}: fused {fused:.0f} us, hand-written {written:.0f} us, {fused / written:.2f}x  {kernels}"


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"streamsched from {Path(ss.__file__).parent}")
    critics = CriticEnsemble(32).eval()
    print(row("CriticEnsemble(32), 16 rows", critics, HandStackedCritics(critics), torch.randn(16, 23), 1000))
    fcn = ParallelFCN(1000).eval()
    hand = StackedFCN(fcn)
    for rows, n in ((1, 300), (16, 100), (64, 60)):
        print(row(f"ParallelFCN(1000), {rows} rows", fcn, hand, torch.randn(rows, 20000), n))


if __name__ == "__main__":
    main()
