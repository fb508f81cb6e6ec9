"""The cost the training trial's emptied hook dicts added to every later step: eager vs
a copy of eager whose parameters carry empty hook dicts (``register_hook`` then
``remove``, what the trial's backward timers left on every parameter), CPU time of the
calling thread, interleaved rounds.

    STREAMSCHED_DISABLE_EXT=1 HF_HUB_OFFLINE=1 .venv-cuda/bin/python \\
        profiles/cpu/real-models-train/fix-ab-cpu/emptied_hook_dicts.py 40 gpt2,bert,mixtral
"""

import copy
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402

from benchmarks.real_models_bench import BY_NAME, derandomize, training_loss  # noqa: E402

torch.set_num_threads(1)


def main(rounds: int, names: list[str]) -> None:
    for name in names:
        case = BY_NAME[name]
        torch.manual_seed(0)
        base = derandomize(case.build()).train()
        args, kwargs = case.inputs(1)
        models = {v: copy.deepcopy(base) for v in ("eager", "copy", "leftover")}
        handles = [p.register_hook(lambda g: None) for p in models["leftover"].parameters()]
        for h in handles:
            h.remove()  # leaves an empty hook dict on every parameter
        opts = {v: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for v, m in models.items()}

        def step(v: str) -> None:
            training_loss(models[v](*args, **kwargs)).backward()
            opts[v].step()
            opts[v].zero_grad(set_to_none=True)

        for v in models:
            for _ in range(3):
                step(v)
        order = list(models)
        cpu: dict[str, list[float]] = {v: [] for v in order}
        for r in range(rounds):
            for v in order[r % 3 :] + order[: r % 3]:
                start = time.thread_time()
                step(v)
                step(v)
                cpu[v].append((time.thread_time() - start) / 2)
        line = [f"{name} ({sum(1 for _ in base.parameters())} params)"]
        for v in order:
            ratio = statistics.median([e / x for e, x in zip(cpu["eager"], cpu[v])])
            line.append(f"{v} {statistics.median(cpu[v]) * 1e3:.2f} ms ratio {ratio:.3f}")
        print(" | ".join(line), "| load", os.getloadavg()[0], flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2].split(","))
