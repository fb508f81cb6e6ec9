"""Where a training step of the reference case goes: zero_grad, forward, backward, step.

    python benchmarks/train_step_breakdown.py [--model parallel_fcn|critic_ensemble]
                                              [--members N] [--batch B] [--rounds 15]
                                              [--threads 1] [--out breakdown.json]

``ParallelFCN(members)`` (default 1000 members, batch 64) or ``CriticEnsemble(members)``
(default 32 critics, batch 16), MSE loss, ``torch.optim.SGD``. Variants, each on its own
copy of the same weights, timed phase by phase in the same interleaved rounds (median
over rounds, after 3 warm-up steps):

- ``loop``: the model as written, SGD over its parameters;
- ``streamsched``: the default (``grad_handoff="autograd"``), SGD over the members;
- ``streamsched direct``: ``grad_handoff="direct"``, SGD over the members;
- ``streamsched stacked``: SGD over ``sm.fused_parameters()``, one stacked tensor per
  fused group (``streamsched.optim``);
- ``hand-written stacked``: the model rewritten by hand with stacked weights
  (``StackedFCN``: two ``baddbmm``; for the critics one wide ``linear`` and two
  ``baddbmm``), SGD over its few tensors: the floor for the stacked variants;

each with the default ``SGD`` (per-parameter loop on the CPU) and with
``SGD(fused=True)``. The optimizer's own ``zero_grad`` + ``step`` over the members'
parameters is paid by every per-member variant: it bounds the speedup any
forward/backward can give them, and the script prints that bound.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# The repository root, last on the path: benchmarks.suite and benchmarks.zoo come from this
# checkout; streamsched from PYTHONPATH (another tree, to compare) or the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble, ParallelFCN, StackedCritics, StackedFCN  # noqa: E402
from streamsched.envinfo import environment_report  # noqa: E402

PHASES = ("zero_grad", "forward", "backward", "step")


def stepper(model: torch.nn.Module, params, x, target, optimizer_kw):
    opt = torch.optim.SGD(params, lr=1e-3, **optimizer_kw)

    def step() -> list[float]:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = F.mse_loss(model(x), target)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3]

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("parallel_fcn", "critic_ensemble"), default="parallel_fcn")
    parser.add_argument("--members", type=int, default=None, help="default 1000 MLPs, or 32 critics")
    parser.add_argument("--batch", type=int, default=None, help="default 64 (MLPs) or 16 (critics)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model == "parallel_fcn":
        args.members = args.members or 1000
        args.batch = args.batch or 64
        base = ParallelFCN(args.members).train()
        x = torch.randn(args.batch, 20 * args.members)
        label = f"ParallelFCN({args.members})"
    else:
        args.members = args.members or 32
        args.batch = args.batch or 16
        base = CriticEnsemble(args.members).train()
        x = torch.randn(args.batch, 23)
        label = f"CriticEnsemble({args.members})"
    with torch.no_grad():
        target = torch.randn(base(x).shape)
    hand_written = StackedFCN if args.model == "parallel_fcn" else StackedCritics
    with torch.no_grad():
        assert torch.allclose(hand_written(base)(x), base(x), atol=1e-5)

    variants = {}
    for opt_name, opt_kw in (("SGD", {}), ("SGD(fused=True)", {"fused": True})):
        loop = copy.deepcopy(base)
        default = ss.StreamScheduledModule(copy.deepcopy(base))
        direct = ss.StreamScheduledModule(copy.deepcopy(base), grad_handoff="direct")
        stacked = ss.StreamScheduledModule(copy.deepcopy(base))
        with torch.no_grad():
            stacked(x)  # plans (and fuses) once, so that fused_parameters() has groups to stack
        for name, model, params in (
            ("loop", loop, loop.parameters()),
            ("streamsched", default, default.module.parameters()),
            ("streamsched direct", direct, direct.module.parameters()),
            ("streamsched stacked", stacked, stacked.fused_parameters()),
            ("hand-written stacked", hand := hand_written(base), hand.parameters()),
        ):
            variants[f"{name}, {opt_name}"] = stepper(model, list(params), x, target, opt_kw)

    samples: dict[str, list[list[float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 3):
        for name, step in variants.items():
            phases = step()
            if round_ >= 3:
                samples[name].append(phases)

    rows = {}
    for name, runs in samples.items():
        per_phase = {p: statistics.median(r[i] for r in runs) * 1e3 for i, p in enumerate(PHASES)}
        per_phase["total"] = statistics.median(sum(r) for r in runs) * 1e3
        rows[name] = per_phase
    print(
        f"{label}, batch {args.batch}, training step; {args.threads} thread(s); "
        f"median ms of {args.rounds} interleaved rounds"
    )
    print(f"  {'variant':36s} {'zero_grad':>9s} {'forward':>8s} {'backward':>8s} {'step':>7s} {'total':>7s}  vs loop")
    for name, r in rows.items():
        loop_total = rows[f"loop, {name.split(', ', 1)[1]}"]["total"]
        print(
            f"  {name:36s} {r['zero_grad']:9.3f} {r['forward']:8.3f} {r['backward']:8.3f} {r['step']:7.3f} "
            f"{r['total']:7.3f}  {loop_total / r['total']:5.2f}x"
        )
    for opt_name in ("SGD", "SGD(fused=True)"):
        loop = rows[f"loop, {opt_name}"]
        per_member = [r for name, r in rows.items() if name.endswith(f", {opt_name}") and "stacked" not in name]
        optimizer_ms = min(r["zero_grad"] + r["step"] for r in per_member)
        stacked_row = rows[f"streamsched stacked, {opt_name}"]
        print(
            f"  {opt_name}: over the members' parameters, zero_grad + step take at least {optimizer_ms:.3f} ms; "
            f"against the loop's {loop['total']:.2f} ms no forward/backward can make such a step more than "
            f"{loop['total'] / optimizer_ms:.1f}x faster. Over fused_parameters() they take "
            f"{stacked_row['zero_grad'] + stacked_row['step']:.3f} ms"
        )
    if args.out:
        with open(args.out, "w") as f:
            report = {"environment": environment_report(), "options": vars(args), "median_ms": rows}
            json.dump({**report, "samples_s": samples}, f)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
