"""More distinct sizes than a call structure's table of sizes seen holds (1024).

A tiny model (``benchmarks/dynamic_bench.py``'s TwoBranches, about 100 us a call here),
inference, a batch and a length that both vary: 1,100 distinct shapes fill the table,
then 1,900 more, each new, are timed in 5 chunks of 380 calls, eager then wrapped per
chunk (eager meets each shape first: the wrapped calls find ATen's caches warm for it),
one intra-op thread, CPU time of the calling thread, fastest chunk of each. The tree to
measure is ``$TREE`` (default: the checkout this file is in).
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.environ.get("TREE", ROOT))
sys.path.insert(1, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from dynamic_bench import TwoBranches  # noqa: E402

import streamsched as ss  # noqa: E402
from streamsched.testing import last_path  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    model = TwoBranches().eval()
    sm = ss.StreamScheduledModule(model)
    shapes = [(1 + i % 16, 1 + i // 16, 16) for i in range(1, 3000)]
    for shape in shapes[:1100]:
        sm(torch.randn(*shape))
    xs = [torch.randn(*shape) for shape in shapes[1100:]]
    times: dict[str, list[float]] = {"eager": [], "wrapped": []}
    for r in range(5):
        chunk = xs[r * 380 : (r + 1) * 380]
        for name, f in (("eager", model), ("wrapped", sm)):
            start = time.thread_time_ns()
            for x in chunk:
                f(x)
            times[name].append((time.thread_time_ns() - start) / len(chunk) / 1e3)
    eager, wrapped = min(times["eager"]), min(times["wrapped"])
    print(
        f"{ss.__file__}: eager {eager:.1f} us, wrapped {wrapped:.1f} us a call ({last_path(sm)}), "
        f"extra {wrapped - eager:.1f} us"
    )


if __name__ == "__main__":
    main()
