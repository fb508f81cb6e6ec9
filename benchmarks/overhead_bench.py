"""Host overhead per task of each executor, in microseconds.

    python benchmarks/overhead_bench.py [--out DIR|FILE.json] [--device cpu|cuda] [--width 8] [--depth 32]
                                        [--rounds 25] [--threads N]

The model is ``width`` independent chains of ``depth`` ``Linear(64, 64)`` layers on a
``[1, 64]`` input (a few microseconds of work each), wrapped with ``fuse=False``,
``min_task_cost=0`` and ``num_streams=4`` so that every layer is a task of its own and
the chains spread over 4 streams with cross-stream events at the join (on CUDA the plan
is made with throughputs at which these layers weigh: with the GPU's own, every layer
costs less than its launch and the plan is one task on one stream). The wrapper's
plan is compiled once; then the *same program* (``sm._ss.last.program``) is run by:

- ``serial``: the reference, one generated function for the whole plan: the work alone;
- ``streams (native)``: ``StreamExecutor(backend, native=streamsched._C)``,
- ``streams (Python)``: ``StreamExecutor(backend, native=None)``. On CPU the backend is
  ``SimulatedBackend()``, which runs every task at once and in order, so the difference
  to ``serial`` is the executor's bookkeeping (waits, events, record_stream, frees); on
  CUDA it is ``CudaBackend``: real streams and events (the native row needs an
  extension built with CUDA);
- ``threads`` (CPU only): ``ThreadExecutor``, one CPU lane per planned stream
  (hand-offs, events; on 2 cores part of the work may also overlap).

Overhead per task = (median time of the executor - median time of serial) / tasks. All
executors are timed in the same interleaved rounds (CUDA: CUDA events around the calls).
``module call`` is ``sm(x)`` with the streams executor: the executor plus the wrapper's
per-call cost (signature lookup, stacked-parameter checks).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

# The repository root, last on the path: benchmarks.suite and benchmarks.zoo come from this
# checkout; streamsched from PYTHONPATH (another tree, to compare) or the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import streamsched as ss  # noqa: E402
from benchmarks.suite.report import environment, json_output_path  # noqa: E402
from benchmarks.suite.timing import Clock, measure_interleaved  # noqa: E402
from streamsched import _native  # noqa: E402
from streamsched.ir import cost  # noqa: E402
from streamsched.runtime import CudaBackend, SerialExecutor, SimulatedBackend, StreamExecutor, ThreadExecutor  # noqa: E402


class Chains(nn.Module):
    """``width`` independent chains of ``depth`` small linear layers, summed at the end."""

    def __init__(self, width: int, depth: int, features: int = 64):
        super().__init__()
        self.chains = nn.ModuleList(
            nn.Sequential(*[nn.Linear(features, features) for _ in range(depth)]) for _ in range(width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([chain(x) for chain in self.chains]).sum(0)


def build(width: int, depth: int, device: torch.device) -> tuple[ss.StreamScheduledModule, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = Chains(width, depth).eval().to(device)
    # torch.fx traces through nn.Sequential, so each Linear is a node (and, unfused, a task).
    sm = ss.StreamScheduledModule(model, fuse=False, min_task_cost=0, num_streams=4, executor="streams")
    x = torch.randn(1, 64).to(device)
    # With a GPU's throughputs a [1, 64] Linear costs less than its launch and the plan
    # puts every layer on one stream, in one task: nothing per task would be measured.
    # Planned with throughputs at which these layers weigh what large ones do, the plan
    # keeps a task per layer on 4 streams (the kernels still take their real time).
    saved = cost.GPU_MODEL
    cost.GPU_MODEL = cost.DeviceModel("cuda", flops_per_us=2.0e4, bytes_per_us=4.0e3, launch_us=1.0)
    try:
        with torch.no_grad():
            sm(x)  # records shapes and plans
            sm(x)
    finally:
        cost.GPU_MODEL = saved
    tasks = len(sm._ss.last.program.tasks)
    if tasks < width * depth:
        raise SystemExit(f"overhead_bench: the plan has {tasks} tasks, fewer than the {width * depth} layers")
    return sm, model, x


def executors(sm: ss.StreamScheduledModule, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """One call of the plan's program per executor (executors built once, outside the
    timed calls), and the module call."""
    program = sm._ss.last.program
    nat = _native.native()
    if x.is_cuda:
        backend: Any = CudaBackend(x.device)
        native_ok = nat is not None and nat.cuda_compiled()
    else:
        backend = SimulatedBackend()
        native_ok = nat is not None
    serial = SerialExecutor()
    python_streams = StreamExecutor(backend, native=None)
    runners: dict[str, Callable[[], Any]] = {
        "serial": lambda: serial.run(program, [x]),
        "streams (Python)": lambda: python_streams.run(program, [x]),
    }
    if native_ok:
        native_streams = StreamExecutor(backend, native=nat)
        runners["streams (native)"] = lambda: native_streams.run(program, [x])
    if not x.is_cuda:
        threads = ThreadExecutor()
        runners["threads"] = lambda: threads.run(program, [x])
    runners["module call"] = lambda: sm(x)
    return runners


def run(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for overhead_bench.json, or a .json path")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--width", type=int, default=8, help="independent chains")
    parser.add_argument("--depth", type=int, default=32, help="layers per chain")
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--sample-ms", type=float, default=20.0, help="target length of one sample")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    args = parser.parse_args(argv)
    if args.width < 1 or args.depth < 1:
        parser.error(f"--width and --depth must be at least 1, got {args.width} and {args.depth}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available here")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)

    sm, model, x = build(args.width, args.depth, device)
    plan = sm.plan
    tasks = len(sm._ss.last.program.tasks)
    runners = executors(sm, x)

    with torch.no_grad():
        expected = model(x)
        errors = {name: float((fn() - expected).abs().max()) for name, fn in runners.items()}
        measured = measure_interleaved(
            runners, Clock(device), rounds=args.rounds, warmup=5, target_sample_s=args.sample_ms / 1e3
        )
    serial_ms = measured["serial"].stats.median_ms
    rows = []
    for name, m in measured.items():
        stats = m.stats
        rows.append(
            {
                "executor": name,
                "median_ms": stats.median_ms,
                "min_ms": stats.min_ms,
                "spread_ms": stats.spread_ms,
                "overhead_us_per_task": None if name == "serial" else (stats.median_ms - serial_ms) * 1e3 / tasks,
                "max_abs_err_vs_eager": errors[name],
                "calls_per_sample": m.calls_per_sample,
                "samples_ms": m.samples_ms,
            }
        )
    return {
        "schema": "streamsched.overhead_bench/1",
        "environment": environment(device),
        "model": f"Chains(width={args.width}, depth={args.depth}), Linear(64, 64) on [1, 64]",
        "tasks": tasks,
        "num_streams": plan.num_streams,
        "cross_stream_waits": plan.cross_stream_waits,
        "native_available": "streams (native)" in runners,
        "rounds": args.rounds,
        "rows": rows,
        "out": str(args.out) if args.out is not None else None,
    }


def main(argv: Optional[list[str]] = None) -> int:
    report = run(argv)
    print(
        f"{report['model']}: {report['tasks']} tasks on {report['num_streams']} streams, "
        f"{report['cross_stream_waits']} cross-stream waits; {report['environment']['threads']} intra-op threads; "
        f"median of {report['rounds']} interleaved rounds"
    )
    print(f"{'executor':18s} {'median ms':>10s} {'spread ms':>10s} {'us/task over serial':>20s} {'max err':>9s}")
    for r in report["rows"]:
        over = "" if r["overhead_us_per_task"] is None else f"{r['overhead_us_per_task']:.2f}"
        print(
            f"{r['executor']:18s} {r['median_ms']:10.3f} {r['spread_ms']:10.3f} {over:>20s} "
            f"{r['max_abs_err_vs_eager']:9.1e}"
        )
    if not report["native_available"]:
        print("the native runtime (streamsched._C) is not available: no native row", file=sys.stderr)
    out = report.pop("out")
    if out is not None:
        path = json_output_path(Path(out), "overhead_bench.json")
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {path}", file=sys.stderr)
    bad = [r["executor"] for r in report["rows"] if r["max_abs_err_vs_eager"] > 1e-5]
    if bad:
        print(f"WRONG: {', '.join(bad)} disagree with eager", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
