"""One training case: a full step (forward, MSE loss, backward, SGD step), the plain
model against streamsched. The SGD step is over the original model's parameters, except
in the ``fused_parameters()`` variants (:data:`STACKED_CONFIGS`), whose optimizer steps
each fused group as one stacked tensor (:mod:`streamsched.optim`), and in the
hand-written stacked model (:data:`HAND_WRITTEN`: ``StackedFCN``, ``StackedCritics``,
built from the same initial weights), which holds each layer's weights of all members as
one parameter: the bound the ``fused_parameters()`` variant is measured against.

Correctness is checked on gradients: before any step, every variant runs one forward
and backward on the same weights and input, and every parameter's ``.grad`` must equal
eager's within :data:`GRAD_ATOL`; a missing gradient is an infinite error. The
hand-written model's stacked gradients are cut per member (its ``member_grads()``) and
compared with the plain model's per-member gradients.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.zoo import CriticEnsemble, ParallelFCN, StackedCritics, StackedFCN
from streamsched import StreamScheduledModule

from .cases import CaseSpec
from .correctness import compare, tolerance
from .inference import MeasureOptions, free_memory, time_rows
from .results import CaseResult, Row
from .variant import SuiteContext, first_line, settle

__all__ = [
    "GRAD_ATOL",
    "TRAIN_CONFIGS",
    "STACKED_CONFIGS",
    "HAND_WRITTEN",
    "hand_written_model",
    "run_training_case",
    "grad_error",
]

GRAD_ATOL = 1e-5
"""Largest absolute difference of any gradient element from eager's."""

TRAIN_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("streamsched", {}),
    ("streamsched, grad_handoff=direct", {"grad_handoff": "direct"}),
    ("streamsched, no fusion", {"fuse": False}),
]

STACKED_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("streamsched, fused_parameters()", {}),
]
"""Variants whose optimizer is built over ``sm.fused_parameters()`` (called right after
the first call, so the gradient check covers the stacked route too)."""


HAND_WRITTEN = "stacked baddbmm (hand-written)"
"""The row of the hand-written stacked model (the inference peer of the same name, with
its weights as trained parameters)."""


def hand_written_model(model: nn.Module) -> Optional[nn.Module]:
    """The hand-written stacked rewrite of ``model`` (same weights), or ``None`` for a
    model without one."""
    if isinstance(model, ParallelFCN):
        return StackedFCN(model)
    if isinstance(model, CriticEnsemble):
        return StackedCritics(model)
    return None


def _named_grads(model: nn.Module) -> dict[str, Optional[torch.Tensor]]:
    member_grads = getattr(model, "member_grads", None)
    if callable(member_grads):
        return member_grads()
    return {name: p.grad for name, p in model.named_parameters()}


def grad_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> tuple[float, str | None]:
    """Largest ``|grad - reference grad|`` over all parameters, and the first parameter
    whose gradient is missing (or mis-shaped), if any. A model with ``member_grads()``
    (a hand-written stacked model) is compared through it: its stacked gradients cut per
    member, under the plain model's names."""
    worst = 0.0
    grads = _named_grads(model)
    for name, ref in reference.items():
        g = grads.get(name)
        if g is None:
            return math.inf, f"no .grad for {name}"
        if g.shape != ref.shape:
            return math.inf, f"{name}.grad has shape {tuple(g.shape)}, expected {tuple(ref.shape)}"
        worst = max(worst, float((g.double() - ref.double()).abs().max()))
    return worst, None


