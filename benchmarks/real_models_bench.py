"""Real models, eager vs wrapped vs ``torch.compile``, on the CPU: inference and a training step.

    STREAMSCHED_DISABLE_EXT=1 .venv-cuda/bin/python benchmarks/real_models_bench.py \\
        --out profiles/cpu/real-models [--models a,b] [--rounds 15] [--threads 1] [--no-compile] \\
        [--no-infer | --no-train] [--clock cpu]

torchvision, timm and Hugging Face transformers models (random weights from their
configurations, nothing downloaded). Two tables, each on by default (``--no-infer``,
``--no-train`` leave one out).

**Inference**: each model in ``eval()`` under ``torch.no_grad()``, run these ways on the
same inputs:

- ``eager``: the model as written; every ratio divides by it;
- ``eager (copy)``: a second copy of the model as written, timed like the others: the
  noise floor (two identical models in the same rounds differ by this much; where the
  memory of two copies happens to fall matters by a few percent on some models);
- ``streamsched``: ``StreamScheduledModule(model)`` with default options, after its first
  calls (the first traces and plans; the next ones are the executor trial, which may
  settle on the model's own forward: the row's ``plan`` says what was decided and why);
- ``torch.compile``: ``torch.compile(model)``, default mode (compile time reported apart).

Each variant is checked against eager (largest absolute difference on the timed input).

**Training**: each model in ``train()`` with every dropout-like rate set to 0
(:func:`derandomize`, so that copies compute the same gradients; BatchNorm updates its
running statistics every step, in every variant alike). One sample call is a full step:
forward, the loss ``sum(t.float().square().mean())`` over the output's tensors (a Hugging
Face output's ``logits``, else its ``last_hidden_state``: :func:`loss_tensors`),
``backward()``, ``torch.optim.SGD(lr=1e-3, momentum=0.9).step()``,
``zero_grad(set_to_none=True)``. Variants, each on its own deep copy of the model with its
own optimizer: ``eager``, ``eager (copy)`` (the noise floor) and ``streamsched`` (default
options; the optimizer is built after the first call, which may move parameters into
fused storage, over ``sm.module.parameters()``; then steps run until the executor trial,
which times each candidate's forward and backward, has settled, at most 60). Gradients
are checked once, after that: each variant's parameter ``.grad`` after one forward and
backward on fresh inputs against eager's on a copy loaded with the variant's current
weights (``ok`` up to :data:`GRAD_RTOL` of the largest element of each eager gradient,
:data:`GRAD_FLOOR` of the model's largest at least; nothing is stepped).

Both tables are timed in interleaved rounds (``benchmarks.suite.timing``): one sample
per variant per round, the order rotated every round, a sample lasting about
``--sample-ms``. ``--clock cpu`` times each sample in CPU seconds of the calling thread
(``time.thread_time``) instead of wall-clock seconds: on a loaded machine the wall clock
also counts the time other processes held the core. It is a fair measure of what runs on
the calling thread only: one intra-op thread (``--threads 1``), and a plan not on the
``threads`` executor (whose lanes' work it leaves out; the row's ``plan`` says which ran).
Reported per variant: median, minimum and p10-p90 spread of the samples,
the ratio of medians (eager median / variant median: above 1 is faster than eager) and
the median of the per-round ratios (each round's eager sample over the variant's, taken
close together in time, so less exposed to slow drifts of a shared machine).

These libraries live in ``.venv-cuda`` (the CUDA build of torch runs fine on a CPU); the
in-tree native extension is built for the main ``.venv``'s torch, hence
``STREAMSCHED_DISABLE_EXT=1`` (the pure-Python runtime). ``--out`` takes a folder
(``real_models.json`` and ``real_models.md`` are written there after every model; a
model's row has ``variants``, the inference table, and ``train``, the training one).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The repository root, last on the path: benchmarks.suite comes from this checkout;
# streamsched from PYTHONPATH (another tree, to compare) or the installed package.
sys.path.append(str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.suite.correctness import compare, tolerance  # noqa: E402
from benchmarks.suite.report import environment  # noqa: E402
from benchmarks.suite.timing import Clock, Measurement, Stats, measure_interleaved  # noqa: E402
from benchmarks.zoo.real import (  # noqa: E402
    Inputs,
    MLPEnsemble,
    ResNetEnsemble,
    hf_model,
    images,
    timm_model,
    tokens,
    torchvision_model,
    vectors,
)
from streamsched.planning import signatures  # noqa: E402


class CpuClock(Clock):
    """Seconds of the calling thread's CPU time per call (``--clock cpu``)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))

    def per_call_s(self, fn: Callable[[], Any], calls: int) -> float:
        begin = time.thread_time()
        for _ in range(calls):
            fn()
        return (time.thread_time() - begin) / calls


