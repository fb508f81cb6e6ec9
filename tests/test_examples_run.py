"""Every example runs as written on a CPU and prints what it says it shows: its heading
(with the CPU thread count, in words that agree with it), its check against eager
PyTorch, and its figures. Small sizes, one intra-op thread; ``make demo`` is
``examples/inception.py`` at its own defaults."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# name: (small arguments, lines the output must hold)
CASES = {
    "inception": (["--size", "75", "--rounds", "2"], [r"^Plan for Inception3", r"^max abs error vs eager: "]),
    "parallel_fcn": (["--members", "8"], [r"^Plan for ParallelFCN", r"x the loop$"]),
    "eager_dispatch": (
        ["--towers", "2", "--width", "32", "--batch", "8"],
        [r"\[eager-dispatch\]", r"^max abs error vs eager: "],
    ),
    "nested_plans": (
        ["--blocks", "2", "--heads", "4", "--width", "16", "--batch", "8"],
        [r"^  nested plan of blocks\.0: ", r"^coverage ", r"^max abs error vs eager: "],
    ),
    "train": (
        ["--steps", "6", "--print-every", "5", "--batch", "8"],
        [r"^max \|loss difference\| over 6 steps: ", r"^time per step \(median\): "],
    ),
}


def test_every_example_has_a_case():
    assert {p.stem for p in EXAMPLES.glob("*.py") if not p.stem.startswith("_")} == set(CASES)


def _run_example(name: str, *args: str) -> str:
    """``examples/<name>.py`` run on the CPU with ``args``: its standard output, once it
    exited with status 0."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=EXAMPLES.parent,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_the_example_runs_on_cpu_and_prints_its_check(name):
    args, expected = CASES[name]
    out = _run_example(name, *args, "--threads", "1")
    for pattern in expected:
        assert re.search(pattern, out, re.M), (pattern, out)
    # The heading names the thread count as a count of threads (not "1 CPU threads").
    assert re.search(r"\b1 CPU thread\b(?!s)", out), out
    assert "(s)" not in out, out
    errors = [float(m) for m in re.findall(r"max abs error[^:]*: ([0-9.e+-]+)", out)]
    assert all(e < 1e-4 for e in errors), out


@pytest.mark.slow
def test_the_demo_runs_a_named_executor_for_an_nvtx_capture():
    """``examples/inception.py --executor serial`` (what docs/observability.md runs under
    ``nsys``, ``streams`` on a GPU): the plan is the schedule on that executor, which
    ranges every call, not the model's own forward an ``auto`` trial may keep."""
    out = _run_example("inception", "--size", "75", "--rounds", "1", "--threads", "1", "--executor", "serial")
    assert re.search(r"^Plan for Inception3 \(.*\): executor serial \[traced\]$", out, re.M), out
    assert re.search(r"^  why: requested \(executor='serial'\)$", out, re.M), out
    errors = [float(m) for m in re.findall(r"max abs error[^:]*: ([0-9.e+-]+)", out)]
    assert errors and all(e < 1e-4 for e in errors), out
