"""Peak bytes of live activations in one inference call: eager against the serial plan.

A dispatch mode counts each storage an operation returns as live from then until the
last tensor viewing it is freed; the peak over the call is reported (MB). Parameters and
the input are not counted. Run with the tree to measure first on ``sys.path``.

    python peak_live.py
"""

from __future__ import annotations

import os
import sys
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import streamsched as ss
from streamsched.testing import last_path

# Branchy is the dynamic benchmark's model (this checkout's benchmarks/, after the tree
# measured on sys.path).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "benchmarks"))
from dynamic_bench import Branchy  # noqa: E402


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages operations returned that some tensor still views."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self.views: dict[int, int] = {}  # storage pointer -> tensors viewing it

    def _freed(self, ptr: int, nbytes: int) -> None:
        self.views[ptr] -= 1
        if self.views[ptr] == 0:
            del self.views[ptr]
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes == 0:
                    continue
                if ptr not in self.views:
                    self.views[ptr] = 0
                    self.live += nbytes
                    self.peak = max(self.peak, self.live)
                self.views[ptr] += 1
                weakref.finalize(t, self._freed, ptr, nbytes)
        return out


class Elementwise(nn.Module):
    """Two branches of six cheap element-wise steps each: a serial plan coarsens them
    into one task where each step is cheap (small inputs on the CPU; on a GPU, whose
    estimated costs are far smaller, at much larger sizes too)."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.left, self.right = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        a, b = self.left(x), self.right(x)
        for _ in range(6):
            a = torch.tanh(a * 1.5 + 0.1)
            b = torch.sigmoid(b * 0.5 - 0.1)
        return a + b


def peak(f, x) -> float:
    with LiveBytes() as counter:
        f(x)
    return counter.peak / 2**20


def main() -> None:
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    print(f"streamsched from {ss.__file__}, torch {torch.__version__}")
    cases = [(Branchy, 16, rows, fuse) for rows in (256, 4096) for fuse in (False, True)]
    cases += [(Elementwise, 64, rows, True) for rows in (16, 64, 256, 4096)]
    for make, width, rows, fuse in cases:
        model = make().eval()
        sm = ss.StreamScheduledModule(model, executor="serial", fuse=fuse)
        x = torch.randn(rows, width)
        sm(x), sm(x)
        plan_mb = peak(sm, x)
        tasks = len(sm._ss.last.program.tasks)
        print(
            f"{make.__name__:11s} {rows:5d} rows fuse={fuse!s:5}: eager {peak(model, x):7.3f} MB, "
            f"{last_path(sm)} ({tasks:2d} tasks) {plan_mb:7.3f} MB"
        )


if __name__ == "__main__":
    sys.exit(main())