@dataclass(frozen=True)
class Case:
    name: str
    library: str
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Inputs]
    """Fresh inputs ``(args, kwargs)`` from a seed."""
    note: str


_VOCAB = 1000
_DECODER = dict(
    vocab_size=_VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=256,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

CASES = [
    Case("resnext50_32x4d", "torchvision", torchvision_model("resnext50_32x4d"), images(1, 128), "1x3x128x128"),
    Case("densenet121", "torchvision", torchvision_model("densenet121"), images(1, 128), "1x3x128x128"),
    Case(
        "googlenet",
        "torchvision",
        torchvision_model("googlenet", aux_logits=False, init_weights=False),
        images(1, 128),
        "1x3x128x128; inception towers",
    ),
    Case(
        "resnet18_x3",
        "torchvision",
        partial(ResNetEnsemble, 3, num_classes=10, source="torchvision"),
        images(2, 64),
        "3 resnet18s, 2x3x64x64",
    ),
    Case("vit_tiny_patch16_224", "timm", timm_model("vit_tiny_patch16_224"), images(1, 224), "1x3x224x224"),
    Case(
        "swin_tiny_patch4_window7_224",
        "timm",
        timm_model("swin_tiny_patch4_window7_224"),
        images(1, 224),
        "1x3x224x224",
    ),
    Case("inception_v3", "timm", timm_model("inception_v3"), images(1, 149), "1x3x149x149; inception towers"),
    Case("convnext_atto", "timm", timm_model("convnext_atto"), images(1, 128), "1x3x128x128"),
    Case("repvgg_a0", "timm", timm_model("repvgg_a0"), images(1, 128), "1x3x128x128"),
    Case(
        "mlp_x16",
        "torch",
        partial(MLPEnsemble, 16, d_in=64, hidden=256, d_out=1, activation=nn.ReLU, mean=False),
        vectors(32, 64),
        "16 MLPs 64-256-256-1, batch 32",
    ),
    Case(
        "bert",
        "transformers",
        hf_model(
            "BertConfig",
            "BertModel",
            vocab_size=_VOCAB,
            hidden_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=256,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        tokens(2, 64, _VOCAB, padded=False),
        "BertModel, 4 layers, hidden 128; ids 2x64",
    ),
    Case(
        "mixtral",
        "transformers",
        hf_model("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **_DECODER),
        tokens(2, 32, _VOCAB, padded=False, use_cache=False),
        "MixtralForCausalLM, 4 layers, hidden 128, 4 experts top-2; ids 2x32",
    ),
    Case(
        "qwen2_moe",
        "transformers",
        hf_model(
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=128,
            **_DECODER,
        ),
        tokens(2, 32, _VOCAB, padded=False, use_cache=False),
        "Qwen2MoeForCausalLM, 4 layers, hidden 128, 4 experts top-2 + shared; ids 2x32",
    ),
    Case(
        "gpt2",
        "transformers",
        hf_model("GPT2Config", "GPT2LMHeadModel", vocab_size=_VOCAB, n_embd=128, n_layer=4, n_head=4, n_positions=128),
        tokens(2, 32, _VOCAB, padded=False, use_cache=False),
        "GPT2LMHeadModel, 4 layers, n_embd 128; ids 2x32",
    ),
]
BY_NAME = {c.name: c for c in CASES}


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _plan_info(sm: ss.StreamScheduledModule, first_s: float, trial_calls: int) -> dict[str, Any]:
    plan = sm.plan
    return {
        "executor": plan.executor,
        "mode": plan.mode,
        "reason": plan.reason,
        "tasks": len(plan.tasks),
        "fused_groups": len(plan.fused_groups),
        "opaque": len(plan.opaque),
        "trial": plan.trial.model_dump() if getattr(plan, "trial", None) is not None else None,
        "first_call_s": round(first_s, 3),
        "settle_calls": trial_calls,
    }


def _summarize(measured: dict[str, Measurement], info: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per variant: its ``info`` and the statistics of its samples against eager's."""
    eager = measured["eager"].samples_ms
    variants: dict[str, dict[str, Any]] = {}
    for name, m in measured.items():
        stats = Stats.of(m.samples_ms)
        per_round = [e / v for e, v in zip(eager, m.samples_ms)]
        variants[name] = {
            **info[name],
            **{k: round(v, 4) for k, v in stats.to_dict().items()},
            "speedup_vs_eager": round(statistics.median(eager) / stats.median_ms, 4),
            "median_round_ratio": round(statistics.median(per_round), 4),
            "calls_per_sample": m.calls_per_sample,
            "samples_ms": [round(s, 4) for s in m.samples_ms],
        }
    for name in info:
        if name not in measured:
            variants[name] = info[name]
    return variants


def _measure(fns: dict[str, Callable[[], Any]], args: argparse.Namespace) -> dict[str, Measurement]:
    return measure_interleaved(
        fns,
        CpuClock() if getattr(args, "clock", "wall") == "cpu" else Clock(torch.device("cpu")),
        rounds=args.rounds,
        warmup=args.warmup,
        target_sample_s=args.sample_ms / 1e3,
        max_calls=200,
    )


def run_inference(case: Case, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    model = case.build().eval()
    call_args, call_kwargs = case.inputs(1)
    with torch.no_grad():
        reference = model(*call_args, **call_kwargs)
        tol = tolerance(reference, 1e-4)
        # Every variant runs a copy made here, one after another (the wrapper's fusion
        # moves parameters, so it cannot share the reference's).
        eager, twin = copy.deepcopy(model), copy.deepcopy(model)
        fns: dict[str, Callable[[], Any]] = {
            "eager": lambda: eager(*call_args, **call_kwargs),
            "eager (copy)": lambda: twin(*call_args, **call_kwargs),
        }
        info: dict[str, dict[str, Any]] = {"eager": {}, "eager (copy)": {}}

        sm = ss.StreamScheduledModule(copy.deepcopy(model))
        # The first call traces and plans, as measured before a first call in inference ran
        # as written (the plan would otherwise be made by the next call, untimed).
        first_as_written, signatures.FIRST_CALL_AS_WRITTEN = signatures.FIRST_CALL_AS_WRITTEN, False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # an untraceable model says so once; the plan says it too
                out, first_s = _timed(lambda: sm(*call_args, **call_kwargs))
        finally:
            signatures.FIRST_CALL_AS_WRITTEN = first_as_written
        # The executor trial (and, for an untraceable forward, the check for branch
        # calls) takes the next calls; then the wrapper runs what it settled on.
        calls = 0
        while calls < 60 and (calls < 5 or getattr(sm._ss.last, "trial", None) is not None):
            sm(*call_args, **call_kwargs)
            calls += 1
        fns["streamsched"] = lambda: sm(*call_args, **call_kwargs)
        info["streamsched"] = _plan_info(sm, first_s, calls)

        if args.compile and case.name not in args.no_compile_for:
            torch._dynamo.reset()
            compiled = torch.compile(copy.deepcopy(model))
            try:
                _, compile_s = _timed(lambda: compiled(*call_args, **call_kwargs))
                fns["torch.compile"] = lambda: compiled(*call_args, **call_kwargs)
                info["torch.compile"] = {"compile_s": round(compile_s, 1)}
            except Exception as exc:  # noqa: BLE001 - reported on the row
                info["torch.compile"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}

        for name, fn in list(fns.items()):
            c = compare(fn(), reference)
            info[name]["max_abs_err"] = c.max_abs_err
            info[name]["ok"] = c.max_abs_err <= tol
            if c.reason:
                info[name]["mismatch"] = c.reason
        measured = _measure(fns, args)
    return _summarize(measured, info)


# --- training -------------------------------------------------------------------------------

_RATE_ATTRIBUTES = ("p", "drop_prob", "drop_rate", "dropout", "attention_dropout", "dropout_p", "layerdrop")

GRAD_RTOL = 1e-3
"""Largest difference of a parameter's gradient from eager's, relative to the largest
element of eager's gradient of that parameter, or to :data:`GRAD_FLOOR` times the
largest element of any of eager's gradients where that is larger (float32 sums in
another order differ by about 1e-6 of it; a wrong or missing gradient by all of it)."""

GRAD_FLOOR = 1e-3
"""A gradient that is zero in exact arithmetic (the key bias of attention: softmax
ignores a constant added to a row) comes out as float32 noise, 1e-19 here, 1e-18 there:
each parameter's scale is at least this fraction of the model's largest gradient."""


def derandomize(model: nn.Module) -> nn.Module:
    """Every dropout-like rate of ``model`` set to 0 (module attributes and the
    transformers config's ``*dropout*``/``*drop_prob*`` probabilities), so that two
    copies of the model compute the same gradients."""
    for m in model.modules():
        for name in _RATE_ATTRIBUTES:
            value = getattr(m, name, None)
            if isinstance(value, float) and value > 0:
                setattr(m, name, 0.0)
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for key, value in list(vars(config).items()):
                if "drop" in key and isinstance(value, float) and value > 0:
                    setattr(config, key, 0.0)
    return model


def loss_tensors(out: Any) -> list[torch.Tensor]:
    """What the training loss reads: a Hugging Face output's ``logits`` (else its
    ``last_hidden_state``), else every floating-point tensor in ``out`` (nested tuples,
    lists and dicts)."""
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    for key in ("logits", "last_hidden_state"):
        value = out.get(key) if isinstance(out, Mapping) else getattr(out, key, None)
        if isinstance(value, torch.Tensor):
            return [value]
    if isinstance(out, Mapping):
        values: Any = out.values()
    elif isinstance(out, (tuple, list)):
        values = out
    else:
        return []
    return [t for v in values for t in loss_tensors(v)]


def training_loss(out: Any) -> torch.Tensor:
    """``sum(t.float().square().mean())`` over :func:`loss_tensors`."""
    tensors = loss_tensors(out)
    if not tensors:
        raise TypeError(f"no floating-point tensor in the model's output ({type(out).__name__})")
    return sum((t.float().square().mean() for t in tensors), torch.zeros(()))


def grad_error(model: nn.Module, reference: dict[str, torch.Tensor]) -> tuple[float, float, str | None]:
    """``(relative, absolute, reason)``: the largest ``|grad - reference|`` over the
    parameters, relative to each one's scale (the largest ``|reference|`` of it, at least
    :data:`GRAD_FLOOR` times the largest of all), and absolute; ``reason`` names the
    first parameter whose gradient is missing, extra or mis-shaped (errors are then
    infinite)."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    extra = [n for n, g in grads.items() if g is not None and n not in reference]
    if extra:
        return math.inf, math.inf, f"{extra[0]} has a .grad, eager's has none"
    largest = max((float(r.abs().max()) for r in reference.values() if r.numel()), default=0.0)
    rel = absolute = 0.0
    for name, ref in reference.items():
        g = grads.get(name)
        if g is None:
            return math.inf, math.inf, f"no .grad for {name}"
        if g.shape != ref.shape:
            return math.inf, math.inf, f"{name}.grad has shape {tuple(g.shape)}, expected {tuple(ref.shape)}"
        if not ref.numel():
            continue
        diff = float((g.double() - ref.double()).abs().max())
        scale = max(float(ref.double().abs().max()), GRAD_FLOOR * largest)
        absolute = max(absolute, diff)
        rel = max(rel, diff / scale if scale > 0 else (math.inf if diff > 0 else 0.0))
    return rel, absolute, None


def _check_grads(
    base: nn.Module, model: nn.Module, call: Callable[[], Any], check_args: tuple, check_kwargs: dict
) -> dict[str, Any]:
    """One backward of ``call`` against eager's on the same weights (a copy of ``base``
    loaded with ``model``'s current state) and the same input; nothing is stepped."""
    ref = copy.deepcopy(base)
    ref.load_state_dict(model.state_dict())
    ref.zero_grad(set_to_none=True)
    training_loss(ref(*check_args, **check_kwargs)).backward()
    reference = {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    training_loss(call()).backward()
    rel, absolute, reason = grad_error(model, reference)
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {
        "grad_rel_err": rel if math.isfinite(rel) else None,
        "grad_abs_err": absolute if math.isfinite(absolute) else None,
        "grad_params": len(reference),
        "ok": rel <= GRAD_RTOL,
    }
    if reason:
        out["mismatch"] = reason
    return out


def _train_step(
    model: nn.Module, params: list[torch.Tensor], call_args: tuple, call_kwargs: dict
) -> Callable[[], None]:
    optimizer = torch.optim.SGD(params, lr=1e-3, momentum=0.9)

    def step() -> None:
        training_loss(model(*call_args, **call_kwargs)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def run_training(case: Case, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)
    base = derandomize(case.build()).train()
    call_args, call_kwargs = case.inputs(1)
    # Each variant trains its own copy with its own optimizer.
    eager, twin = copy.deepcopy(base), copy.deepcopy(base)
    fns: dict[str, Callable[[], Any]] = {
        "eager": _train_step(eager, list(eager.parameters()), call_args, call_kwargs),
        "eager (copy)": _train_step(twin, list(twin.parameters()), call_args, call_kwargs),
    }
    sm = ss.StreamScheduledModule(copy.deepcopy(base))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The first call traces, fuses (which may move parameters) and plans: the
        # optimizer is built over the parameters it leaves.
        out, first_s = _timed(lambda: sm(*call_args, **call_kwargs))
        training_loss(out).backward()
        sm.zero_grad(set_to_none=True)
        fns["streamsched"] = _train_step(sm, list(sm.module.parameters()), call_args, call_kwargs)
        # The executor trial times forward and backward of the next steps.
        calls = 0
        while calls < 60 and (calls < 5 or getattr(sm._ss.last, "trial", None) is not None):
            fns["streamsched"]()
            calls += 1
    info: dict[str, dict[str, Any]] = {
        "eager": {},
        "eager (copy)": {},
        "streamsched": {**_plan_info(sm, first_s, calls), "settled": getattr(sm._ss.last, "trial", None) is None},
    }
    # Gradients, once, on fresh inputs: each variant's current weights, eager on a copy.
    check_args, check_kwargs = case.inputs(2)
    for name, model, call in (
        ("eager", eager, lambda: eager(*check_args, **check_kwargs)),
        ("eager (copy)", twin, lambda: twin(*check_args, **check_kwargs)),
        ("streamsched", sm.module, lambda: sm(*check_args, **check_kwargs)),
    ):
        info[name].update(_check_grads(base, model, call, check_args, check_kwargs))
    return _summarize(_measure(fns, args), info)


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    row: dict[str, Any] = {"name": case.name, "library": case.library, "input": case.note}
    if args.infer:
        row["variants"] = run_inference(case, args)
        gc.collect()
    if args.train:
        row["train"] = run_training(case, args)
        gc.collect()
    return row


def _cell(r: dict[str, Any] | None) -> str:
    if r is None or "speedup_vs_eager" not in r:
        return "error" if r and "error" in r else ""
    flag = "" if r.get("ok", True) else " WRONG"
    return f"{r['speedup_vs_eager']:.3f}x ({r['median_round_ratio']:.3f}){flag}"


def _runs(plan: dict[str, Any]) -> str:
    runs = plan["executor"]
    if plan.get("trial"):
        best = plan["trial"]["best_us"]
        runs += " (" + ", ".join(f"{k} {us / 1e3:.2f}" for k, us in sorted(best.items(), key=lambda kv: kv[1])) + " ms)"
    elif plan["mode"] == "eager-dispatch":
        runs += " (untraceable, no branch calls)"
    if plan.get("settled") is False:
        runs += f"; trial not settled after {plan['settle_calls']} steps"
    return runs


def _grads(r: dict[str, Any]) -> str:
    if r.get("ok"):
        return f"ok ({r['grad_rel_err']:.1e})"
    return f"WRONG ({r.get('mismatch') or r.get('grad_rel_err')})"


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Real models on the CPU: eager, streamsched, torch.compile",
        "",
        f"{env['device_name']}, {env['threads']} intra-op thread(s), torch {env['torch']}, "
        f"streamsched {env['streamsched']} ({env['runtime_info'].get('runtime', 'runtime ?')}), {env['date']}; "
        f"{report['options']['rounds']} interleaved rounds, samples of about {report['options']['sample_ms']:.0f} ms"
        + (" of the calling thread's CPU time." if report["options"].get("clock") == "cpu" else " (wall clock)."),
        "",
        "Speedup over eager: ratio of medians (median of the per-round ratios in brackets); "
        "above 1 is faster than eager.",
    ]
    infer = [row for row in report["models"] if "variants" in row]
    if infer:
        lines += [
            "",
            "## Inference (`eval()`, `torch.no_grad()`)",
            "",
            "| model | input | eager ms | eager (copy) | streamsched | torch.compile | streamsched runs | compile s |",
            "|---|---|---:|---:|---:|---:|---|---:|",
        ]
    for row in infer:
        v = row["variants"]
        compile_s = v.get("torch.compile", {}).get("compile_s", "")
        lines.append(
            f"| {row['name']} ({row['library']}) | {row['input']} | {v['eager']['median_ms']:.2f} | "
            f"{_cell(v.get('eager (copy)'))} | {_cell(v.get('streamsched'))} | {_cell(v.get('torch.compile'))} | "
            f"{_runs(v['streamsched'])} | {compile_s} |"
        )
    train = [row for row in report["models"] if "train" in row]
    if train:
        lines += [
            "",
            "## Training step (`train()`: forward, loss, backward, SGD with momentum, zero_grad)",
            "",
            "| model | input | eager ms | eager (copy) | streamsched | gradients "
            "| streamsched runs (trial: forward + backward) |",
            "|---|---|---:|---:|---:|---|---|",
        ]
    for row in train:
        v = row["train"]
        lines.append(
            f"| {row['name']} ({row['library']}) | {row['input']} | {v['eager']['median_ms']:.2f} | "
            f"{_cell(v.get('eager (copy)'))} | {_cell(v.get('streamsched'))} | {_grads(v['streamsched'])} | "
            f"{_runs(v['streamsched'])} |"
        )
    lines += [
        "",
        "`eager (copy)`: a second copy of the model as written, in the same rounds: how far apart two identical "
        "models measure (the noise floor of the other columns).",
        "`streamsched runs`: what the wrapper settled on after its first calls (`eager`: the model's own forward, "
        "measured faster than the schedule or nothing to schedule), with the fastest trial call of each candidate "
        "(in training, a call's forward and its backward).",
    ]
    if train:
        lines.append(
            "`gradients`: every parameter's `.grad` after one forward and backward on fresh inputs, against eager "
            "on a copy with the same weights (largest difference relative to the largest element of eager's "
            f"gradient of that parameter, at least {GRAD_FLOOR:.0e} of the model's largest; ok up to "
            f"{GRAD_RTOL:.0e}). Dropout-like rates are set to 0 in training."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("out/real-models"))
    parser.add_argument("--models", default=None, help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sample-ms", type=float, default=100.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter; cpu: the calling thread's CPU time (one intra-op thread, no threads executor)",
    )
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument(
        "--infer", action=argparse.BooleanOptionalAction, default=True, help="the inference table (default: on)"
    )
    parser.add_argument(
        "--train", action=argparse.BooleanOptionalAction, default=True, help="the training-step table (default: on)"
    )
    parser.add_argument("--no-compile-for", default="", help="models not to compile (comma-separated)")
    parser.add_argument(
        "--keep-compile-cache", action="store_true", help="use inductor's usual on-disk cache (warm compile times)"
    )
    args = parser.parse_args(argv)
    args.no_compile_for = {m for m in args.no_compile_for.split(",") if m}
    names = list(BY_NAME) if args.models is None else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(BY_NAME)}")
    torch.set_num_threads(args.threads)
    if not args.keep_compile_cache:
        # Compile times from a cold start: inductor's on-disk cache of an earlier run would
        # make the second run's compiles take seconds.
        import tempfile

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="real-models-inductor-")
    out_dir = args.out
    out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "schema": "streamsched.real-models/2",
        "environment": environment(torch.device("cpu")),
        "options": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "sample_ms": args.sample_ms,
            "threads": args.threads,
            "clock": args.clock,
            "compile": args.compile,
            "infer": args.infer,
            "train": args.train,
            "compile_cache": "usual" if args.keep_compile_cache else "fresh (cold compile times)",
        },
        "models": [],
    }
    for i, name in enumerate(names, 1):
        _log(f"[{i}/{len(names)}] {name}")
        row = run_case(BY_NAME[name], args)
        report["models"].append(row)
        for table in ("variants", "train"):
            for variant, r in row.get(table, {}).items():
                label = f"{'train ' if table == 'train' else ''}{variant}"
                if "speedup_vs_eager" in r:
                    ratio = f"{r['speedup_vs_eager']:.3f}x ({r['median_round_ratio']:.3f})"
                    ok = "" if r.get("ok", True) else " WRONG"
                    _log(f"    {label:20s} {r['median_ms']:9.3f} ms  {ratio}{ok}")
                else:
                    _log(f"    {label:20s} {r}")
        (out_dir / "real_models.json").write_text(json.dumps(report, indent=1))
        (out_dir / "real_models.md").write_text(markdown(report))
    print(markdown(report))
    bad = [
        f"{m['name']}: {'train ' if table == 'train' else ''}{v}"
        for m in report["models"]
        for table in ("variants", "train")
        for v, r in m.get(table, {}).items()
        if r.get("ok") is False
    ]
    if bad:
        print("WRONG: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
