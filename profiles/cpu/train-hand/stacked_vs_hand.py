"""A training step over ``sm.fused_parameters()`` against the hand-written stacked model,
phase by phase, in CPU time of the calling thread (``time.thread_time``).

    python <tree>/profiles/cpu/train-hand/stacked_vs_hand.py {pfcn,critic} ROUNDS [MOMENTUM]

ParallelFCN(1000) at batch 64 or CriticEnsemble(32) at batch 16; MSE loss,
``torch.optim.SGD(lr=1e-3, momentum=MOMENTUM)``, ``zero_grad(set_to_none=True)``; one
intra-op thread. Each round times ``calls`` steps of each variant (the order alternates
round by round), each sample after one step of the plain model (as in the benchmark
suite, where other variants run between samples). Prints the median of each phase, the
median and minimum step, and the per-round ratio hand / stacked (above 1: the
``fused_parameters()`` step is faster).
"""

from __future__ import annotations

import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# This checkout first: its streamsched (built extension included) and benchmarks.
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble, ParallelFCN, StackedCritics, StackedFCN  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step")


def main() -> None:
    model, rounds = sys.argv[1], int(sys.argv[2])
    momentum = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if model == "pfcn":
        base, x, hand_cls, calls = ParallelFCN(1000).train(), torch.randn(64, 20000), StackedFCN, 2
    else:
        base, x, hand_cls, calls = CriticEnsemble(32).train(), torch.randn(16, 23), StackedCritics, 20
    with torch.no_grad():
        target = torch.randn(base(x).shape)
    sm = ss.StreamScheduledModule(copy.deepcopy(base))
    with torch.no_grad():
        sm(x)
    hand = hand_cls(base)
    eager = copy.deepcopy(base)

    def stepper(m, params):
        opt = torch.optim.SGD(list(params), lr=1e-3, momentum=momentum)

        def step() -> list[float]:
            t0 = time.thread_time()
            opt.zero_grad(set_to_none=True)
            t1 = time.thread_time()
            loss = F.mse_loss(m(x), target)
            t2 = time.thread_time()
            loss.backward()
            t3 = time.thread_time()
            opt.step()
            t4 = time.thread_time()
            return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

        return step

    variants = {
        "fused_parameters()": stepper(sm, sm.fused_parameters()),
        "hand-written": stepper(hand, hand.parameters()),
    }
    flush = stepper(eager, eager.parameters())
    for step in variants.values():
        for _ in range(5):
            step()
    samples: dict[str, list[list[float]]] = {k: [] for k in variants}
    ratios = []
    for r in range(rounds):
        got = {}
        for name in list(variants) if r % 2 == 0 else list(variants)[::-1]:
            flush()
            runs = [variants[name]() for _ in range(calls)]
            phases = [statistics.fmean(p) * 1e3 for p in zip(*runs)]
            samples[name].append(phases)
            got[name] = sum(phases)
        ratios.append(got["hand-written"] / got["fused_parameters()"])
    label = "ParallelFCN(1000), batch 64" if model == "pfcn" else "CriticEnsemble(32), batch 16"
    print(f"streamsched from {Path(ss.__file__).parent}")
    print(f"{label}; SGD(lr=1e-3, momentum={momentum}); 1 thread; {rounds} rounds x {calls} steps; CPU ms per step")
    print(f"  {'variant':20s} " + " ".join(f"{p:>9s}" for p in PHASES) + f" {'step':>8s} {'min':>8s}")
    for name, rows in samples.items():
        med = [statistics.median(r[i] for r in rows) for i in range(len(PHASES))]
        totals = [sum(r) for r in rows]
        print(
            f"  {name:20s} "
            + " ".join(f"{v:9.3f}" for v in med)
            + f" {statistics.median(totals):8.3f} {min(totals):8.3f}"
        )
    q = statistics.quantiles(ratios, n=4)
    med = statistics.median(ratios)
    print(f"  hand-written / fused_parameters() per round: median {med:.3f} (p25 {q[0]:.3f}, p75 {q[2]:.3f})")


if __name__ == "__main__":
    main()
