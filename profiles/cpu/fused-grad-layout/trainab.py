"""CPU time of a training step, the model as written against the wrapper, interleaved.

    PYTHONPATH=<tree> python profiles/cpu/fused-grad-layout/trainab.py MODEL ROUNDS ['{"executor": "serial"}']

MODEL is a case of benchmarks/real_models_bench.py (mlp_x16, qwen2_moe, ...), built and
derandomized as there; a step is its forward, ``training_loss``, ``backward()``,
``SGD(lr=1e-3, momentum=0.9).step()`` and ``zero_grad(set_to_none=True)``, timed phase by
phase with ``time.thread_time`` after 12 warm-up steps each; the two alternate in each
round (order flipped every round). Prints the medians per phase and the median of the
per-round ratios eager / wrapper (above 1: the wrapper's step is faster). streamsched is
imported from PYTHONPATH, so one script times two trees.
"""

import copy
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.append(str(ROOT))

import real_models_bench as rmb  # noqa: E402
import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from streamsched.testing import last_path  # noqa: E402

warnings.simplefilter("ignore")
torch.set_num_threads(1)
name, rounds = sys.argv[1], int(sys.argv[2])
opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
case = rmb.BY_NAME[name]
torch.manual_seed(0)
model = rmb.derandomize(case.build())
args, kwargs = case.inputs(0)
eager = copy.deepcopy(model).train()
sm = ss.StreamScheduledModule(copy.deepcopy(model).train(), **opts)
variants = {"eager": (eager, eager), "ss": (sm, sm.module)}
optims = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for k, (_, m) in variants.items()}
T = time.thread_time


def step(k):
    mod, opt = variants[k][0], optims[k]
    t0 = T()
    loss = rmb.training_loss(mod(*args, **kwargs))
    t1 = T()
    loss.backward()
    t2 = T()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = T()
    return t1 - t0, t2 - t1, t3 - t2, t3 - t0


for k in variants:
    for _ in range(12):
        step(k)
groups = len(sm._ss.fusion._stacks) if sm._ss.fusion else 0
print(f"{name} {opts} streamsched {Path(ss.__file__).parent}; path {last_path(sm)}; stacks {groups}")
res = {k: [] for k in variants}
for r in range(rounds):
    for k in list(variants) if r % 2 == 0 else list(variants)[::-1]:
        res[k].append(step(k))
for k, v in res.items():
    med = [statistics.median(c) * 1e3 for c in zip(*v)]
    print(f"  {k:6s} CPU ms median: fwd {med[0]:.2f} bwd {med[1]:.2f} opt {med[2]:.2f} step {med[3]:.2f}")
ratio = statistics.median(a[3] / b[3] for a, b in zip(res["eager"], res["ss"]))
print(f"  per-round eager/ss step ratio, median: {ratio:.3f}")
