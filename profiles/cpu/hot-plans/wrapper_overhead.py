"""The wrapper's own cost per call of a plan that runs as one function, and the critics
ensemble against the hand-written stacked ``baddbmm``, in CPU time of the calling thread
(one intra-op thread; the fastest of ``ROUNDS`` interleaved rounds of 5 repetitions).

    python profiles/cpu/hot-plans/wrapper_overhead.py [ROUNDS]

Run it with another checkout's ``streamsched`` first on ``sys.path`` to compare trees.
Prints, for ``CriticEnsemble(2, obs=3, hidden=4)`` at 16 rows (kernels of a few
microseconds: the call is mostly the wrapper's), the wrapped call minus its plan's program
called directly (``overhead``), and for ``CriticEnsemble(32)`` at 16 rows the wrapped call
beside ``HandStackedCritics`` and their ratio.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path

import torch

import streamsched as ss
from streamsched.testing import last_path

sys.path.append(str(Path(__file__).resolve().parents[3]))
from benchmarks.zoo import CriticEnsemble, HandStackedCritics  # noqa: E402


def bench(fn, n: int, reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n)
    return best * 1e6


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    res: dict[str, float] = {}
    with torch.no_grad():
        tiny = CriticEnsemble(2, 3, 4).eval()
        xt = torch.randn(16, 3)
        st = ss.StreamScheduledModule(copy.deepcopy(tiny), executor="serial")
        big = CriticEnsemble(32).eval()
        xb = torch.randn(16, 23)
        sb = ss.StreamScheduledModule(copy.deepcopy(big), executor="serial")
        hand = HandStackedCritics(big)
        for _ in range(5):
            st(xt)
            sb(xb)
        assert last_path(st) == last_path(sb) == "plan:serial"
        torch.testing.assert_close(st(xt), tiny(xt))
        torch.testing.assert_close(sb(xb), hand(xb), rtol=1e-4, atol=1e-5)
        entry = st._ss.last
        program = entry.program.call
        cases = [
            ("tiny", lambda: st(xt), 3000),
            ("tiny program", lambda: entry.rebuild(program([xt])), 3000),
            ("critics", lambda: sb(xb), 1000),
            ("hand", lambda: hand(xb), 1000),
        ]
        for _ in range(rounds):
            for name, fn, n in cases:
                res[name] = min(res.get(name, float("inf")), bench(fn, n))
    print(
        f"streamsched from {Path(ss.__file__).parent}: overhead {res['tiny'] - res['tiny program']:.2f} us "
        f"(tiny {res['tiny']:.2f} us, its program {res['tiny program']:.2f} us); critics {res['critics']:.1f} us, "
        f"hand-written {res['hand']:.1f} us, ratio {res['critics'] / res['hand']:.3f}"
    )


if __name__ == "__main__":
    main()
