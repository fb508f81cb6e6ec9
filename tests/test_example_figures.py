"""The examples' speed figures say what they were measured with: the intra-op thread
count (a CPU ratio depends on it), which ``--threads`` sets."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def test_parallel_fcn_prints_its_thread_count_with_its_figures():
    threads = 1
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        # On the CPU wherever it runs: the example picks a GPU where there is one.
        [
            sys.executable,
            str(EXAMPLES / "parallel_fcn.py"),
            "--members",
            "8",
            "--threads",
            str(threads),
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=EXAMPLES,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    figures = [i for i, line in enumerate(lines) if "x the loop" in line]
    assert figures, done.stdout
    heading = lines[figures[0] - 1]
    assert re.search(rf"\bcpu, {threads} intra-op thread\b", heading), heading
    errors = [float(line.rsplit(":", 1)[1]) for line in lines if "max abs error" in line]
    assert errors and max(errors) < 1e-5, done.stdout


def test_threads_note_follows_the_thread_count(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    import _timing

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert _timing.threads_note(torch.device("cpu")) == "cpu, 2 intra-op threads"
        torch.set_num_threads(1)
        assert _timing.threads_note(torch.device("cpu")) == "cpu, 1 intra-op thread"
    finally:
        torch.set_num_threads(before)
