# One process: CriticEnsemble(32) fused vs hand-written, ParallelFCN(1000) forward (no_grad and with
# autograd), CPU thread time, min of argv[1] rounds (see README.md, section 1b). The streamsched
# imported is the one on PYTHONPATH (run from outside the tree to compare two trees).
import copy
import json
import sys
import time
import warnings
from pathlib import Path

import torch

import streamsched as ss
from streamsched.testing import last_path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.call_overhead_micro import HandStackedCritics  # noqa: E402
from benchmarks.zoo import CriticEnsemble, ParallelFCN  # noqa: E402

warnings.simplefilter("ignore")
torch.set_num_threads(1)


def bench(fn, n, reps):
    best = 1e9
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t) / n)
    return best * 1e6


torch.manual_seed(0)
m = CriticEnsemble(32).eval()
x = torch.randn(16, 23)
sm = ss.StreamScheduledModule(copy.deepcopy(m), executor="serial")
hand = HandStackedCritics(m)
p = ParallelFCN(1000).eval()
xp = torch.randn(1, 20000)
sp = ss.StreamScheduledModule(copy.deepcopy(p), executor="serial")
with torch.no_grad():
    for _ in range(5):
        sm(x)
        sp(xp)
    assert last_path(sm) == "plan:serial" and last_path(sp) == "plan:serial"
    torch.testing.assert_close(sm(x), m(x))
    torch.testing.assert_close(sp(xp), p(xp))
for _ in range(3):  # the autograd signature: recorded, then planned
    sp(xp)
res = {}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    with torch.no_grad():
        res["critics"] = min(res.get("critics", 1e9), bench(lambda: sm(x), 1000, 3))
        res["hand"] = min(res.get("hand", 1e9), bench(lambda: hand(x), 1000, 3))
        res["pfcn_nograd"] = min(res.get("pfcn_nograd", 1e9), bench(lambda: sp(xp), 300, 3))
    res["pfcn_grad"] = min(res.get("pfcn_grad", 1e9), bench(lambda: sp(xp), 200, 3))
res["ratio"] = res["critics"] / res["hand"]
print(ss.__file__)
print(json.dumps({k: round(v, 2) for k, v in res.items()}))
