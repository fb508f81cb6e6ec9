"""What one wrapped call costs besides the model's work, in microseconds.

    STREAMSCHED_DISABLE_EXT=1 .venv-cuda/bin/python benchmarks/call_overhead_micro.py

(the transformers and timm rows need ``.venv-cuda``; run it with ``PYTHONPATH`` pointing
at another checkout's tree, from outside this one, to compare two versions). Prints:

- a ``Linear(4, 4)`` called positionally, and a module called with keywords that
  returns a dict, eager and wrapped (``executor="serial"``): the difference is the
  wrapper's fixed cost per call;
- for GPT-2, Mixtral and ViT-tiny (the models of ``real_models_bench.py``): the time to
  bind one call's arguments, how often one call moves the module generation (each move
  makes the next call re-check the model's structure), and what one such re-check costs.

Each figure is the fastest of 9 repetitions of a loop of calls, one intra-op thread.
"""

from __future__ import annotations

import copy
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import streamsched as ss
from streamsched import _generation

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_models_bench as rmb  # noqa: E402


def bench(fn: Callable[[], Any], n: int = 2000, reps: int = 9) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n)
    return best * 1e6


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, output_attentions=None, return_dict=None):
        return {"logits": self.lin(input_ids)}


def main() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"streamsched from {Path(ss.__file__).parent}")
    x = torch.randn(2, 4)
    with torch.no_grad():
        lin = nn.Linear(4, 4).eval()
        kw = Keywords().eval()
        s_lin = ss.StreamScheduledModule(copy.deepcopy(lin), executor="serial")
        s_kw = ss.StreamScheduledModule(copy.deepcopy(kw), executor="serial")
        for _ in range(5):
            s_lin(x)
            s_kw(input_ids=x, use_cache=False)
        e, w = bench(lambda: lin(x)), bench(lambda: s_lin(x))
        print(f"Linear(4, 4), positional: eager {e:.1f} us, wrapped {w:.1f} us, overhead {w - e:.1f} us")
        e, w = bench(lambda: kw(input_ids=x, use_cache=False)), bench(lambda: s_kw(input_ids=x, use_cache=False))
        print(f"keywords, dict output:    eager {e:.1f} us, wrapped {w:.1f} us, overhead {w - e:.1f} us")
        for name in ("gpt2", "mixtral", "vit_tiny_patch16_224"):
            case = rmb.BY_NAME[name]
            torch.manual_seed(0)
            model = case.build().eval()
            args, kwargs = case.inputs(1)
            sm = ss.StreamScheduledModule(model, executor="serial")
            for _ in range(3):
                sm(*args, **kwargs)
            st = sm._ss
            bind = getattr(st, "bind", st.binder.bind)
            b = bench(lambda bind=bind, args=args, kwargs=kwargs: bind(args, kwargs))
            r = bench(sm._revalidate, 200, 5)
            before = _generation.current()
            sm(*args, **kwargs)
            moved = _generation.current() - before
            print(f"{name}: bind {b:.2f} us; generation moves per call: {moved}; one structure re-check {r:.1f} us")


if __name__ == "__main__":
    main()
