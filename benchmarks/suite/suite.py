"""The suite: every selected case, run one after another, into one report.

Example::

    >>> from benchmarks.suite.suite import SuiteOptions, run_suite
    >>> report = run_suite(SuiteOptions(quick=True, families=["multitask_heads"], compile="off"))  # doctest: +SKIP
    >>> report["cases"][0]["rows"][0]["name"]  # doctest: +SKIP
    'eager'
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from . import peers as peer_registry
from .cases import FAMILIES, suite_cases
from .inference import MeasureOptions, run_inference_case
from .peers import Peer
from .report import build_report, environment
from .results import CaseResult
from .training import run_training_case
from .variant import SuiteContext

__all__ = ["SuiteOptions", "run_suite", "default_device"]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class SuiteOptions:
    """What to run and how; ``None`` fields take the mode's default (full or quick)."""

    device: str = field(default_factory=default_device)
    quick: bool = False
    families: Sequence[str] = tuple(FAMILIES)
    rounds: Optional[int] = None
    """Interleaved rounds per case (default 25; 2 with ``quick``)."""
    warmup: Optional[int] = None
    """Calls per variant before timing (default 5; 1 with ``quick``)."""
    target_sample_ms: Optional[float] = None
    """Each sample spans about this long (default 20 ms on CPU, 5 ms on CUDA; a single
    call with ``quick``)."""
    compile: Literal["auto", "on", "off"] = "auto"
    compile_budget_s: float = 180.0
    rtol: Optional[float] = None
    """Output tolerance relative to the output scale (default 1e-4 on CPU; 2e-3 on CUDA,
    where cuDNN convolutions use TF32 by default)."""
    threads: Optional[int] = None
    """``torch.set_num_threads`` for the run (default: leave PyTorch's choice)."""

    def measure_options(self) -> MeasureOptions:
        cuda = self.device.startswith("cuda")
        if self.quick:
            rounds, warmup, target = 2, 1, 0.0
        else:
            rounds, warmup, target = 25, 5, (5.0 if cuda else 20.0)
        return MeasureOptions(
            rounds=self.rounds if self.rounds is not None else rounds,
            warmup=self.warmup if self.warmup is not None else warmup,
            target_sample_s=(self.target_sample_ms if self.target_sample_ms is not None else target) / 1e3,
            max_calls=1 if self.quick else 200,
            rtol=self.rtol if self.rtol is not None else (2e-3 if cuda else 1e-4),
        )

    def validate(self) -> torch.device:
        """The device to run on, after checking every option (``ValueError`` naming the
        bad one)."""
        try:
            device = torch.device(self.device)
        except RuntimeError as exc:
            raise ValueError(f"benchmarks.suite: --device {self.device!r} is not a device: {exc}") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"benchmarks.suite: --device must be cpu or cuda, got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("benchmarks.suite: --device cuda, but CUDA is not available here (torch.cuda)")
        unknown = [f for f in self.families if f not in FAMILIES]
        if unknown or not self.families:
            raise ValueError(f"benchmarks.suite: unknown models {unknown}; known models: {', '.join(FAMILIES)}")
        if self.rounds is not None and self.rounds < 1:
            raise ValueError(f"benchmarks.suite: --rounds must be at least 1, got {self.rounds}")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError(f"benchmarks.suite: --warmup must be >= 0, got {self.warmup}")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"benchmarks.suite: compile must be auto, on or off, got {self.compile!r}")
        if self.compile_budget_s <= 0:
            raise ValueError(f"benchmarks.suite: --compile-budget must be positive, got {self.compile_budget_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"benchmarks.suite: --threads must be at least 1, got {self.threads}")
        return device


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_suite(
    options: SuiteOptions,
    peers: Optional[Sequence[Peer]] = None,
    log: Callable[[str], None] = _stderr,
    on_case: Optional[Callable[[dict[str, Any]], None]] = None,
) -> dict[str, Any]:
    """Run every case of ``options.families`` and return the report (see
    :mod:`benchmarks.suite.report` for its schema). ``peers`` replaces the registry
    :data:`benchmarks.suite.peers.PEERS` for inference cases; the registry is read
    at call time, so a peer appended to it takes part in the next run. ``on_case`` gets
    the report of the cases done so far after each case (the command line writes it, so
    that a run stopped by a time limit still leaves its results)."""
    device = options.validate()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    measure = options.measure_options()
    ctx = SuiteContext(device=device, compile=options.compile, compile_budget_s=options.compile_budget_s, log=log)
    chosen = list(peer_registry.PEERS) if peers is None else list(peers)
    specs = suite_cases(device.type, options.quick, options.families)
    recorded = asdict(options)
    recorded["families"] = list(options.families)
    recorded["measure"] = asdict(measure)
    env = environment(device)
    results: list[CaseResult] = []
    for i, spec in enumerate(specs, 1):
        log(f"[{i}/{len(specs)}] {spec.label} ({spec.kind})")
        if spec.kind == "train":
            result = run_training_case(spec, ctx, measure)
        else:
            result = run_inference_case(spec, ctx, measure, chosen)
        for row in result.rows:
            if row.status not in ("ok",):
                log(f"    {row.name}: {row.status} ({row.reason})")
        results.append(result)
        if on_case is not None:
            on_case(build_report(env, recorded, results))
    return build_report(env, recorded, results)
