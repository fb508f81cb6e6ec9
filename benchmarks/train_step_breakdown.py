"""Where a training step of the reference case goes: zero_grad, forward, backward, step.

    python benchmarks/train_step_breakdown.py [--model parallel_fcn|critic_ensemble]
                                              [--members N] [--batch B] [--rounds 15]
                                              [--threads 1] [--heap default|fixed]
                                              [--block 1] [--only NAME ...]
                                              [--out breakdown.json]

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

Each round runs every variant's step ``--block`` times in a row (default once: each
step then starts with the memory the other variants' steps left in the caches, where a
user's loop runs one model's steps back to back; ``--block 5`` times steps that follow
their own). ``--only`` keeps the variants whose names contain one of the given words
(``--only stacked``: the two stacked variants).

The last column is the process's minor page faults per step (median). glibc's
``malloc`` gives the top of its heap back to the system when a ``free`` leaves more
than its trim threshold free there, and the next step's large activations then fault
their pages in again (about 0.6 us a 4 KiB page: 0.3-0.5 ms a step for ParallelFCN(1000)
at batch 64). Whether a variant's step ends that way depends on what it keeps alive
across steps (a stacked parameter's persistent ``.grad`` buffer, allocated once, can
leave the step's freed activations on top, where gradients allocated anew each backward
would sit above them) and on the heap the process built before: measured, either
stacked variant could be the one that paid (``profiles/cpu/train-memory/``). ``--heap fixed`` sets ``malloc``'s
trim and mmap thresholds (glibc's ``mallopt``) so that no variant pays it, and compares
the steps' own work.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import json
import resource
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


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def fix_heap() -> None:
    """glibc's ``malloc`` keeps what a step frees (trim threshold 1 GiB) and serves
    allocations up to 64 MiB from its heap, instead of mapping and unmapping them, so
    that no step pays page faults for what another left behind (see the module's
    docstring). Raises ``OSError`` where the C library is not glibc."""
    libc = ctypes.CDLL(None)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        raise OSError("--heap fixed needs glibc's mallopt")
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (mallopt(m_trim_threshold, 1 << 30) and mallopt(m_mmap_threshold, 64 << 20)):
        raise OSError("mallopt refused the thresholds")


def stepper(model: torch.nn.Module, params, x, target, optimizer_kw):
    opt = torch.optim.SGD(params, lr=1e-3, **optimizer_kw)

    def step() -> list[float]:
        faults = _minor_faults()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        loss = F.mse_loss(model(x), target)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        return [t1 - t0, t2 - t1, t3 - t2, t4 - t3, _minor_faults() - faults]

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("parallel_fcn", "critic_ensemble"), default="parallel_fcn")
    parser.add_argument("--members", type=int, default=None, help="default 1000 MLPs, or 32 critics")
    parser.add_argument("--batch", type=int, default=None, help="default 64 (MLPs) or 16 (critics)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--heap",
        choices=("default", "fixed"),
        default="default",
        help="fixed: malloc keeps freed memory (no page faults from heap trimming; glibc)",
    )
    parser.add_argument("--block", type=int, default=1, help="steps of a variant in a row per round")
    parser.add_argument("--only", nargs="+", default=None, help="variants whose names contain one of these")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.block < 1:
        parser.error("--block must be at least 1")
    if args.heap == "fixed":
        fix_heap()
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

    if args.only:
        variants = {name: step for name, step in variants.items() if any(word in name for word in args.only)}
        if not variants:
            parser.error(f"--only {' '.join(args.only)}: no variant's name contains these")
    samples: dict[str, list[list[float]]] = {name: [] for name in variants}
    for round_ in range(args.rounds + 3):
        for name, step in variants.items():
            for _ in range(args.block):
                phases = step()
                if round_ >= 3:
                    samples[name].append(phases)

    rows = {}
    for name, runs in samples.items():
        per_phase = {p: statistics.median(r[i] for r in runs) * 1e3 for i, p in enumerate(PHASES)}
        per_phase["total"] = statistics.median(sum(r[: len(PHASES)]) for r in runs) * 1e3
        per_phase["faults"] = statistics.median(r[len(PHASES)] for r in runs)
        rows[name] = per_phase
    print(
        f"{label}, batch {args.batch}, training step; {args.threads} thread(s); heap {args.heap}; "
        f"median ms of {args.rounds} interleaved rounds of {args.block} step(s) a variant"
    )
    print(
        f"  {'variant':36s} {'zero_grad':>9s} {'forward':>8s} {'backward':>8s} {'step':>7s} {'total':>7s}  vs loop"
        "  faults/step"
    )
    for name, r in rows.items():
        loop = rows.get(f"loop, {name.split(', ', 1)[1]}")
        versus = f"{loop['total'] / r['total']:5.2f}x" if loop else "    -"
        print(
            f"  {name:36s} {r['zero_grad']:9.3f} {r['forward']:8.3f} {r['backward']:8.3f} {r['step']:7.3f} "
            f"{r['total']:7.3f}  {versus}  {r['faults']:11.0f}"
        )
    for opt_name in ("SGD", "SGD(fused=True)"):
        stacked_row = rows.get(f"streamsched stacked, {opt_name}")
        hand_row = rows.get(f"hand-written stacked, {opt_name}")
        if stacked_row and hand_row:
            ratio = stacked_row["total"] / hand_row["total"]
            print(f"  {opt_name}: streamsched stacked / hand-written stacked: {ratio:.3f}")
        loop = rows.get(f"loop, {opt_name}")
        per_member = [r for name, r in rows.items() if name.endswith(f", {opt_name}") and "stacked" not in name]
        if loop is None or stacked_row is None or not per_member:
            continue
        optimizer_ms = min(r["zero_grad"] + r["step"] for r in per_member)
        print(
            f"  {opt_name}: over the members' parameters, zero_grad + step take at least {optimizer_ms:.3f} ms; "
            f"against the loop's {loop['total']:.2f} ms no forward/backward can make such a step more than "
            f"{loop['total'] / optimizer_ms:.1f}x faster. Over fused_parameters() they take "
            f"{stacked_row['zero_grad'] + stacked_row['step']:.3f} ms"
        )
    if args.out:
        with open(args.out, "w") as f:
            report = {"environment": environment_report(), "options": vars(args), "median_ms": rows}
            json.dump({**report, "sample_columns": [*PHASES, "minor_faults"], "samples_s": samples}, f)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
