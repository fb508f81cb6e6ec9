"""Real models, eager vs wrapped vs ``torch.compile``, on the CPU.

    STREAMSCHED_DISABLE_EXT=1 .venv-cuda/bin/python benchmarks/real_models_bench.py \\
        --out profiles/cpu/real-models [--models a,b] [--rounds 15] [--threads 1] [--no-compile]

torchvision, timm and Hugging Face transformers models (random weights from their
configurations, nothing downloaded), each in ``eval()`` under ``torch.no_grad()``, run
three ways on the same inputs:

- ``eager``: the model as written; every ratio divides by it;
- ``eager (copy)``: a second copy of the model as written, timed like the others: the
  noise floor (two identical models in the same rounds differ by this much; where the
  memory of two copies happens to fall matters by a few percent on some models);
- ``streamsched``: ``StreamScheduledModule(model)`` with default options, after its first
  calls (the first traces and plans; the next ones are the executor trial, which may
  settle on the model's own forward: the row's ``plan`` says what was decided and why);
- ``torch.compile``: ``torch.compile(model)``, default mode (compile time reported apart).

Each variant is checked against eager (largest absolute difference on the timed input),
then all are timed in the same interleaved rounds (``benchmarks.suite.timing``): one
sample per variant per round, the order rotated every round, a sample lasting about
``--sample-ms``. Reported per variant: median, minimum and p10-p90 spread of the samples,
the ratio of medians (eager median / variant median: above 1 is faster than eager) and
the median of the per-round ratios (each round's eager sample over the variant's, taken
close together in time, so less exposed to slow drifts of a shared machine).

These libraries live in ``.venv-cuda`` (the CUDA build of torch runs fine on a CPU); the
in-tree native extension is built for the main ``.venv``'s torch, hence
``STREAMSCHED_DISABLE_EXT=1`` (the pure-Python runtime). ``--out`` takes a folder
(``real_models.json`` and ``real_models.md`` are written there after every model).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable

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
from benchmarks.suite.timing import Clock, Stats, measure_interleaved  # noqa: E402
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


def run_case(case: Case, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = case.build().eval()
    call_args, call_kwargs = case.inputs(1)
    row: dict[str, Any] = {"name": case.name, "library": case.library, "input": case.note, "variants": {}}
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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an untraceable model says so once; the plan says it too
            out, first_s = _timed(lambda: sm(*call_args, **call_kwargs))
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
        measured = measure_interleaved(
            fns,
            Clock(torch.device("cpu")),
            rounds=args.rounds,
            warmup=args.warmup,
            target_sample_s=args.sample_ms / 1e3,
            max_calls=200,
        )
    eager = measured["eager"].samples_ms
    for name, m in measured.items():
        stats = Stats.of(m.samples_ms)
        per_round = [e / v for e, v in zip(eager, m.samples_ms)]
        row["variants"][name] = {
            **info[name],
            **{k: round(v, 4) for k, v in stats.to_dict().items()},
            "speedup_vs_eager": round(statistics.median(eager) / stats.median_ms, 4),
            "median_round_ratio": round(statistics.median(per_round), 4),
            "calls_per_sample": m.calls_per_sample,
            "samples_ms": [round(s, 4) for s in m.samples_ms],
        }
    for name in info:
        if name not in measured:
            row["variants"][name] = info[name]
    return row


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    lines = [
        "# Real models on the CPU: eager, streamsched, torch.compile",
        "",
        f"{env['device_name']}, {env['threads']} intra-op thread(s), torch {env['torch']}, "
        f"streamsched {env['streamsched']} ({env['runtime_info'].get('runtime', 'runtime ?')}), {env['date']}; "
        f"{report['options']['rounds']} interleaved rounds, samples of about {report['options']['sample_ms']:.0f} ms.",
        "",
        "Speedup over eager: ratio of medians (median of the per-round ratios in brackets); "
        "above 1 is faster than eager.",
        "",
        "| model | input | eager ms | eager (copy) | streamsched | torch.compile | streamsched runs | compile s |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for row in report["models"]:
        v = row["variants"]
        eager = v["eager"]

        def cell(name: str, v: dict = v) -> str:
            r = v.get(name)
            if r is None or "speedup_vs_eager" not in r:
                return "error" if r and "error" in r else ""
            flag = "" if r.get("ok", True) else " WRONG"
            return f"{r['speedup_vs_eager']:.3f}x ({r['median_round_ratio']:.3f}){flag}"

        plan = v["streamsched"]
        runs = plan["executor"]
        if plan.get("trial"):
            best = plan["trial"]["best_us"]
            runs += (
                " (" + ", ".join(f"{k} {us / 1e3:.2f}" for k, us in sorted(best.items(), key=lambda kv: kv[1])) + " ms)"
            )
        elif plan["mode"] == "eager-dispatch":
            runs += " (untraceable, no branch calls)"
        compile_s = v.get("torch.compile", {}).get("compile_s", "")
        lines.append(
            f"| {row['name']} ({row['library']}) | {row['input']} | {eager['median_ms']:.2f} | "
            f"{cell('eager (copy)')} | {cell('streamsched')} | {cell('torch.compile')} | {runs} | {compile_s} |"
        )
    lines += [
        "",
        "`eager (copy)`: a second copy of the model as written, in the same rounds: how far apart two identical "
        "models measure (the noise floor of the other columns).",
        "`streamsched runs`: what the wrapper settled on after its first calls (`eager`: the model's own forward, "
        "measured faster than the schedule or nothing to schedule), with the fastest trial call of each candidate.",
    ]
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
    parser.add_argument("--no-compile", dest="compile", action="store_false")
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
        "schema": "streamsched.real-models/1",
        "environment": environment(torch.device("cpu")),
        "options": {
            "rounds": args.rounds,
            "warmup": args.warmup,
            "sample_ms": args.sample_ms,
            "threads": args.threads,
            "compile": args.compile,
            "compile_cache": "usual" if args.keep_compile_cache else "fresh (cold compile times)",
        },
        "models": [],
    }
    for i, name in enumerate(names, 1):
        _log(f"[{i}/{len(names)}] {name}")
        row = run_case(BY_NAME[name], args)
        gc.collect()
        report["models"].append(row)
        for variant, r in row["variants"].items():
            if "speedup_vs_eager" in r:
                ratio = f"{r['speedup_vs_eager']:.3f}x ({r['median_round_ratio']:.3f})"
                _log(f"    {variant:14s} {r['median_ms']:9.3f} ms  {ratio}")
            else:
                _log(f"    {variant:14s} {r}")
        (out_dir / "real_models.json").write_text(json.dumps(report, indent=1))
        (out_dir / "real_models.md").write_text(markdown(report))
    print(markdown(report))
    bad = [f"{m['name']}: {v}" for m in report["models"] for v, r in m["variants"].items() if r.get("ok") is False]
    if bad:
        print("WRONG: " + "; ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
