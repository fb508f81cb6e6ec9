"""The fused ParallelFCN(1000) and the hand-stacked baddbmm at 2 intra-op threads, batch 1,
on three fresh models: best of 5 rounds of 20 calls each. Run from the repository root."""

import sys
import time

import torch

sys.path.insert(0, ".")
import streamsched as ss  # noqa: E402
from benchmarks.zoo.parallel_fcn import ParallelFCN, StackedFCN  # noqa: E402

torch.set_num_threads(2)


def best_ms(f, n=20):
    best = 1e9
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e3


x = torch.randn(1, 20000)
with torch.no_grad():
    for k in range(3):
        torch.manual_seed(k)
        model = ParallelFCN(1000)
        stacked = StackedFCN(model)
        sm = ss.StreamScheduledModule(model, executor="serial")
        for _ in range(3):
            sm(x)
        print(k, f"sm {best_ms(lambda sm=sm: sm(x)):.3f} ms", f"stacked {best_ms(lambda s=stacked: s(x)):.3f} ms")
