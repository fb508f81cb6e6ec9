# Eager against the wrapped model (executor="serial") for N small custom modules (an
# affine map and a ReLU: fused by vmap, having no kernel of their own) summed, at two
# input sizes; CPU seconds of the calling thread, median of 30 calls, 1 thread.
#   python vmap_cost.py            # the library's rule (builders.VMAP_MIN_MEMBERS, ...)
#   python vmap_cost.py --always   # a vmap kernel for any group (the rule before)
import statistics
import sys
import time

import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion import builders

torch.set_num_threads(1)
if "--always" in sys.argv:
    builders.VMAP_MIN_MEMBERS, builders.VMAP_MAX_CPU_ELEMENTS = 2, float("inf")


class Affine(nn.Module):
    def __init__(self, c=32):
        super().__init__()
        self.w = nn.Parameter(torch.ones(c))
        self.b = nn.Parameter(torch.zeros(c))

    def forward(self, x):
        return torch.relu(x * self.w[:, None, None] + self.b[:, None, None])


class Sum(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.a = nn.ModuleList(Affine() for _ in range(n))

    def forward(self, x):
        return sum(m(x) for m in self.a)


for shape in ((1, 32, 2, 2), (2, 32, 16, 16)):
    for n in (2, 8, 64, 256):
        torch.manual_seed(0)
        model = Sum(n).eval()
        x = torch.randn(*shape)
        sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=(Affine,))
        with torch.no_grad():
            for _ in range(3):
                sm(x)
            fused = [g.kernel for g in sm.plan.fused_groups]
            eager, wrapped = [], []
            for _ in range(30):
                t = time.thread_time()
                model(x)
                eager.append(time.thread_time() - t)
                t = time.thread_time()
                sm(x)
                wrapped.append(time.thread_time() - t)
        e, w = statistics.median(eager), statistics.median(wrapped)
        print(
            f"{str(shape):16} N={n:4d} fused={fused or '-'} "
            f"eager {e * 1e6:8.0f} us wrapped {w * 1e6:8.0f} us  eager/wrapped {e / w:.2f}"
        )
