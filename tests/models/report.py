"""Print the model suite's table (docs/models.md): per model, whether eval outputs,
training gradients and training state match eager, how many submodules the plan runs
as opaque tasks, and eager vs wrapped eval time.

Run in the environment that has timm and transformers (``make test-models`` creates it):

    STREAMSCHED_DISABLE_EXT=1 .venv-cuda/bin/python tests/models/report.py [NAME ...]

Each cell is ``ok`` or the first line of the failure. The wrapper uses its default
options; the paths column lists the paths the eval check's calls ran
(``streamsched.testing.last_path``: a model whose calls never ran ``plan:*`` runs as
written, and is not scheduled). Times: median of 10 eval-mode calls under ``no_grad`` after 5 warm-up calls,
eager and wrapped interleaved, CPU, one intra-op thread (as in the tests).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The in-tree native extension is built for the main environment's torch.
os.environ.setdefault("STREAMSCHED_DISABLE_EXT", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import warnings  # noqa: E402

import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from tests.models.checks import OPTIONS, Lockstep  # noqa: E402
from tests.models.zoo import BY_NAME, SPECS, build  # noqa: E402


def _outcome(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a cell
        lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
        first = "; ".join(lines[:2]) if isinstance(exc, AssertionError) else (lines or [""])[0]
        text = f"{type(exc).__name__}: {first}" if not isinstance(exc, AssertionError) else first
        text = text.replace("|", "\\|")
        return "FAIL: " + (text if len(text) <= 160 else text[:157] + "...")
    return "ok"


def _eval(spec, base, options, paths: list):
    ls = Lockstep(spec, base, options)
    ls.eval()
    try:
        for _ in range(3):
            ls.call("eval", backward=False)
    finally:
        paths.extend(ls.paths)


def _grads(spec, base, options):
    ls = Lockstep(spec, base, options)
    ls.train()
    for _ in range(3):
        ls.call("train", backward=True)


def _state(spec, base, options):
    ls = Lockstep(spec, base, options)
    ls.train()
    for _ in range(3):
        ls.call("train", backward=True, values=False)
        ls.check_state("train")


def _median_ms(eager, wrapped, args, kwargs, warmup: int = 5, rounds: int = 10) -> tuple[float, float]:
    """Median ms per call of each, interleaved call by call."""
    samples: dict = {eager: [], wrapped: []}
    with torch.no_grad():
        for _ in range(warmup):
            eager(*args, **kwargs)
            wrapped(*args, **kwargs)
        for _ in range(rounds):
            for fn in (eager, wrapped):
                start = time.perf_counter()
                fn(*args, **kwargs)
                samples[fn].append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples[eager]), 1e3 * statistics.median(samples[wrapped])


def row(spec) -> list[str]:
    base = build(spec)
    options = OPTIONS["default"]
    paths: list = []
    cells = [_outcome(lambda: _eval(spec, base, options, paths))]
    cells += [_outcome(lambda f=f: f(spec, base, options)) for f in (_grads, _state)]
    opaque, eager_ms, wrapped_ms = "-", "-", "-"
    try:
        model = build(spec).eval()
        sm = ss.StreamScheduledModule(build(spec).eval(), **options)
        args, kwargs = spec.inputs(0)
        e_ms, w_ms = _median_ms(model, sm, args, kwargs)
        eager_ms, wrapped_ms = f"{e_ms:.1f}", f"{w_ms:.1f}"
        found = getattr(sm.plan, "opaque", None)
        if found is not None:
            opaque = str(len(found))
    except Exception as exc:  # noqa: BLE001
        print(f"{spec.name}: timing failed: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
    return [spec.name, ", ".join(paths) or "-", *cells, opaque, eager_ms, wrapped_ms]


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    chosen = [BY_NAME[n] for n in argv] if argv else SPECS
    header = ["model", "eval calls' paths", "eval", "grads", "state", "opaque submodules", "eager ms", "wrapped ms"]
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i < 5 else "---:" for i in range(len(header))) + "|")
    for spec in chosen:
        print("| " + " | ".join(row(spec)) + " |", flush=True)
    print(
        f"\ntorch {torch.__version__}, {torch.get_num_threads()} thread; streamsched {ss.__version__} "
        f"({ss.runtime_info().get('runtime', '?')} runtime)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
