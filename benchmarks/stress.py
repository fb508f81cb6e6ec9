"""Stress runs: chaos, mutations and a soak, with a one-line summary (``make stress``).

- **Chaos**: many calls of the example models and randomly generated branchy models with
  random delays before every task (sleeps on CPU lanes, spin kernels on CUDA streams);
  every output is compared with eager PyTorch on a fresh random input and every call's
  SyncLog goes through the happens-before checker.
- **Mutations**: a valid plan with one wait removed, and one with one ``record_stream``
  removed; each must be caught (a wrong answer, an error, or a checker report) within
  the run.
- **Soak**: many calls cycling through more input signatures than the plan cache holds;
  caches must stay bounded and resident memory must not grow.

    python -m streamsched stress [--runs 1000] [--soak 10000] [--device cuda]

(``python -m benchmarks.stress [...]`` from the repository root is the same.)
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

import torch
from torch import nn

from streamsched.module import StreamScheduledModule
from streamsched.runtime.synclog import check_happens_before

__all__ = ["main", "run_chaos", "run_mutations", "run_soak", "StressReport"]


@dataclass
class StressReport:
    runs: int = 0
    mismatches: int = 0
    errors: int = 0
    checker_reports: int = 0
    mutations: int = 0
    mutations_caught: int = 0
    soak_calls: int = 0
    memory_growth_mb: float = 0.0
    max_plans: int = 0
    threads_before: int = 0
    threads_after: int = 0
    details: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return (
            self.mismatches == 0
            and self.errors == 0
            and self.checker_reports == 0
            and self.mutations_caught == self.mutations
            and self.memory_growth_mb < 50.0
        )

    def line(self) -> str:
        return (
            f"stress: {'OK' if self.clean else 'FAILED'} - runs {self.runs}, mismatches {self.mismatches}, "
            f"errors {self.errors}, checker reports {self.checker_reports}, mutations caught "
            f"{self.mutations_caught}/{self.mutations}, soak {self.soak_calls} calls, "
            f"memory growth {self.memory_growth_mb:.1f} MB, plans kept <= {self.max_plans}, "
            f"threads {self.threads_before}->{self.threads_after}"
        )


class _RandomBranchy(nn.Module):
    """A random DAG of Linear / activation / add ops with several independent paths."""

    def __init__(self, rng: random.Random, width: int = 32, ops: int = 10):
        super().__init__()
        self.plan: list[tuple[str, int, int]] = []
        self.layers = nn.ModuleList()
        count = 1
        for _ in range(ops):
            kind = rng.choice(["linear", "linear", "tanh", "add"])
            a, b = rng.randrange(count), rng.randrange(count)
            if kind == "linear":
                self.plan.append((kind, a, len(self.layers)))
                self.layers.append(nn.Linear(width, width))
            else:
                self.plan.append((kind, a, b))
            count += 1
        used = {a for _, a, _ in self.plan} | {b for k, _, b in self.plan if k == "add"}
        self.outputs = [i for i in range(1, count) if i not in used] or [count - 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for kind, a, b in self.plan:
            if kind == "linear":
                values.append(self.layers[b](values[a]))
            elif kind == "tanh":
                values.append(torch.tanh(values[a]))
            else:
                values.append(values[a] + values[b])
        return torch.stack([values[i] for i in self.outputs]).sum(0)


def _models(device: torch.device, seed: int) -> list[tuple[str, nn.Module, Callable[[], tuple]]]:
    from benchmarks.zoo import NASNetCells, ParallelFCN, RandWire

    rng = random.Random(seed)
    out: list[tuple[str, nn.Module, Callable[[], tuple]]] = [
        ("nasnet", NASNetCells(16, 2, num_classes=10), lambda: (torch.randn(2, 3, 16, 16, device=device),)),
        ("randwire", RandWire(12, 1, 10, num_classes=10), lambda: (torch.randn(2, 3, 16, 16, device=device),)),
        ("pfcn", ParallelFCN(32), lambda: (torch.randn(4, 640, device=device),)),
    ]
    for k in range(6):
        out.append((f"random{k}", _RandomBranchy(rng), lambda: (torch.randn(8, 32, device=device),)))
    return [(name, model.to(device).eval(), make) for name, model, make in out]


def _executor(device: torch.device) -> str:
    return "streams" if device.type == "cuda" else "threads"


def run_chaos(runs: int, device: torch.device, seed: int, report: StressReport) -> None:
    models = _models(device, seed)
    wrapped = [
        (
            name,
            model,
            make,
            StreamScheduledModule(
                model, executor=_executor(device), chaos=seed + i, sync_log=True, num_streams=4, min_task_cost=0.0
            ),
        )
        for i, (name, model, make) in enumerate(models)
    ]
    with torch.no_grad():
        for run in range(runs):
            name, model, make, sm = wrapped[run % len(wrapped)]
            inputs = make()
            try:
                out = sm(*inputs)
                expected = model(*inputs)
                if not torch.allclose(out, expected, atol=1e-4, rtol=1e-4):
                    report.mismatches += 1
                    report.details.append(f"chaos run {run} ({name}): output differs from eager")
            except Exception as exc:  # noqa: BLE001 - counted and reported
                report.errors += 1
                report.details.append(f"chaos run {run} ({name}): {type(exc).__name__}: {exc}")
                continue
            if sm.last_sync_log is not None:
                races = check_happens_before(sm.last_sync_log)
                if races:
                    report.checker_reports += len(races)
                    report.details.append(f"chaos run {run} ({name}): {races[0]}")
            report.runs += 1


def run_mutations(device: torch.device, seed: int, report: StressReport, tries: int = 10) -> None:
    """Remove one wait, then one record_stream, from valid plans: each must be caught."""
    for name, model, make in _models(device, seed)[:4]:
        for kind in ("wait", "record_stream"):
            # record_stream protects memory on CUDA streams: that mutation is checked on the
            # streams executor (simulated on CPU, where the checker sees the unsafe free).
            sm = StreamScheduledModule(
                model,
                executor="streams" if kind == "record_stream" else _executor(device),
                chaos=seed,
                sync_log=True,
                num_streams=4,
                min_task_cost=0.0,
                fuse=False,
            )
            with torch.no_grad():
                sm(*make())
                program = sm._ss.last.program
                if kind == "wait":
                    victim = next((t for t in program.tasks if t.waits), None)
                else:
                    victim = next(
                        (
                            t
                            for t in program.tasks
                            if t.cross_reads and any(s in u.frees for u in program.tasks for s in t.cross_reads)
                        ),
                        None,
                    )
                if victim is None:
                    continue
                report.mutations += 1
                if kind == "wait":
                    victim.waits = victim.waits[1:]
                else:
                    victim.cross_reads = victim.cross_reads[1:]
                # The executor made its native task table before the mutation: make it anew.
                sm._ss.executors.for_plan(sm._ss.last.plan).forget(program)
                caught = False
                for _ in range(tries):
                    inputs = make()
                    try:
                        out = sm(*inputs)
                        caught |= not torch.allclose(out, model(*inputs), atol=1e-4)
                    except Exception:  # noqa: BLE001 - an error is a catch
                        caught = True
                    caught |= bool(check_happens_before(sm.last_sync_log)) if sm.last_sync_log else False
                    if caught:
                        break
                report.mutations_caught += caught
                if not caught:
                    report.details.append(f"mutation ({kind}) of {name} was not caught")


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as fh:
            pages = int(fh.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):  # not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_soak(calls: int, device: torch.device, report: StressReport, cache: int = 4, signatures: int = 9) -> None:
    """Cycle through more input signatures than the cache holds; nothing may grow."""
    torch.manual_seed(0)
    model = _RandomBranchy(random.Random(1), width=16, ops=8).to(device)
    sm = StreamScheduledModule(model, executor=_executor(device), plan_cache_size=cache)
    baseline: Optional[float] = None
    sources: Optional[int] = None
    with torch.no_grad():
        for call in range(calls):
            x = torch.randn(1 + call % signatures, 16, device=device)
            sm(x)
            report.max_plans = max(report.max_plans, len(sm.plans))
            if call == min(calls - 1, max(50, calls // 10)):
                gc.collect()
                baseline = _rss_mb()
                sources = sum(1 for k in linecache.cache if "streamsched" in str(k))
    gc.collect()
    report.soak_calls = calls
    if baseline is not None:
        report.memory_growth_mb = max(0.0, _rss_mb() - baseline)
    grown = sum(1 for k in linecache.cache if "streamsched" in str(k))
    if sources is not None and grown > 2 * sources + 20:
        report.details.append(f"generated sources grew from {sources} to {grown}")
        report.errors += 1
    if report.max_plans > cache:
        report.details.append(f"plan cache grew to {report.max_plans} (bound {cache})")
        report.errors += 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m streamsched stress", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1000, help="chaos calls (default 1000)")
    parser.add_argument("--soak", type=int, default=10000, help="soak calls (default 10000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the models, inputs and delays (default 0)")
    parser.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cpu or cuda (default: cuda when available)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    report = StressReport(threads_before=threading.active_count())
    start = time.perf_counter()
    run_chaos(args.runs, device, args.seed, report)
    run_mutations(device, args.seed, report)
    run_soak(args.soak, device, report)
    report.threads_after = threading.active_count()
    for line in report.details[:20]:
        print("  " + line)
    print(report.line() + f" ({time.perf_counter() - start:.0f} s, {device}, {torch.get_num_threads()} threads)")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(asdict(report) | {"clean": report.clean}, fh, indent=2)
    return 0 if report.clean else 1


if __name__ == "__main__":
    raise SystemExit(main())
