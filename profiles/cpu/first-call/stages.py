# CPU seconds of each stage of the first two calls (as written, then planned) of
# ParallelFCN(1000), batch 1, 1 thread, in this (fresh) process: python stages.py TREE
# [--collect]. TREE is the checkout whose streamsched is timed; --collect runs
# gc.collect() before the calls (without it they come right after the model was built,
# as a user's do). Prints one JSON line: the stages, as_written_cpu (the first call),
# planning_cpu (the second, the planning call) and total_cpu (both).
import functools
import gc
import json
import sys
import time
import warnings

sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import torch  # noqa: E402

import streamsched.new_signatures as M  # noqa: E402
import streamsched.passes.fusion.context as C  # noqa: E402
import streamsched.passes.fusion.fuse as F  # noqa: E402
import streamsched.passes.fusion.rewrite as RW  # noqa: E402
import streamsched.planning.plan as PL  # noqa: E402
import streamsched.planning.planner as P  # noqa: E402
from benchmarks.zoo import ParallelFCN  # noqa: E402

torch.set_num_threads(1)
T: dict = {}


def timed(owner, name, label):
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*a, **k):
        start = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            T[label] = T.get(label, 0.0) + time.thread_time() - start

    setattr(owner, name, wrapper)


timed(M, "trace_model", "trace")
timed(M, "run_and_record", "record")
timed(M, "make_schedule", "plan")
timed(M, "compile_program", "compile")
timed(P, "copy_graph", "plan.copy_graph")
# plan.coverage: where the plan is assembled (planning.plan; planning.planner before it).
timed(P if hasattr(P, "traced_coverage") else PL, "traced_coverage", "plan.coverage")
timed(C.FusionContext, "fuse", "plan.fuse")
timed(F, "propose", "plan.fuse.propose")
timed(RW.Rewriter, "emit", "plan.fuse.emit")
torch.manual_seed(0)
model = ParallelFCN(1000).eval()
x = torch.randn(1, 1000 * 20)
import streamsched  # noqa: E402

sm = streamsched.StreamScheduledModule(model)
if "--collect" in sys.argv:
    gc.collect()
with torch.no_grad():
    # An inference structure's first call runs as written (planning.signatures
    # FIRST_CALL_AS_WRITTEN) and its second is the planning call: both are timed.
    wall, cpu = time.perf_counter(), time.thread_time()
    sm(x)
    T["as_written_cpu"] = time.thread_time() - cpu
    out = sm(x)
    T["total_cpu"], T["total_wall"] = time.thread_time() - cpu, time.perf_counter() - wall
    T["planning_cpu"] = T["total_cpu"] - T["as_written_cpu"]
    assert torch.allclose(out, model(x), atol=1e-5)
T["other"] = T["total_cpu"] - sum(T[k] for k in ("trace", "record", "plan", "compile"))
print(json.dumps({k: round(v, 4) for k, v in sorted(T.items())}))
