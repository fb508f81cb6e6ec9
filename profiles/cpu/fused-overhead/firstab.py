# First call of ParallelFCN(1000): wall and CPU seconds per fresh model (see README.md).
import gc
import sys
import time
import warnings

import torch

import streamsched as ss
from benchmarks.zoo import ParallelFCN

warnings.simplefilter("ignore")
torch.set_num_threads(1)
print(ss.__file__, ss._native.native() is not None)
for _ in range(int(sys.argv[1])):
    m = ParallelFCN(1000).eval()
    x = torch.randn(1, m.n * m.d_in)
    sm = ss.StreamScheduledModule(m)
    gc.collect()
    t = time.perf_counter()
    t2 = time.thread_time()
    with torch.no_grad():
        sm(x)
    print(f"wall {time.perf_counter() - t:.3f} cpu {time.thread_time() - t2:.3f}")
    del sm, m
