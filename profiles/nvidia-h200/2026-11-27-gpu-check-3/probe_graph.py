"""Inception3 batch 1 with cuda_graph=True: the path and wall time of each of 40 calls
(run from the project root on the GPU machine; output in probe_graph.log)."""

import collections
import time
import warnings

import torch

import streamsched as ss
from benchmarks.zoo import Inception3

warnings.simplefilter("always")
m = Inception3().cuda().eval()
for cfg in [dict(cuda_graph=True), dict(cuda_graph=True, executor="serial")]:
    sm = ss.StreamScheduledModule(m, **cfg)
    x = torch.randn(1, 3, 299, 299, device="cuda")
    paths = collections.Counter()
    times = []
    with torch.no_grad():
        for i in range(40):
            torch.cuda.synchronize()
            t = time.perf_counter()
            sm(x)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1e3)
            paths[sm._ss.last_path] += 1
            if i < 12 or times[-1] > 5:
                print(i, sm._ss.last_path, round(times[-1], 2))
    print(cfg, paths, "median", sorted(times)[20])
    print(sm.plan.notes if hasattr(sm.plan, "notes") else "")
