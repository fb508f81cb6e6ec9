"""How much of each real model the scheduler sees: ``Plan.coverage`` per model of the suite.

    STREAMSCHED_DISABLE_EXT=1 HF_HUB_OFFLINE=1 .venv-cuda/bin/python benchmarks/coverage_report.py \\
        [--broad] [--models a,b] [--markdown]

Builds each model of the real-model suite (``tests/models/zoo.py``; with ``--broad``, also
``tests/models/broad.py``'s) with the suite's random weights and inputs, wraps it with
default options and calls it three times in ``eval()`` under ``torch.no_grad()``. The
first call traces, records and plans, the next ones make the nested plans of what runs
as written (``streamsched.nesting``); the last call's plan gives the row: how the model runs (``traced``,
``eager-dispatch`` or ``as-written``), its tasks, the module calls run as opaque tasks
(``plan.opaque``) and the coverage, the share of the forward's leaf-module calls that are
tasks of the plan (``Plan.coverage``: what is counted is in its docstring). Where the
``auto`` trial chose the model as written (coverage 0), the row adds what the plan it set
aside schedules: ``(plan: 1.00, 22)``.

These libraries live in ``.venv-cuda``; the in-tree native extension is built for the
main ``.venv``'s torch, hence ``STREAMSCHED_DISABLE_EXT=1`` (the pure-Python runtime;
coverage does not depend on the runtime).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("STREAMSCHED_DISABLE_EXT", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from streamsched.planning import signatures  # noqa: E402


def _specs(broad: bool, names: list[str]) -> list:
    from tests.models.zoo import SPECS

    specs = list(SPECS)
    if broad:
        from tests.models.broad import SPECS as BROAD

        seen = {s.name for s in specs}
        specs += [s for s in BROAD if s.name not in seen]
    if names:
        by_name = {s.name: s for s in specs}
        missing = [n for n in names if n not in by_name]
        if missing:
            raise SystemExit(f"unknown model(s): {', '.join(missing)}")
        specs = [by_name[n] for n in names]
    return specs


CALLS = 3


def row(spec) -> dict:
    """One model's row: built, wrapped, called ``CALLS`` times in eval under no_grad (the
    first call plans the model; nested plans, where a forward runs as written, are made
    on the calls after it)."""
    from tests.models.zoo import build

    start = time.perf_counter()
    try:
        model = build(spec).eval()
        args, kwargs = spec.inputs(0)
        sm = ss.StreamScheduledModule(model)
        # The first call plans the model (without gradients a call structure's first call
        # runs as written by default): the row counts what a plan of the model covers.
        first_as_written, signatures.FIRST_CALL_AS_WRITTEN = signatures.FIRST_CALL_AS_WRITTEN, False
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for _ in range(CALLS):
                    sm(*args, **kwargs)
        finally:
            signatures.FIRST_CALL_AS_WRITTEN = first_as_written
        plan = sm.plan
    except Exception as exc:  # noqa: BLE001 - a row says what failed
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"model": spec.name, "family": spec.family, "error": f"{type(exc).__name__}: {first[:120]}"}
    scheduled, total = plan.coverage_calls
    # Run as written (the auto trial found the schedule no faster on this machine): what
    # the plan it set aside would schedule.
    set_aside = plan.leaf_calls_in_tasks + plan.nested_in_tasks if plan.executor == "eager" and plan.tasks else None
    return {
        "model": spec.name,
        "family": spec.family,
        "mode": plan.mode if plan.executor != "eager" else "as-written",
        "tasks": len(plan.tasks),
        "nested": len(sm.nested_plans),
        "opaque": len(plan.opaque),
        "coverage": plan.coverage,
        "scheduled": scheduled,
        "total": total,
        "set_aside": set_aside,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broad", action="store_true", help="also the broad tier (tests/models/broad.py)")
    parser.add_argument("--models", default="", help="comma-separated model names")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true", help="a markdown table (docs/models.md)")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    names = [n for n in opts.models.split(",") if n]
    if opts.markdown:
        print(
            "| model | family | runs | tasks | opaque calls | nested plans | coverage | leaf-module calls scheduled |"
        )
        print("|---|---|---|---:|---:|---:|---:|---:|")
    for spec in _specs(opts.broad, names):
        r = row(spec)
        if "error" in r:
            line = f"| {r['model']} | {r['family']} | error: {r['error']} | | | | | |" if opts.markdown else r
            print(line, flush=True)
            continue
        aside = ""
        if r["set_aside"] is not None and r["total"]:
            aside = f" (plan: {r['set_aside'] / r['total']:.2f}, {r['set_aside']})"
        if opts.markdown:
            print(
                f"| {r['model']} | {r['family']} | {r['mode']} | {r['tasks']} | {r['opaque']} | {r['nested']} | "
                f"{r['coverage']:.2f} | {r['scheduled']} of {r['total']}{aside} |",
                flush=True,
            )
        else:
            print(
                f"{r['model']:<34} {r['family']:<13} {r['mode']:<15} tasks {r['tasks']:>5}  opaque {r['opaque']:>3}  "
                f"nested {r['nested']:>3}  "
                f"coverage {r['coverage']:.2f} ({r['scheduled']} of {r['total']}){aside}  {r['seconds']:.1f} s",
                flush=True,
            )


if __name__ == "__main__":
    main()
