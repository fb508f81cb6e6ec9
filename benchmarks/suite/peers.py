"""The peers every case is measured against, and streamsched's own variants.

A *peer* is a function ``peer(case, ctx) -> list[Variant]``: an empty list when it does
not apply to the case (no grouped-conv rewrite of Inception), a variant with status
``"n/a"``/``"skipped"`` when it applies but cannot or should not run, with the reason.
:data:`PEERS` is the registry the suite walks, in table order; a peer that raises is
reported as an ``error`` row under its ``peer_name`` and the suite carries on.

Inference peers run under ``torch.no_grad()`` (the suite holds it while building,
checking and timing); the first call of a compiled or wrapped model happens here, timed,
so that its one-off cost is reported apart from the steady state.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Optional

import torch
from torch import nn

from benchmarks.zoo import CriticEnsemble, GroupedConvFCN, HandStackedCritics, ParallelFCN, StackedFCN
from streamsched import StreamScheduledModule
from streamsched.testing import last_path

from .variant import BuiltCase, SuiteContext, Variant, first_line, settle

__all__ = [
    "PEERS",
    "Peer",
    "peer",
    "compile_skip_reason",
    "eager",
    "jit_script",
    "torch_compile",
    "vmap_ensemble",
    "hand_rewrites",
    "cuda_graph",
    "streamsched_variants",
    "streamsched_configs",
]

Peer = Callable[[BuiltCase, SuiteContext], "list[Variant]"]


def peer(name: str) -> Callable[[Peer], Peer]:
    """Name a peer for its error row (``@peer("torch.compile")``)."""

    def mark(fn: Peer) -> Peer:
        fn.peer_name = name  # type: ignore[attr-defined]
        return fn

    return mark


@peer("eager")
def eager(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """The model as written: the reference every ratio divides by."""
    return [Variant("eager", call=case.model)]


@peer("torch.jit.script")
def jit_script(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    name = "torch.jit.script"
    try:
        with warnings.catch_warnings():
            # TorchScript is deprecated in recent releases; the warning is not news here.
            warnings.simplefilter("ignore")
            scripted, seconds = ctx.timed(lambda: torch.jit.script(case.model))
    except Exception as exc:  # noqa: BLE001 - any scripting failure means "does not script"
        return [Variant.unavailable(name, "n/a", "does not script", detail=first_line(exc, 400))]
    return [Variant(name, call=scripted, setup_s=seconds, setup_what="script")]


def compile_skip_reason(case: BuiltCase, ctx: SuiteContext) -> Optional[str]:
    """Why ``torch.compile`` is not run for this case, or ``None`` to run it."""
    if ctx.compile == "off":
        return "disabled (--no-compile)"
    if case.spec.family in ctx.over_budget:
        return ctx.over_budget[case.spec.family]
    if ctx.compile == "auto" and not case.spec.small:
        return f"not a small model: compiling it on {ctx.device.type} takes minutes; run with --compile to include it"
    return None


@peer("torch.compile")
def torch_compile(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """``torch.compile`` with the default mode; on CUDA also ``mode="reduce-overhead"``
    (CUDA graphs). The compile time is the first call's time, reported apart."""
    modes: list[tuple[str, Optional[str]]] = [("torch.compile", None)]
    if ctx.device.type == "cuda":
        modes.append(("torch.compile reduce-overhead", "reduce-overhead"))
    skip = compile_skip_reason(case, ctx)
    if skip is not None:
        return [Variant.unavailable(name, "skipped", skip) for name, _ in modes]
    # A fresh dynamo cache per case: the models share forward code objects, and the
    # recompile limit per code object would otherwise be reached over the suite.
    torch._dynamo.reset()
    out = []
    for name, mode in modes:
        model = case.model if mode is None else case.model_copy()
        compiled = torch.compile(model, mode=mode, dynamic=False)
        try:
            _, seconds = ctx.timed(lambda compiled=compiled: compiled(*case.inputs))
        except Exception as exc:  # noqa: BLE001 - report the failure as a row, keep going
            out.append(Variant.unavailable(name, "error", "compile failed", detail=first_line(exc, 400)))
            continue
        if seconds > ctx.compile_budget_s:
            ctx.over_budget[case.spec.family] = (
                f"torch.compile of {case.spec.id} took {seconds:.0f} s, over the {ctx.compile_budget_s:.0f} s budget"
            )
        out.append(Variant(name, call=compiled, setup_s=seconds, setup_what="compile (first call)"))
    return out


