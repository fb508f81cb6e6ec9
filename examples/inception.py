"""Inception-v3 with its towers scheduled side by side: the project's demo (`make demo`).

Wraps the Inception-v3 architecture (defined in benchmarks.zoo, no torchvision
needed), checks it against eager PyTorch on fresh random inputs, and prints the plan
and the speed of both, on whatever device is there (CUDA if available).

    python examples/inception.py [--batch 1] [--size 299] [--device cuda] [--executor auto]

To see the schedule in Nsight Systems on a GPU machine (one NVTX range per task, domain
``streamsched``; docs/observability.md says how to read it):
    nsys profile -t nvtx,cuda,osrt -o inception python examples/inception.py --executor streams

With the default ``--executor auto`` the wrapper keeps the model's own forward where that
measured faster (the plan says so), and a forward run as written has no task ranges: name
the executor (``streams`` on CUDA, ``serial`` or ``threads`` on CPU) to capture the schedule.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# The repository root (benchmarks.zoo), last: streamsched is the installed one as before.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import add_threads_option, apply_threads, cpu_threads, threads_note, time_variants  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import Inception3  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--size", type=int, default=None, help="input side (default 299 on GPU, 149 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "serial", "streams", "threads"],
        help="SchedulerConfig.executor (default auto: the fastest of the schedule and the model's own forward)",
    )
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    device = torch.device(args.device)
    size = args.size or (299 if device.type == "cuda" else 149)

    torch.manual_seed(0)
    model = Inception3().eval().to(device)
    sm = ss.StreamScheduledModule(model, executor=args.executor)
    print(
        f"streamsched {ss.__version__}: runtime {ss.runtime_info()['runtime']}, torch {torch.__version__}, "
        f"device {device}, {cpu_threads()}"
    )
    print(f"Inception-v3, batch {args.batch}, input {size}x{size}")

    with torch.no_grad():
        errors = []
        for _ in range(3):  # fresh random inputs each time
            x = torch.randn(args.batch, 3, size, size, device=device)
            errors.append(float((sm(x) - model(x)).abs().max()))
        # The first calls of an input signature record and plan it, then measure the
        # schedule against the model's own forward (the ``auto`` trial) and keep the
        # faster: time what runs after that, and show the decision in the plan. A named
        # executor has no trial: the calls above planned it already.
        x = torch.randn(args.batch, 3, size, size, device=device)
        warmup = 0
        while args.executor == "auto" and sm.plan is not None and sm.plan.trial is None and warmup < 40:
            sm(x)
            warmup += 1
        print(sm.plan.summary())
        times = time_variants(
            {"eager": lambda: model(x), "streamsched": lambda: sm(x)}, device, rounds=args.rounds, inner=3
        )
    print(f"max abs error vs eager: {max(errors):.2e} over 3 random inputs")
    print(f"eager       {times['eager']:8.2f} ms per forward (median of {args.rounds} rounds)")
    print(
        f"streamsched {times['streamsched']:8.2f} ms per forward -> {times['eager'] / times['streamsched']:.2f}x "
        f"({threads_note(device)})"
    )
    if max(errors) > 1e-3:
        raise SystemExit("MISMATCH: the scheduled model does not match eager")


if __name__ == "__main__":
    main()
