"""How long planning takes: stream assignment of large random DAGs, the whole first
call (trace + record shapes + fuse + plan) of the 1000-MLP reference model, and the
planning call at a new input size of a model planned before (the 1000-MLP model, fused
and not, and the fused heads of ``dynamic_bench.py``).

    python benchmarks/planning_bench.py [--out DIR|FILE.json] [--repeats 5] [--sizes 1000,5000,10000] [--threads N]

Graphs are sparse random DAGs built with ``TaskGraph.from_edges``: each task takes 1-3
predecessors among earlier tasks, either from the previous 64 tasks ("local", the shape
of a real model's graph: branches that fork and join nearby) or from anywhere before it
("uniform", long-range edges), with random costs. Planned with
``assign_streams(graph, bound=8)``: transitive reduction, matching-based chain cover,
packing onto 8 streams, issue order and waits. Each figure is the median of
``--repeats`` runs on a fresh graph object (so no cached reachability is reused).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch

# The repository root, last on the path: benchmarks.suite and benchmarks.zoo come from this
# checkout; streamsched from PYTHONPATH (another tree, to compare) or the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import streamsched as ss  # noqa: E402
from benchmarks.suite.report import environment, json_output_path  # noqa: E402
from benchmarks.zoo import ParallelFCN  # noqa: E402
from streamsched.ir.graph import TaskGraph  # noqa: E402
from streamsched.planning import signatures  # noqa: E402
from streamsched.planning.assign import assign_streams  # noqa: E402

BOUND = 8


def random_dag(n: int, window: Optional[int], seed: int) -> tuple[list[tuple[int, int]], list[float]]:
    """Edges (ids in topological order) and costs of a sparse random DAG on ``n`` tasks:
    1-3 predecessors per task, drawn from the previous ``window`` tasks (all earlier
    tasks when ``window`` is None)."""
    if n < 1:
        raise ValueError(f"planning_bench: a DAG needs at least one task, got n={n}")
    rng = random.Random(seed)
    edges = []
    for v in range(1, n):
        lo = 0 if window is None else max(0, v - window)
        k = min(rng.randint(1, 3), v - lo)
        edges.extend((u, v) for u in rng.sample(range(lo, v), k))
    costs = [rng.uniform(1.0, 100.0) for _ in range(n)]
    return edges, costs


def time_assignment(n: int, window: Optional[int], repeats: int) -> dict[str, Any]:
    edges, costs = random_dag(n, window, seed=n)
    build, assign, total = [], [], []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        graph = TaskGraph.from_edges(n, edges, costs)
        built = time.perf_counter()
        result = assign_streams(graph, BOUND)
        done = time.perf_counter()
        build.append(built - start)
        assign.append(done - built)
        total.append(done - start)
    assert result is not None
    return {
        "nodes": n,
        "edges": len(edges),
        "window": window,
        "bound": BOUND,
        "streams_used": result.num_streams,
        "cross_stream_waits": sum(len(w) for w in result.waits),
        "build_s": statistics.median(build),
        "assign_s": statistics.median(assign),
        "total_s": statistics.median(total),
        "samples_total_s": total,
    }


def time_first_call(members: int, batch: int, repeats: int, fuse: bool) -> dict[str, Any]:
    """The first call of a fresh wrapper (each on a fresh copy of the model: fusion
    re-homes parameters, so wrappers must not share one)."""
    torch.manual_seed(0)
    model = ParallelFCN(members).eval()
    x = torch.randn(batch, 20 * members)
    seconds, steady = [], []
    plan = None
    # The call that traces and plans, first as it was measured before a call structure's
    # first call without gradients ran as written.
    first_as_written, signatures.FIRST_CALL_AS_WRITTEN = signatures.FIRST_CALL_AS_WRITTEN, False
    try:
        with torch.no_grad():
            for _ in range(repeats):
                sm = ss.StreamScheduledModule(copy.deepcopy(model), fuse=fuse)
                start = time.perf_counter()
                out = sm(x)
                seconds.append(time.perf_counter() - start)
                start = time.perf_counter()
                sm(x)
                steady.append(time.perf_counter() - start)
                plan = sm.plan
            err = float((out - model(x)).abs().max())
    finally:
        signatures.FIRST_CALL_AS_WRITTEN = first_as_written
    assert plan is not None
    return {
        "model": f"ParallelFCN({members})",
        "batch": batch,
        "fuse": fuse,
        "tasks": len(plan.tasks),
        "fused_groups": len(plan.fused_groups),
        "executor": plan.executor,
        "first_call_s": statistics.median(seconds),
        "samples_first_call_s": seconds,
        "second_call_s": statistics.median(steady),
        "max_abs_err_vs_eager": err,
    }


def time_new_sizes(name: str, model: torch.nn.Module, shape: tuple[int, ...], batches: list[int], fuse: bool) -> dict:
    """The planning call of each new batch size of one wrapper that has planned the
    model at ``shape`` already (``executor="serial"``: every signature is planned on its
    first call, no trial), against a call of the model as written at that size. The
    planning call records (it is the call's result), fuses, plans and compiles; what the
    trace's earlier plans decided that does not depend on sizes is reused."""
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial", fuse=fuse)
    cpu, wall, eager, err = [], [], [], 0.0
    with torch.no_grad():
        sm(torch.randn(*shape))
        for b in batches:
            x = torch.randn(b, *shape[1:])
            start, clock = time.thread_time(), time.perf_counter()
            out = sm(x)
            wall.append(time.perf_counter() - clock)
            cpu.append(time.thread_time() - start)
            start = time.thread_time()
            ref = model(x)
            eager.append(time.thread_time() - start)
            err = max(err, float((out - ref).abs().max()))
    return {
        "model": name,
        "fuse": fuse,
        "new_sizes": len(batches),
        "planning_call_cpu_s": statistics.median(cpu),
        "planning_call_cpu_min_s": min(cpu),
        "planning_call_wall_s": statistics.median(wall),
        "eager_call_cpu_s": statistics.median(eager),
        "samples_planning_call_cpu_s": cpu,
        "max_abs_err_vs_eager": err,
    }


def new_size_cases(members: int) -> list[tuple[str, torch.nn.Module, tuple[int, ...], bool]]:
    from benchmarks.dynamic_bench import Heads

    torch.manual_seed(0)
    fcn = ParallelFCN(members).eval()
    return [
        (f"ParallelFCN({members})", fcn, (8, 20 * members), True),
        (f"ParallelFCN({members})", fcn, (8, 20 * members), False),
        ("Heads(64), dynamic_bench", Heads().eval(), (8, 16), True),
    ]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for planning_bench.json, or a .json path")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="1000,5000,10000", help="DAG sizes (comma-separated)")
    parser.add_argument("--members", type=int, default=1000, help="MLPs of the first-call model")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")

    graphs = []
    print(f"assign_streams(bound={BOUND}) on sparse random DAGs, median of {args.repeats} runs")
    print(f"{'nodes':>7} {'edges':>7} {'preds from':>12} {'build s':>9} {'assign s':>9} {'total s':>9} {'waits':>6}")
    for n in sizes:
        for window in (64, None):
            r = time_assignment(n, window, args.repeats)
            graphs.append(r)
            where = "last 64" if window else "anywhere"
            print(
                f"{n:7d} {r['edges']:7d} {where:>12} {r['build_s']:9.3f} {r['assign_s']:9.3f} "
                f"{r['total_s']:9.3f} {r['cross_stream_waits']:6d}"
            )

    first_calls = []
    print(f"\nfirst call (trace + record shapes + fuse + plan), median of {min(args.repeats, 3)} runs")
    for fuse in (True, False):
        r = time_first_call(args.members, 1, min(args.repeats, 3), fuse)
        first_calls.append(r)
        print(
            f"  {r['model']}, batch 1, fuse={fuse}: {r['first_call_s']:.3f} s "
            f"({r['tasks']} tasks, {r['fused_groups']} fused groups, executor {r['executor']}; "
            f"second call {r['second_call_s'] * 1e3:.2f} ms; max abs err {r['max_abs_err_vs_eager']:.1e})"
        )

    new_sizes = []
    batches = list(range(9, 9 + max(args.repeats, 3)))
    print(f"\nplanning call at a new batch size (CPU s, median of {len(batches)} new sizes; eager call alongside)")
    for name, model, shape, fuse in new_size_cases(args.members):
        r = time_new_sizes(name, model, shape, batches, fuse)
        new_sizes.append(r)
        print(
            f"  {name}, fuse={fuse}: {r['planning_call_cpu_s'] * 1e3:.1f} ms "
            f"(min {r['planning_call_cpu_min_s'] * 1e3:.1f}; eager call {r['eager_call_cpu_s'] * 1e3:.2f} ms; "
            f"max abs err {r['max_abs_err_vs_eager']:.1e})"
        )

    if args.out is not None:
        path = json_output_path(args.out, "planning_bench.json")
        report = {
            "schema": "streamsched.planning_bench/1",
            "environment": environment(torch.device("cpu")),
            "repeats": args.repeats,
            "assign_streams": graphs,
            "first_call": first_calls,
            "new_size": new_sizes,
        }
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
