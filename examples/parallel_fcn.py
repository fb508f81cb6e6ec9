"""The reference case: 1000 small MLPs in a Python loop, and what streamsched makes of it.

Each member is Linear(20, 10) -> ReLU -> Linear(10, 1) on its own 20-column slice of a
[B, 20000] input; outputs are concatenated. Compared, on the same inputs in one run:
the loop (eager), streamsched on the *unmodified* loop model, and the two hand rewrites
people write (two grouped Conv1d; two baddbmm on pre-stacked weights).

    python examples/parallel_fcn.py [--members 1000] [--batch 1] [--train] [--threads 1]

Speed ratios on CPU depend on the intra-op thread count (printed with them; the README's
figures use ``--threads 1``).

``--train`` times a training step (forward, backward, SGD step) of the loop, of
streamsched, and of streamsched with ``grad_handoff="direct"``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
# The repository root (benchmarks.zoo), last: streamsched is the installed one as before.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import add_threads_option, apply_threads, cpu_threads, threads_note, time_variants  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import GroupedConvFCN, ParallelFCN, StackedFCN  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--train", action="store_true", help="time a training step instead of inference")
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = ParallelFCN(args.members).to(device)
    grouped, stacked = GroupedConvFCN(model).to(device), StackedFCN(model).to(device)
    x = torch.randn(args.batch, 20 * args.members, device=device)

    start = time.perf_counter()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        sm(x)
    first = time.perf_counter() - start
    print(
        f"{args.members} MLPs, batch {args.batch}, {device}, {cpu_threads()}; "
        f"first call (trace + fuse + plan) {first:.2f} s"
    )
    print(sm.plan.summary())

    with torch.no_grad():
        ref = model(x)
        for name, out in [("streamsched", sm(x)), ("grouped conv", grouped(x)), ("stacked bmm", stacked(x))]:
            print(f"  max abs error of {name:12s} vs loop: {float((out - ref).abs().max()):.2e}")
    if args.train:
        # Each variant trains its own copy (two wrappers must not share one model's storage).
        loop_model = copy.deepcopy(model)
        direct = ss.StreamScheduledModule(copy.deepcopy(model), grad_handoff="direct")

        def step(m, params):
            opt = torch.optim.SGD(params, lr=1e-3)

            def run():
                opt.zero_grad()
                m(x).square().mean().backward()
                opt.step()

            return run

        times = time_variants(
            {
                "loop": step(loop_model, loop_model.parameters()),
                "streamsched": step(sm, model.parameters()),
                "direct grads": step(direct, direct.module.parameters()),
            },
            device,
            rounds=5,
            inner=2,
        )
    else:
        with torch.no_grad():
            times = time_variants(
                {
                    "loop": lambda: model(x),
                    "streamsched": lambda: sm(x),
                    "grouped conv": lambda: grouped(x),
                    "stacked bmm": lambda: stacked(x),
                },
                device,
                rounds=7,
                inner=5,
            )
    base = times["loop"]
    print(f"time per call ({threads_note(device)}), median of interleaved rounds:")
    for name, ms in times.items():
        print(f"  {name:12s} {ms:9.3f} ms   {base / ms:8.1f}x the loop")


if __name__ == "__main__":
    main()
