"""One inference case: build every variant, check each against eager, time them all
in the same interleaved rounds. Everything happens under ``torch.no_grad()``."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

from .cases import CaseSpec
from .correctness import compare, tolerance
from .peers import Peer
from .results import MEASURED, CaseResult, Row
from .timing import measure_interleaved
from .variant import BuiltCase, SuiteContext, Variant, first_line

__all__ = ["MeasureOptions", "run_inference_case", "free_memory"]


@dataclass(frozen=True)
class MeasureOptions:
    rounds: int
    warmup: int
    target_sample_s: float
    """Calls per sample are chosen so that one sample lasts about this long."""
    max_calls: int
    rtol: float
    """Tolerance of outputs relative to their scale (see ``correctness.tolerance``)."""


class _Guarded:
    """A timed call that, once it has raised, stops calling (the row becomes an error
    instead of the whole case failing)."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn
        self.error: Optional[BaseException] = None

    def __call__(self) -> None:
        if self.error is None:
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - recorded and reported on the row
                self.error = exc


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _build_variants(case: BuiltCase, ctx: SuiteContext, peers: Sequence[Peer]) -> list[Variant]:
    variants: list[Variant] = []
    for make in peers:
        name = getattr(make, "peer_name", getattr(make, "__name__", "peer"))
        try:
            variants.extend(make(case, ctx))
        except Exception as exc:  # noqa: BLE001 - one broken peer must not end the run
            variants.append(Variant.unavailable(name, "error", "could not be built", detail=first_line(exc, 400)))
    return variants


def check_rows(
    variants: Sequence[Variant], inputs: Sequence[tuple], references: Sequence[Any], rtol: float
) -> list[Row]:
    """A row per variant, with its largest error against eager over all ``inputs``."""
    tol = max(tolerance(ref, rtol) for ref in references)
    rows = []
    for v in variants:
        if v.status != "ok":
            rows.append(Row(v.name, v.status, v.reason, v.detail, info=dict(v.info)))
            continue
        row = Row(v.name, "ok", setup_s=v.setup_s, setup_what=v.setup_what, tolerance=tol, info=dict(v.info))
        try:
            # Compare each output at once: a CUDA graph's output buffer is overwritten
            # by its next replay.
            worst = None
            for xs, ref in zip(inputs, references):
                c = compare(v.call(*xs), ref)
                worst = c if worst is None else worst.worst(c)
        except Exception as exc:  # noqa: BLE001 - a variant that raises is a row with the error
            row.status, row.reason, row.detail = "error", "raised when called", first_line(exc, 400)
            rows.append(row)
            continue
        assert worst is not None
        row.max_abs_err = worst.max_abs_err
        if worst.max_abs_err > tol:
            row.status = "WRONG"
            row.reason = worst.reason or f"max abs error {worst.max_abs_err:.2e} > tolerance {tol:.1e}"
        rows.append(row)
    return rows


def time_rows(rows: list[Row], calls: dict[str, Callable[[], Any]], ctx: SuiteContext, opts: MeasureOptions) -> None:
    """Fill ``samples_ms`` of every measured row, all rows interleaved in each round."""
    guarded = {row.name: _Guarded(calls[row.name]) for row in rows if row.status in MEASURED}
    measured = measure_interleaved(
        dict(guarded),
        ctx.clock,
        rounds=opts.rounds,
        warmup=opts.warmup,
        target_sample_s=opts.target_sample_s,
        max_calls=opts.max_calls,
    )
    for row in rows:
        if row.name not in guarded:
            continue
        error = guarded[row.name].error
        if error is not None:
            row.status, row.reason, row.detail = "error", "raised while timed", first_line(error, 400)
            continue
        row.samples_ms = measured[row.name].samples_ms
        row.calls_per_sample = measured[row.name].calls_per_sample


def run_inference_case(spec: CaseSpec, ctx: SuiteContext, opts: MeasureOptions, peers: Sequence[Peer]) -> CaseResult:
    device = ctx.device
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model = spec.build().to(device).eval()
        inputs = spec.make_inputs(device, generator)
        fresh = spec.make_inputs(device, generator)
        references = [model(*inputs), model(*fresh)]
        case = BuiltCase(spec, model, inputs, device)
        variants = _build_variants(case, ctx, peers)
        names = [v.name for v in variants]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmarks.suite: two variants of {spec.id} share a name: {names}")
        rows = check_rows(variants, [inputs, fresh], references, opts.rtol)
        calls = {v.name: (lambda v=v: v.call(*inputs)) for v in variants if v.call is not None}
        time_rows(rows, calls, ctx, opts)
        for variant, row in zip(variants, rows):
            if variant.info_after is not None:
                row.info.update(variant.info_after())
    del variants, calls, case, model, references
    free_memory(device)
    return CaseResult(
        id=spec.id,
        family=spec.family,
        label=spec.label,
        kind="inference (no_grad)",
        params=dict(spec.params),
        input_shapes=[list(s) for s in spec.input_shapes],
        rounds=opts.rounds,
        warmup=opts.warmup,
        correctness="max abs error of the outputs vs eager, on the timed input and one fresh random input",
        rows=rows,
    )
