"""Where a training step of the reference case goes: zero_grad, forward, backward, step.

    python benchmarks/train_step_breakdown.py [--members 1000] [--batch 64] [--rounds 15]
                                              [--threads 1] [--out breakdown.json]

ParallelFCN(members) at the given batch, MSE loss, ``torch.optim.SGD`` over the original
model's parameters. Variants, each on its own copy of the same weights, timed phase by
phase in the same interleaved rounds (median over rounds, after 3 warm-up steps):

- ``loop``: the model as written;
- ``streamsched``: the default (``grad_handoff="autograd"``);
- ``streamsched direct``: ``grad_handoff="direct"``;

each with the default ``SGD`` (per-parameter loop on the CPU) and with
``SGD(fused=True)``. The optimizer's own ``zero_grad`` + ``step`` over the members'
parameters is paid by every variant: it bounds the speedup any forward/backward can
give, and the script prints that bound.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch
import torch.nn.functional as F

import streamsched as ss
from streamsched.envinfo import environment_report
from streamsched.models import ParallelFCN

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
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = ParallelFCN(args.members).train()
    x = torch.randn(args.batch, 20 * args.members)
    target = torch.randn(args.batch, args.members)

    variants = {}
    for opt_name, opt_kw in (("SGD", {}), ("SGD(fused=True)", {"fused": True})):
        loop = copy.deepcopy(base)
        default = ss.StreamScheduledModule(copy.deepcopy(base))
        direct = ss.StreamScheduledModule(copy.deepcopy(base), grad_handoff="direct")
        for name, model, params in (
            ("loop", loop, loop.parameters()),
            ("streamsched", default, default.module.parameters()),
            ("streamsched direct", direct, direct.module.parameters()),
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
        f"ParallelFCN({args.members}), batch {args.batch}, training step; {args.threads} thread(s); "
        f"median ms of {args.rounds} interleaved rounds"
    )
    print(f"  {'variant':36s} {'zero_grad':>9s} {'forward':>8s} {'backward':>8s} {'step':>7s} {'total':>7s}  vs loop")
    for name, r in rows.items():
        loop_total = rows[f"loop, {name.split(', ', 1)[1]}"]["total"]
        print(
            f"  {name:36s} {r['zero_grad']:9.2f} {r['forward']:8.2f} {r['backward']:8.2f} {r['step']:7.2f} "
            f"{r['total']:7.2f}  {loop_total / r['total']:5.2f}x"
        )
    for opt_name in ("SGD", "SGD(fused=True)"):
        loop = rows[f"loop, {opt_name}"]
        same_optimizer = [r for name, r in rows.items() if name.endswith(f", {opt_name}")]
        optimizer_ms = min(r["zero_grad"] + r["step"] for r in same_optimizer)
        print(
            f"  {opt_name}: zero_grad + step take at least {optimizer_ms:.2f} ms in every variant; against the "
            f"loop's {loop['total']:.2f} ms no forward/backward can make the step more than "
            f"{loop['total'] / optimizer_ms:.1f}x faster"
        )
    if args.out:
        with open(args.out, "w") as f:
            report = {"environment": environment_report(), "options": vars(args), "median_ms": rows}
            json.dump({**report, "samples_s": samples}, f)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
