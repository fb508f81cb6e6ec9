"""``python -m streamsched bench``: the command line of the benchmark suite."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from .cases import FAMILIES, parse_families
from .report import markdown, write_report
from .suite import SuiteOptions, default_device, run_suite

__all__ = ["main", "build_parser"]

_DESCRIPTION = """\
Benchmark streamsched against eager PyTorch and its peers (torch.jit.script,
torch.compile, torch.func vmap ensembles, hand-written rewrites, CUDA graphs), every
variant of a case timed in the same interleaved rounds on the same inputs, each checked
against eager. Writes bench.json (every raw sample) and bench.md (ratios) to --out and
prints the table. Exit status 1 when any variant disagrees with eager (WRONG) or a
streamsched variant fails.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m streamsched bench",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/bench"), help="output folder (default out/bench)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds, no compile: a smoke test")
    parser.add_argument("--models", default=None, help=f"comma-separated subset of: {', '.join(FAMILIES)}")
    parser.add_argument("--device", default=default_device(), help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per case (default 25; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="calls per variant before timing (default 5)")
    parser.add_argument(
        "--sample-ms", type=float, default=None, help="target length of one sample (default 20 on CPU, 5 on CUDA)"
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--compile", dest="compile", action="store_const", const="on", help="torch.compile every model")
    group.add_argument(
        "--no-compile", dest="compile", action="store_const", const="off", help="leave torch.compile out"
    )
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=180.0,
        help="seconds; a model family whose compile took longer is not compiled again (default 180)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the run")
    parser.add_argument("--list", action="store_true", help="list the cases that would run, and exit")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    """Run the suite; returns the exit status (0, or 1 when a row is WRONG or a
    streamsched variant failed; 2 for bad arguments)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        families = parse_families(args.models)
    except ValueError as exc:
        parser.error(str(exc))
    compile_mode = args.compile or ("off" if args.quick else "auto")
    options = SuiteOptions(
        device=args.device,
        quick=args.quick,
        families=families,
        rounds=args.rounds,
        warmup=args.warmup,
        target_sample_ms=args.sample_ms,
        compile=compile_mode,
        compile_budget_s=args.compile_budget,
        threads=args.threads,
    )
    try:
        options.validate()
    except ValueError as exc:
        parser.error(str(exc))
    if args.list:
        from .cases import suite_cases

        for spec in suite_cases(options.validate().type, options.quick, families):
            print(f"{spec.id:40s} {spec.label} ({spec.kind})")
        return 0
    # Written after every case, so that a run cut short still leaves what it measured.
    report = run_suite(options, on_case=lambda partial: write_report(partial, args.out))
    json_path, md_path = write_report(report, args.out)
    print(markdown(report))
    print(f"\nwrote {json_path} and {md_path}", file=sys.stderr)
    failed_streamsched = [e for e in report["errors"] if e.split(": ", 1)[-1].startswith("streamsched")]
    if report["wrong"] or failed_streamsched:
        problems = [f"WRONG {w}" for w in report["wrong"]] + [f"error {e}" for e in failed_streamsched]
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0