def run_training_case(spec: CaseSpec, ctx: SuiteContext, opts: MeasureOptions) -> CaseResult:
    device = ctx.device
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    base = spec.build().to(device).train()
    (x,) = spec.make_inputs(device, generator)
    with torch.no_grad():
        target = torch.randn(base(x).shape, generator=generator).to(device)

    def loss_of(model: nn.Module) -> tuple[torch.Tensor, Any]:
        out = model(x)
        return F.mse_loss(out, target), out

    eager_model = copy.deepcopy(base)
    optimized: dict[str, list[torch.Tensor]] = {"eager": list(eager_model.parameters())}
    eager_row = Row("eager", "ok", info={"optimizer_tensors": len(optimized["eager"])})
    variants: list[tuple[str, nn.Module, Row]] = [("eager", eager_model, eager_row)]
    configs = [(n, c, False) for n, c in TRAIN_CONFIGS] + [(n, c, True) for n, c in STACKED_CONFIGS]
    for name, config, stacked in configs:
        row = Row(name, "ok", info={"config": config})
        try:
            sm = StreamScheduledModule(copy.deepcopy(base), **config)
            (loss, _), row.setup_s = ctx.timed(lambda sm=sm: loss_of(sm))
            row.setup_what = "first call (trace + fuse + plan), forward only"
            loss.backward()
            plan = sm.plan
            if plan is not None:
                row.info.update(executor=plan.executor, tasks=len(plan.tasks), fused_groups=len(plan.fused_groups))
            optimized[name] = sm.fused_parameters() if stacked else list(sm.module.parameters())
            row.info["optimizer_tensors"] = len(optimized[name])
            if stacked:
                row.info["optimizer_params"] = "sm.fused_parameters()"
        except Exception as exc:  # noqa: BLE001 - a failing variant is a row
            row.status, row.reason, row.detail = "error", "first call failed", first_line(exc, 400)
            sm = None
        variants.append((name, sm, row))
    hand = hand_written_model(base)
    if hand is not None:
        hand = hand.to(device).train()
        optimized[HAND_WRITTEN] = list(hand.parameters())
        row = Row(HAND_WRITTEN, "ok", info={"model": type(hand).__name__})
        row.info["optimizer_tensors"] = len(optimized[HAND_WRITTEN])
        variants.append((HAND_WRITTEN, hand, row))

    # Reference gradients, then every variant's on the same (unchanged) weights.
    eager_model.zero_grad(set_to_none=True)
    ref_loss, ref_out = loss_of(eager_model)
    ref_loss.backward()
    ref_grads = {n: p.grad.detach().clone() for n, p in eager_model.named_parameters() if p.grad is not None}
    out_tol = tolerance(ref_out, opts.rtol)
    for _, model, row in variants:
        if row.status != "ok":
            continue
        model.zero_grad(set_to_none=True)
        loss, out = loss_of(model)
        loss.backward()
        g_err, g_reason = grad_error(model.module if isinstance(model, StreamScheduledModule) else model, ref_grads)
        o = compare(out, ref_out)
        row.max_abs_err, row.tolerance = g_err, GRAD_ATOL
        row.info["output_max_abs_err"] = o.max_abs_err if math.isfinite(o.max_abs_err) else None
        row.info["output_tolerance"] = out_tol
        if g_err > GRAD_ATOL:
            row.status = "WRONG"
            row.reason = g_reason or f"max abs gradient error {g_err:.2e} > {GRAD_ATOL:.0e}"
        elif o.max_abs_err > out_tol:
            row.status = "WRONG"
            row.reason = o.reason or f"max abs output error {o.max_abs_err:.2e} > tolerance {out_tol:.1e}"
        model.zero_grad(set_to_none=True)

    def step_of(model: nn.Module, params: list[torch.Tensor]) -> Callable[[], None]:
        optimizer = torch.optim.SGD(params, lr=1e-3)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            loss, _ = loss_of(model)
            loss.backward()
            optimizer.step()

        return step

    rows = [row for _, _, row in variants]
    calls = {name: step_of(model, optimized[name]) for name, model, row in variants if model is not None}
    for name, model, row in variants:
        if row.status == "ok" and isinstance(model, StreamScheduledModule):
            trial_steps, trial_s = settle(model, calls[name], ctx)
            if trial_steps:
                row.setup_s = (row.setup_s or 0.0) + trial_s
                row.setup_what = f"{row.setup_what}; then {trial_steps} steps of the executor trial"
    time_rows(rows, calls, ctx, opts)
    del variants, calls, base, eager_model
    free_memory(device)
    return CaseResult(
        id=spec.id,
        family=spec.family,
        label=spec.label,
        kind="training step (forward + backward + SGD)",
        params=dict(spec.params),
        input_shapes=[list(s) for s in spec.input_shapes],
        rounds=opts.rounds,
        warmup=opts.warmup,
        correctness=(
            f"max abs error of every parameter's .grad vs eager after one forward+backward on the same weights "
            f"(tolerance {GRAD_ATOL:.0e}; with fused_parameters() the members' .grad are views of the stacked "
            "gradients; the hand-written stacked model's gradients are cut per member); the output error is in info"
        ),
        rows=rows,
    )
