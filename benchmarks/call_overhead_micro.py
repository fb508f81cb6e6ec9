"""What one wrapped call costs besides the model's work, in microseconds.

    STREAMSCHED_DISABLE_EXT=1 .venv-cuda/bin/python benchmarks/call_overhead_micro.py

(the transformers and timm rows need ``.venv-cuda``; run it with ``PYTHONPATH`` pointing
at another checkout's tree, from outside this one, to compare two versions). Prints:

- a ``Linear(4, 4)`` called positionally, and a module called with keywords that
  returns a dict, eager and wrapped (``executor="serial"``): the difference is the
  wrapper's fixed cost per call; and a call passing an object argument, which runs the
  model as written (``executor="auto"``): the wrapper's fixed cost on such a call;
- ``CriticEnsemble(32)`` (batch 16, obs 17 + act 6 = 23 features), the fused plan
  (``executor="serial"``, asserted to run the compiled plan) beside the same three
  ``baddbmm`` written by hand over stacked weights, and its ratio to them. The ratio is
  guarded: above ``--max-critics-ratio`` the script says REGRESSION and exits 1 (the
  fused path's per-call cost once grew by tens of microseconds unnoticed);
- the first call of ``ParallelFCN(1000)`` at batch 1 (trace, record shapes and effects,
  fuse, plan, compile), each in a fresh process (``--first-call-processes``, the median
  is printed): CPU seconds of the calling thread, beside the goal (0.3 s on the machine
  of issue 26, where it measured 0.62 s). Guarded like the critics row: above
  ``--max-first-call-s`` the script says REGRESSION and exits 1. With ``--issue-scale
  REV`` (issue 26's tree: ``c062527^``), the same call read on the issue's machine: that
  tree, exported from git, and this one timed alternately in fresh processes
  (``profiles/cpu/first-call/calibrate.py``), the ratio of their medians times the 0.62
  s the issue measured there: as a user's first call, and with the collector off for
  the call in both (the work alone);
- for GPT-2, Mixtral and ViT-tiny (the models of ``real_models_bench.py``): the time to
  bind one call's arguments, how often one call moves the module generation (each move
  makes the next call re-check the model's structure), and what one such re-check costs.

Each figure is the fastest of 9 repetitions of a loop of calls, one intra-op thread.
The critics row is timed in CPU time of the calling thread (``time.thread_time``): with
one intra-op thread that is the call's work, and it stays readable on a loaded machine
where wall-clock figures swing by 2x; the two sides are interleaved over ``--rounds``.
``--critics-only`` skips the rows that need ``.venv-cuda``.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

import streamsched as ss
from streamsched import _generation
from streamsched.testing import last_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_models_bench as rmb  # noqa: E402

sys.path.append(str(Path(__file__).resolve().parents[1]))
from benchmarks.zoo import CriticEnsemble, HandStackedCritics  # noqa: E402

CRITICS_MAX_RATIO = 1.3
"""Guard: the fused critics call may cost at most this many times the hand-written stack.
Measured (CPU time, 1 thread, loaded 2-core machine): 1.60-1.65x with the stacked
``xs @ W^T``, which ATen's CPU ``bmm`` runs slower over the transposed weight view,
1.18-1.25x with the chain held transposed (``layout.TRANSPOSED``: its
kernels alone at the hand-written stack's time, the rest the wrapper's fixed cost per
call), 1.04-1.10x in a later round on the same machine, and 0.96-0.98x with the hot-plan
shortcut (``hot_plans.py``) and the transposed chain's links written out
(``profiles/cpu/hot-plans/``; 1.07x once under a load spike, against 1.25x for the tree
before). Earlier rounds measured (3 interleaved processes each; the same trees later
measured 1.60x and more here): 0.96-0.99x native and 1.07-1.08x pure Python with the stacks checked at once, the serial
program called directly and the fold viewed in one op (1.02-1.04x and 1.12-1.14x just
before); 1.11-1.33x and 1.31-1.44x with the specialised kernels and the one-function
serial program, 1.43-1.48x and 1.57-1.66x without them (1.54-1.70x and 1.76-1.82x before
the kept weight views); the goal of issue 26 is <= 1.0x. The guard catches a return of
the old per-call cost on a loaded machine, not a few microseconds."""


FIRST_CALL_GOAL_S = 0.3
"""The goal for the first call of ``ParallelFCN(1000)`` (issue 26: 0.62 s -> 0.3 s there).
Seconds on the issue's machine: ``profiles/cpu/first-call/calibrate.py`` times the
issue's own tree beside this one to read a figure from here on that scale (round 10:
0.42 s here, 0.245 s there)."""

FIRST_CALL_MAX_S = 0.9
"""Guard: the first call of ``ParallelFCN(1000)`` may take at most this many CPU seconds
(median of fresh processes, 1 thread). Measured on the loaded 2-core development machine
(``profiles/cpu/first-call/``): 1.06-1.16 s before the planning and recording passes were
made cheaper, 0.56-0.71 s after (trace 0.27, record 0.16, plan 0.19), 0.48-0.57 s once
the tracer did fx's per-call work itself (trace 0.17-0.19); the goal (0.3 s on the issue's
machine, which measured 0.62 s where this one measures 0.56-0.71 s) is not met: tracing,
recording and planning each take about a third of what is left. The guard catches a
return to the old cost, not the gap that is left."""

# One first call in a fresh process (imports and per-process caches as a user's first call
# finds them); prints one JSON line.
_FIRST_CALL_CHILD = r"""
import copy, json, sys, time, warnings
sys.path.insert(0, sys.argv[1])
sys.path.append(sys.argv[2])
warnings.simplefilter("ignore")
import torch
torch.set_num_threads(1)
import streamsched as ss
from benchmarks.zoo import ParallelFCN
from streamsched.planning import signatures
from streamsched.testing import last_path
# The call that traces and plans, first in its process as it was measured before a call
# structure's first call ran as written (by default that is the call whose size came back).
signatures.FIRST_CALL_AS_WRITTEN = False
torch.manual_seed(0)
model = ParallelFCN(1000).eval()
reference = copy.deepcopy(model)
x = torch.randn(1, 1000 * 20)
sm = ss.StreamScheduledModule(model)
with torch.no_grad():
    wall, cpu = time.perf_counter(), time.thread_time()
    out = sm(x)
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    path = last_path(sm)
    fresh = torch.randn(1, 1000 * 20)
    err = max(float((out - reference(x)).abs().max()), float((sm(fresh) - reference(fresh)).abs().max()))
