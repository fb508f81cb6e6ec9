# The planning call of ParallelFCN(1000), batch 1, 1 thread, in this (fresh) process, with
# TREE's streamsched: python calibrate.py TREE [--collect | --nogc]. Runs in trees of any
# age (before the first call of an inference structure ran as written, the first call
# planned), so that the issue's own tree can be timed beside this one on one machine.
# --collect runs gc.collect() right before the call; --nogc also disables the collector
# for it (the work alone); neither: the call right after the model is built, as a
# user's. Prints one JSON line: the call's CPU seconds and whether it fused the members.
import gc
import json
import sys
import time
import warnings

# TREE's package, not an editable install's (whose finder would answer first).
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import torch  # noqa: E402

import streamsched as ss  # noqa: E402

try:
    from streamsched.planning import signatures

    signatures.FIRST_CALL_AS_WRITTEN = False  # (the call that plans, as it was measured)
except ImportError:  # a tree from before it
    pass
from benchmarks.zoo import ParallelFCN  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
model = ParallelFCN(1000).eval()
x = torch.randn(1, 1000 * 20)
sm = ss.StreamScheduledModule(model)
if "--collect" in sys.argv or "--nogc" in sys.argv:
    gc.collect()
if "--nogc" in sys.argv:
    gc.disable()
with torch.no_grad():
    cpu = time.thread_time()
    out = sm(x)
    cpu = time.thread_time() - cpu
    assert torch.allclose(out, model(x), atol=1e-5)
print(json.dumps({"tree": sys.argv[1], "cpu_s": round(cpu, 4), "fused": len(sm.plan.fused_groups)}))
