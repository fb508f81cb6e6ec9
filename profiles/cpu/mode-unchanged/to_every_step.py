"""``sm.to(device)`` before every inference step of a model already on that device:
ParallelFCN(1000), 16 rows, ``no_grad``, one intra-op thread; wall time of the call
after the ``to()`` (the ``to()`` itself timed apart), median of 9 steps after 8 warm-up
calls, and the path the last call ran.

    python profiles/cpu/mode-unchanged/to_every_step.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import ParallelFCN  # noqa: E402
from streamsched.testing import last_path  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
model = ParallelFCN(1000).eval()
sm = ss.StreamScheduledModule(model)
x = torch.randn(16, 20000)
with torch.no_grad():
    for _ in range(8):
        sm(x)
    rows = {}
    for label, before in (("no to()", lambda: None), ("sm.to('cpu') before", lambda: sm.to("cpu"))):
        calls, conversions = [], []
        for _ in range(9):
            t0 = time.perf_counter()
            before()
            t1 = time.perf_counter()
            sm(x)
            t2 = time.perf_counter()
            conversions.append(t1 - t0)
            calls.append(t2 - t1)
        rows[label] = (statistics.median(calls) * 1e3, statistics.median(conversions) * 1e3, last_path(sm))
    eager = []
    for _ in range(5):
        t0 = time.perf_counter()
        model(x)
        eager.append(time.perf_counter() - t0)
print(
    ss.__file__
    + ": "
    + "; ".join(f"{k}: call {c:.1f} ms ({p}), to() {t:.1f} ms" for k, (c, t, p) in rows.items())
    + f"; eager call {statistics.median(eager) * 1e3:.1f} ms"
)