print(json.dumps({"cpu_s": cpu, "wall_s": wall, "path": path, "groups": len(sm.plan.fused_groups), "err": err}))
"""


def first_call_row(processes: int) -> dict[str, Any]:
    """The first call of ParallelFCN(1000), batch 1, in ``processes`` fresh processes: the
    median CPU and wall seconds and every sample; each checked against eager."""
    package = str(Path(ss.__file__).resolve().parents[1])
    checkout = str(Path(__file__).resolve().parents[1])
    samples = []
    for _ in range(processes):
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_CALL_CHILD, package, checkout],
            capture_output=True,
            text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            check=False,
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"the first-call process failed:\n{done.stderr[-2000:]}")
        sample = json.loads(lines[-1])
        # Timed is the call that traced and planned, and its plan is the fused one.
        assert sample["path"] == "recorded" and sample["groups"] == 3, sample
        assert sample["err"] < 1e-5, sample
        samples.append(sample)
    return {
        "cpu_s": statistics.median(s["cpu_s"] for s in samples),
        "wall_s": statistics.median(s["wall_s"] for s in samples),
        "samples_cpu_s": [round(s["cpu_s"], 3) for s in samples],
    }


ISSUE_FIRST_CALL_S = 0.62
"""The first call as issue 26 measured it, on its machine, in its tree (``--issue-scale``)."""


def _calibrated(tree: str, mode: str) -> float:
    """CPU seconds of the planning call of ``ParallelFCN(1000)`` with ``tree``'s streamsched,
    in a fresh process, pure Python (``calibrate.py``: runs in trees of any age)."""
    script = Path(__file__).resolve().parents[1] / "profiles" / "cpu" / "first-call" / "calibrate.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STREAMSCHED_DISABLE_EXT": "1", "STREAMSCHED_REQUIRE_EXT": "0"}
    done = subprocess.run(
        [sys.executable, str(script), tree, *([mode] if mode else [])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the first call in {tree} failed:\n{done.stderr[-2000:]}")
    sample = json.loads(lines[-1])
    assert sample["fused"] == 3, sample  # the members fused: the call that plans
    return float(sample["cpu_s"])


def issue_scale_row(rev: str, processes: int) -> dict[str, Any]:
    """This tree's first call read on issue 26's machine: the tree at ``rev`` (exported from
    this checkout's git history) and this one, timed alternately in ``processes`` fresh
    processes each, as a user's first call (``user``) and with the collector off for the
    call (``work``); each figure is the ratio of the medians times
    :data:`ISSUE_FIRST_CALL_S`, beside every sample."""
    checkout = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "archive", "--format=tar", rev], cwd=checkout, capture_output=True, check=False)
    if archive.returncode != 0:
        raise RuntimeError(f"git archive {rev} in {checkout}: {archive.stderr.decode()[-500:]}")
    out: dict[str, Any] = {"rev": rev}
    with tempfile.TemporaryDirectory() as old:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(old, filter="data")
            else:  # pragma: no cover - a Python without extraction filters
                tar.extractall(old)  # noqa: S202 - this checkout's own history
        for label, mode in (("user", ""), ("work", "--nogc")):
            samples: dict[str, list[float]] = {"issue": [], "this": []}
            for _ in range(processes):
                samples["issue"].append(_calibrated(old, mode))
                samples["this"].append(_calibrated(str(checkout), mode))
            ratio = statistics.median(samples["this"]) / statistics.median(samples["issue"])
            out[label] = {
                "issue_scale_s": ratio * ISSUE_FIRST_CALL_S,
                "ratio": ratio,
                "samples_s": {k: [round(v, 3) for v in vs] for k, vs in samples.items()},
            }
    return out


def bench(fn: Callable[[], Any], n: int = 2000, reps: int = 9, clock: Callable[[], float] = time.perf_counter) -> float:
    best = float("inf")
    for _ in range(reps):
        start = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - start) / n)
    return best * 1e6


def critics_row(rounds: int) -> tuple[float, float]:
    """(fused plan, hand-written stack) in microseconds per call, CPU time, min over rounds."""
    torch.manual_seed(0)
    model = CriticEnsemble(32).eval()
    x = torch.randn(16, 23)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    hand = HandStackedCritics(model)
    with torch.no_grad():
        for _ in range(5):
            y = sm(x)
        # Timed is the compiled plan, and it is right: a fallback to the model as written
        # would time something else.
        assert last_path(sm) == "plan:serial", last_path(sm)
        fresh = torch.randn(16, 23)
        torch.testing.assert_close(sm(fresh), model(fresh))
        torch.testing.assert_close(y, hand(x), rtol=1e-4, atol=1e-5)
        fused = written = float("inf")
        for _ in range(rounds):
            fused = min(fused, bench(lambda: sm(x), 1000, 5, time.thread_time))
            written = min(written, bench(lambda: hand(x), 1000, 5, time.thread_time))
    return fused, written


class _Past:
    """An object argument (a KV cache stand-in): calls passing one run as written."""


class WithPast(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, past=None):
        return self.lin(x)


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, input_ids=None, attention_mask=None, use_cache=None, output_attentions=None, return_dict=None):
        return {"logits": self.lin(input_ids)}


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the critics row")
    parser.add_argument("--max-critics-ratio", type=float, default=CRITICS_MAX_RATIO)
    parser.add_argument("--critics-only", action="store_true", help="only the critics row (no .venv-cuda models)")
    parser.add_argument(
        "--first-call-processes", type=int, default=5, help="fresh processes timing ParallelFCN(1000)'s first call"
    )
    parser.add_argument("--max-first-call-s", type=float, default=FIRST_CALL_MAX_S)
    parser.add_argument(
        "--issue-scale",
        metavar="REV",
        default=None,
        help="read the first call on issue 26's machine, timing the tree at REV (c062527^) beside this one",
    )
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print(f"streamsched from {Path(ss.__file__).parent}, {torch.get_num_threads()} intra-op thread(s)")
    fused, written = critics_row(args.rounds)
    ratio = fused / written
    verdict = "ok" if ratio <= args.max_critics_ratio else f"REGRESSION (guard: <= {args.max_critics_ratio:.2f}x)"
    print(
        f"CriticEnsemble(32), batch 16: fused plan {fused:.1f} us, hand-written stacked baddbmm {written:.1f} us, "
        f"{ratio:.2f}x: {verdict}"
    )
    status = 0 if ratio <= args.max_critics_ratio else 1
    if args.first_call_processes > 0:
        first = first_call_row(args.first_call_processes)
        slow = first["cpu_s"] > args.max_first_call_s
        verdict = f"REGRESSION (guard: <= {args.max_first_call_s:.2f} s)" if slow else "ok"
        goal = "met" if first["cpu_s"] <= FIRST_CALL_GOAL_S else "not met"
        print(
            f"ParallelFCN(1000) first call (trace, record, fuse, plan, compile), batch 1, median of "
            f"{args.first_call_processes} fresh processes: {first['cpu_s']:.3f} s CPU (wall {first['wall_s']:.3f} s; "
            f"samples {first['samples_cpu_s']}); goal <= {FIRST_CALL_GOAL_S} s: {goal}; {verdict}"
        )
        status = max(status, int(slow))
        if args.issue_scale:
            scaled = issue_scale_row(args.issue_scale, args.first_call_processes)
            for label, what in (("user", "as a user's first call"), ("work", "the work alone (collector off)")):
                row = scaled[label]
                goal = "met" if row["issue_scale_s"] <= FIRST_CALL_GOAL_S else "not met"
                print(
                    f"  on issue 26's machine, {what}: {row['issue_scale_s']:.3f} s ({row['ratio']:.3f} of the tree at "
                    f"{args.issue_scale}'s {ISSUE_FIRST_CALL_S} s; samples {row['samples_s']}); "
                    f"goal <= {FIRST_CALL_GOAL_S} s: {goal}"
                )
    if args.critics_only:
        return status
    x = torch.randn(2, 4)
    with torch.no_grad():
        lin = nn.Linear(4, 4).eval()
        kw = Keywords().eval()
        s_lin = ss.StreamScheduledModule(copy.deepcopy(lin), executor="serial")
        s_kw = ss.StreamScheduledModule(copy.deepcopy(kw), executor="serial")
        for _ in range(5):
            s_lin(x)
            s_kw(input_ids=x, use_cache=False)
        e, w = bench(lambda: lin(x)), bench(lambda: s_lin(x))
        print(f"Linear(4, 4), positional: eager {e:.1f} us, wrapped {w:.1f} us, overhead {w - e:.1f} us")
        e, w = bench(lambda: kw(input_ids=x, use_cache=False)), bench(lambda: s_kw(input_ids=x, use_cache=False))
        print(f"keywords, dict output:    eager {e:.1f} us, wrapped {w:.1f} us, overhead {w - e:.1f} us")
        past = _Past()
        wp = WithPast().eval()
        s_wp = ss.StreamScheduledModule(copy.deepcopy(wp))
        for _ in range(3):
            s_wp(x, past=past)
        # Timed is the call settled to run as written (the wrapper's whole cost is its own).
        assert last_path(s_wp) == "as-written", last_path(s_wp)
        e, w = bench(lambda: wp(x, past=past)), bench(lambda: s_wp(x, past=past))
        print(f"object argument, as written: eager {e:.1f} us, wrapped {w:.1f} us, overhead {w - e:.1f} us")
        for name in ("gpt2", "mixtral", "vit_tiny_patch16_224"):
            case = rmb.BY_NAME[name]
            torch.manual_seed(0)
            model = case.build().eval()
            args, kwargs = case.inputs(1)
            sm = ss.StreamScheduledModule(model, executor="serial")
            for _ in range(3):
                sm(*args, **kwargs)
            st = sm._ss
            bind = getattr(st, "bind", st.binder.bind)
            b = bench(lambda bind=bind, args=args, kwargs=kwargs: bind(args, kwargs))
            r = bench(sm._revalidate, 200, 5)
            before = _generation.current()
            sm(*args, **kwargs)
            moved = _generation.current() - before
            print(f"{name}: bind {b:.2f} us; generation moves per call: {moved}; one structure re-check {r:.1f} us")
    return status


if __name__ == "__main__":
    sys.exit(main())
