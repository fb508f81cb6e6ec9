"""Alike heads beside other ones, all reading one tensor: eager against the serial plan.

``Branchy`` is ``benchmarks/dynamic_bench.py``'s model (four alike MLPs and two other
branches); ``MixedHeads`` eight alike two-layer heads and two others. Their first
layers run as one wide Linear; the alike heads' activations read their part of its
output. One intra-op thread, ``no_grad``, CPU time of the calling thread per call: the
fastest and the median of 31 rounds of 200 calls, eager and the plan interleaved. Run
with the tree to measure first on ``sys.path``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

# Branchy is the dynamic benchmark's model (this checkout's benchmarks/, after the tree
# measured on sys.path).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
from dynamic_bench import Branchy  # noqa: E402


class MixedHeads(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 4)) for _ in range(8))
        self.value = nn.Sequential(nn.Linear(d, 16), nn.Tanh(), nn.Linear(16, 1))
        self.aux = nn.Sequential(nn.Linear(d, 48), nn.GELU(), nn.Linear(48, 2))

    def forward(self, x):
        return [h(x) for h in self.heads], self.value(x), self.aux(x)


def per_call_us(f, x, calls: int = 200) -> float:
    start = time.thread_time_ns()
    for _ in range(calls):
        f(x)
    return (time.thread_time_ns() - start) / calls / 1e3


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    print(f"streamsched from {ss.__file__}, torch {torch.__version__}, 1 thread")
    for make, width, rows in ((Branchy, 16, 8), (Branchy, 16, 64), (MixedHeads, 32, 16), (MixedHeads, 32, 128)):
        torch.manual_seed(0)
        model = make().eval()
        sm = ss.StreamScheduledModule(model, executor="serial")
        x = torch.randn(rows, width)
        for _ in range(3):
            sm(x)
        assert last_path(sm) == "plan:serial", last_path(sm)
        kernels = [g.kernel for g in sm.plan.fused_groups]
        eager, plan = [], []
        for _ in range(31):
            eager.append(per_call_us(model, x))
            plan.append(per_call_us(sm, x))
        print(
            f"{make.__name__:10s} {rows:4d} rows: eager {min(eager):6.1f} / {statistics.median(eager):6.1f} us, "
            f"plan {min(plan):6.1f} / {statistics.median(plan):6.1f} us (fastest / median); groups {kernels}"
        )


if __name__ == "__main__":
    sys.exit(main())
