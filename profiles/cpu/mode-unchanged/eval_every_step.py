"""``model.eval()`` at the top of every inference step of a model already in eval mode:
the wrapper's call after it, against the same call with no ``eval()`` before it, and
the model's own calls the same two ways.
CriticEnsemble(32), 16 rows, under ``no_grad``, one intra-op thread, CPU time of the
calling thread (the ``eval()`` itself timed apart), median of 7 rounds of 300 steps.

    python profiles/cpu/mode-unchanged/eval_every_step.py
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
model = CriticEnsemble(32).eval()
sm = ss.StreamScheduledModule(model)
x = torch.randn(16, 23)


def steps(f, eval_first: bool, n: int = 300) -> float:
    """CPU microseconds per call of ``f(x)`` (an ``eval()`` of it before each, untimed, or none)."""
    total = 0.0
    for _ in range(n):
        if eval_first:
            f.eval()
        t0 = time.thread_time()
        f(x)
        total += time.thread_time() - t0
    return total / n * 1e6


with torch.no_grad():
    for _ in range(20):
        sm(x)
    rows: dict = {"wrapped": [], "wrapped after eval()": [], "eager": [], "eager after eval()": []}
    for _ in range(7):
        rows["wrapped"].append(steps(sm, False))
        rows["wrapped after eval()"].append(steps(sm, True))
        rows["eager"].append(steps(model, False, n=60))
        rows["eager after eval()"].append(steps(model, True, n=60))
print(ss.__file__ + ": " + "; ".join(f"{name} {statistics.median(v):.0f} us" for name, v in rows.items()))