def _functional_ensemble(members: nn.ModuleList, in_dim: Optional[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``torch.func`` ensembling: stacked member states, one ``vmap(functional_call)``."""
    from torch.func import functional_call, stack_module_state, vmap

    params, buffers = stack_module_state(list(members))
    params = {k: v.detach() for k, v in params.items()}
    base = copy.deepcopy(members[0]).to("meta")

    def one(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(base, (p, b), (x,))

    batched = vmap(one, in_dims=(0, 0, in_dim))
    return lambda x: batched(params, buffers, x)


@peer("torch.func vmap")
def vmap_ensemble(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """The ``torch.func`` model-ensembling recipe, for the ensemble-shaped models."""
    model = case.model
    name = "torch.func vmap"
    if isinstance(model, CriticEnsemble):
        run = _functional_ensemble(model.critics, None)
        return [Variant(name, call=run)]
    if isinstance(model, ParallelFCN):
        run = _functional_ensemble(model.mlps, 0)
        n, d_in = model.n, model.d_in

        def call(x: torch.Tensor) -> torch.Tensor:
            b = x.shape[0]
            # member i reads columns [d_in*i, d_in*(i+1)): a [n, b, d_in] view
            y = run(x.view(b, n, d_in).transpose(0, 1))
            return y.transpose(0, 1).reshape(b, -1)

        return [Variant(name, call=call)]
    return []


@peer("hand-written rewrites")
def hand_rewrites(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """The reference case's well-known rewrites: two grouped Conv1d, two baddbmm; for the
    critics (inference) three ``baddbmm`` over weights stacked ``[n, in, out]``."""
    model = case.model
    if isinstance(model, CriticEnsemble):
        return [Variant("stacked baddbmm (hand-written)", call=HandStackedCritics(model).to(case.device))]
    if not isinstance(model, ParallelFCN):
        return []
    grouped = GroupedConvFCN(model).to(case.device).eval()
    stacked = StackedFCN(model).to(case.device).eval()
    return [
        Variant("grouped conv (hand-written)", call=grouped),
        Variant("stacked baddbmm (hand-written)", call=stacked),
    ]


@peer("CUDA graph")
def cuda_graph(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """The eager model captured into one single-stream CUDA graph (``torch.cuda.graphs``);
    each call copies the inputs into the static buffers and replays."""
    if ctx.device.type != "cuda":
        return []
    name = "CUDA graph (eager, 1 stream)"
    model = case.model
    static_in = tuple(x.clone() for x in case.inputs)

    def capture() -> tuple[torch.cuda.CUDAGraph, Any]:
        # Warm up on a side stream, as capture requires (lazy init, cuDNN autotuning).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                model(*static_in)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = model(*static_in)
        return graph, static_out

    try:
        (graph, static_out), seconds = ctx.timed(capture)
    except Exception as exc:  # noqa: BLE001 - a model that cannot be captured is a fact to report
        return [Variant.unavailable(name, "error", "capture failed", detail=first_line(exc, 400))]

    def call(*xs: torch.Tensor) -> Any:
        for dst, src in zip(static_in, xs):
            dst.copy_(src)
        graph.replay()
        return static_out

    return [Variant(name, call=call, setup_s=seconds, setup_what="capture")]


def streamsched_configs(device: torch.device) -> list[tuple[str, dict[str, Any]]]:
    """Names and options of the streamsched variants: the defaults (on CUDA also with
    ``cuda_graph="auto"``), then each executor of the device with and without fusion."""
    executors = ["serial", "streams"] if device.type == "cuda" else ["serial", "threads"]
    configs: list[tuple[str, dict[str, Any]]] = [("streamsched", {})]
    if device.type == "cuda":
        # The whole schedule captured into one CUDA graph: where the host bounds the model
        # (small batches), the graph is what removes its launch time.
        configs.append(("streamsched, cuda_graph", {"cuda_graph": "auto"}))
    for executor in executors:
        configs.append((f"streamsched {executor}", {"executor": executor, "fuse": True}))
        configs.append((f"streamsched {executor}, no fusion", {"executor": executor, "fuse": False}))
    return configs


def _plan_info(sm: StreamScheduledModule, config: dict[str, Any]) -> dict[str, Any]:
    plan = sm.plan
    if plan is None:
        return {"config": config}
    return {
        "config": config,
        "executor": plan.executor,
        "executor_reason": plan.reason,
        "tasks": len(plan.tasks),
        "num_streams": plan.num_streams,
        "cross_stream_waits": plan.cross_stream_waits,
        "fused_groups": len(plan.fused_groups),
        "fused_branches": sum(g.size for g in plan.fused_groups),
    }


@peer("streamsched")
def streamsched_variants(case: BuiltCase, ctx: SuiteContext) -> list[Variant]:
    """The model wrapped in :class:`~streamsched.StreamScheduledModule`, each variant on
    its own copy (fused parameters are re-homed into stacked storage, so two wrappers
    must not share one model)."""
    out = []
    for name, config in streamsched_configs(ctx.device):
        try:
            sm = StreamScheduledModule(case.model_copy(), **config)
            _, seconds = ctx.timed(lambda sm=sm: sm(*case.inputs))
            what = "first call (trace + fuse + plan)"
            if last_path(sm) == "as-written":
                # In inference a call structure's first call runs as written and the
                # plan is made when its size comes back: the one-off cost is both calls.
                _, again = ctx.timed(lambda sm=sm: sm(*case.inputs))
                seconds += again
                what = "first two calls (as written, then trace + fuse + plan)"
            trial_calls, trial_s = settle(sm, lambda sm=sm: sm(*case.inputs), ctx)
            if trial_calls:
                seconds += trial_s
                what += f", then {trial_calls} calls of the executor trial"
        except Exception as exc:  # noqa: BLE001 - a failing variant is a row, not the end of the run
            out.append(Variant.unavailable(name, "error", "first call failed", detail=first_line(exc, 400)))
            continue
        out.append(
            Variant(
                name,
                call=sm,
                setup_s=seconds,
                setup_what=what,
                info=_plan_info(sm, config),
                info_after=lambda sm=sm, config=config: {"timed": _plan_info(sm, config)},
            )
        )
    return out


PEERS: list[Peer] = [
    eager,
    jit_script,
    torch_compile,
    vmap_ensemble,
    hand_rewrites,
    cuda_graph,
    streamsched_variants,
]
"""The peers of inference cases, in table order; ``eager`` must stay first."""
