"""ParallelFCN(1000)'s training step at batch 64 in a process that holds only the two
stacked models: ``fused_parameters()`` and the hand-written ``StackedFCN``, SGD with
momentum, blocks of 3 steps each, interleaved; CPU time of the calling thread and the
process's minor page faults per step.

    python profiles/cpu/train-memory/two_models.py [rounds] [--heap-fixed]

``--heap-fixed`` sets glibc's malloc trim and mmap thresholds first (as
``benchmarks/train_step_breakdown.py --heap fixed`` does).
"""

import copy
import resource
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.train_step_breakdown import fix_heap  # noqa: E402
from benchmarks.zoo import ParallelFCN, StackedFCN  # noqa: E402

if "--heap-fixed" in sys.argv:
    fix_heap()
rounds = int(next((a for a in sys.argv[1:] if a.isdigit()), 12))
torch.set_num_threads(1)
torch.manual_seed(0)
base = ParallelFCN(1000).train()
x, target = torch.randn(64, 20000), torch.randn(64, 1000)
sm = ss.StreamScheduledModule(copy.deepcopy(base), executor="serial")
with torch.no_grad():
    sm(x)
hand = StackedFCN(base)
models = {"streamsched stacked": (sm, sm.fused_parameters()), "hand-written stacked": (hand, list(hand.parameters()))}
optimizers = {name: torch.optim.SGD(params, lr=1e-3, momentum=0.9) for name, (_, params) in models.items()}


def step(name: str) -> None:
    model, opt = models[name][0], optimizers[name]
    opt.zero_grad()
    F.mse_loss(model(x), target).backward()
    opt.step()


for name in models:
    for _ in range(3):
        step(name)
samples: dict = {name: [] for name in models}
for _ in range(rounds):
    for name in models:
        faults, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.thread_time()
        for _ in range(3):
            step(name)
        ms = (time.thread_time() - t0) / 3 * 1e3
        samples[name].append((ms, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / 3))
print(f"heap {'fixed' if '--heap-fixed' in sys.argv else 'default'}; {rounds} rounds of 3 steps; 1 thread; CPU ms/step")
for name, rows in samples.items():
    times = sorted(t for t, _ in rows)
    faults = sorted(f for _, f in rows)
    median_ms, median_faults = times[len(times) // 2], faults[len(faults) // 2]
    print(f"  {name:22s} median {median_ms:.2f}  min {times[0]:.2f}  faults/step median {median_faults:.0f}")
