"""NVTX ranges reach a real NVTX tool, on CPU lanes and on (emulated) CUDA streams.

An NVTX tool is a shared library that the NVTX headers compiled into an instrumented
library (here the ``nvtx`` package) load from ``NVTX_INJECTION64_PATH``; Nsight Systems
receives ranges exactly this way. ``nvtx_injection.cpp`` is such a tool: it records
domain creation, registered strings, range push/pop and marks to a file. These tests
compile it with g++, run a wrapped model in a subprocess under it, and read back what
the tool received: the ``streamsched`` domain, one range ``<module path> [s<k>]`` per
task and call, properly nested on each OS thread, and each lane's ranges on a thread of
its own (threads executor) or on the caller's thread (serial, streams).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from collections import Counter
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "nvtx_injection.cpp"

# Where the NVTX v3 headers (nvtx3/nvToolsExt.h) may be: a future nvtx wheel, the
# nvidia-nvtx wheels, the CUDA toolkit setup.py would build with, the default toolkit.
_HEADER_CANDIDATES = [
    os.path.join(sysconfig.get_paths()["purelib"], "nvtx", "include"),
    *glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "*", "include")),
    *glob.glob(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "nvtx", "include")),
    *(os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
    "/usr/local/cuda/include",
    *sorted(glob.glob("/usr/local/cuda-*/include"), reverse=True),
]


def _nvtx_include_dir() -> str:
    for candidate in _HEADER_CANDIDATES:
        if os.path.isfile(os.path.join(candidate, "nvtx3", "nvToolsExt.h")):
            return candidate
    pytest.fail(
        "the NVTX v3 headers (nvtx3/nvToolsExt.h) were not found in: "
        + ", ".join(_HEADER_CANDIDATES)
        + ". Install a CUDA toolkit or set CUDA_HOME."
    )


@pytest.fixture(scope="module")
def injection_library(tmp_path_factory) -> Path:
    """The NVTX tool, compiled once for this module."""
    compiler = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ is not installed: cannot build the NVTX injection library")
    out = tmp_path_factory.mktemp("nvtx") / "libnvtx_record.so"
    cmd = [compiler, "-std=c++17", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-I", _nvtx_include_dir()]
    done = subprocess.run([*cmd, "-o", str(out), str(SOURCE)], capture_output=True, text=True)
    assert done.returncode == 0, f"compiling {SOURCE.name} failed:\n{done.stderr}"
    return out


# Runs in the subprocess: for each (executor, device) named on the command line, a
# wrapped model called CALLS times after its planning call, between two marks in a domain
# of its own; prints, per run, what the tool must have seen (the plan's tasks, the
# executor, the caller's OS thread) as one JSON object. One process for all runs: the
# interpreter and torch start once.
_SCRIPT = r"""
import json, sys, threading
import nvtx, torch
from torch import nn
import streamsched as ss

calls = int(sys.argv[1])


class Branches(nn.Module):
    # Three towers of different shapes (nothing to fuse), each worth a lane of its own.
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(64, 96), nn.Tanh(), nn.Linear(96, 64))
        self.middle = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64))
        self.right = nn.Sequential(nn.Linear(64, 48), nn.Sigmoid(), nn.Linear(48, 64))
        self.head = nn.Linear(64, 8)

    def forward(self, x):
        return self.head(self.left(x) + self.middle(x) + self.right(x))


class Routed(nn.Module):
    # Untraceable (routed by the data): eager dispatch runs its forward and schedules the
    # @ss.branch calls on CPU lanes.
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Linear(64, 64) for _ in range(3))

    @ss.branch
    def tower(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > -1e9:
            return sum(self.tower(t, x) for t in self.towers)
        return x


def run(executor, device):
    torch.manual_seed(0)
    if executor == "eager-dispatch":
        model = Routed()
        sm = ss.StreamScheduledModule(model, executor="threads", strict=False)
    else:
        model = Branches().to(device)
        sm = ss.StreamScheduledModule(model, executor=executor, num_streams=3, min_task_cost=0.0, fuse=False)
    sm(torch.randn(4, 64, device=device))  # records and plans: no ranges
    marks = nvtx.get_domain("test")
    marks.mark(message=f"begin {executor} {device}")
    for _ in range(calls):
        x = torch.randn(4, 64, device=device)
        torch.testing.assert_close(sm(x), model(x), rtol=1e-5, atol=1e-6)
    marks.mark(message=f"end {executor} {device}")
    plan = sm.plan
    return {
        "tasks": [[t.name, t.stream] for t in plan.tasks],
        "executor": "eager-dispatch" if plan.mode == "eager-dispatch" else plan.schedule_executor,
        "caller": threading.get_native_id(),
    }


runs = {}
for executor, device in (arg.split(":") for arg in sys.argv[2:]):
    if device != "cuda":
        runs[f"{executor}:{device}"] = run(executor, device)


if any(arg.endswith(":cuda") for arg in sys.argv[2:]):
    import streamsched.ir.cost
    from streamsched.emulated_cuda import EmulatedCuda
    from streamsched.ir.cost import DeviceModel

    # As tests/conftest.py does for `cuda` tests: GPU throughputs at which test-sized
    # branches weigh what large ones do on a GPU (else the plan is one stream).
    streamsched.ir.cost.GPU_MODEL = DeviceModel("cuda", flops_per_us=2.0e4, bytes_per_us=4.0e3, launch_us=1.0)
    with EmulatedCuda(seed=0) as cuda:
        for executor, device in (arg.split(":") for arg in sys.argv[2:]):
            if device == "cuda":
                runs[f"{executor}:{device}"] = run(executor, device)
        torch.cuda.synchronize()
        cuda.check()  # no race, no unsafe memory reuse
print(json.dumps(runs))
"""

CALLS = 3
RUNS = {
    "cpu-lanes": ("threads", "cpu"),
    "cpu-serial": ("serial", "cpu"),
    "emulated-cuda-streams": ("streams", "cuda"),
    "eager-dispatch": ("eager-dispatch", "cpu"),
}


@pytest.fixture(scope="module")
def recorded(injection_library, tmp_path_factory) -> tuple[dict, list[list[str]]]:
    """Every run of RUNS in one subprocess under the tool: what each run must have shown
    the tool, and every event the tool received."""
    record = tmp_path_factory.mktemp("nvtx-record") / "events.tsv"
    env = dict(os.environ)
    env.pop("NVTX_DISABLE", None)
    env.update(NVTX_INJECTION64_PATH=str(injection_library), NVTX_RECORD_PATH=str(record), PYTHONWARNINGS="ignore")
    runs = [f"{executor}:{device}" for executor, device in RUNS.values()]
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(CALLS), *runs],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(HERE.parent),
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    expected = json.loads(done.stdout.strip().splitlines()[-1])
    events = [line.split("\t") for line in record.read_text().splitlines()]
    assert events and events[0][0] == "init" and events[0][2] == "ok", events[:1]
    return expected, events


def _between_marks(events: list[list[str]], run: str) -> list[list[str]]:
    """The events between the run's begin and end marks."""
    marks = [i for i, e in enumerate(events) if e[0] == "mark" and e[2] == "test" and e[3].endswith(" " + run)]
    assert [events[i][3] for i in marks] == [f"begin {run}", f"end {run}"], marks
    return events[marks[0] + 1 : marks[1]]


def _ranges_per_thread(events: list[list[str]], domain: str) -> dict[int, list[str]]:
    """Each thread's closed ranges in ``domain``, in order; fails on a pop without its
    push, a range left open, or a range opened inside another (tasks do not nest)."""
    stacks: dict[int, list[str]] = {}
    closed: dict[int, list[str]] = {}
    for kind, tid, dom, *message in events:
        if dom != domain or kind not in ("push", "pop"):
            continue
        stack = stacks.setdefault(int(tid), [])
        if kind == "push":
            assert not stack, f"range {message[0]!r} opened inside {stack[-1]!r} on thread {tid}"
            stack.append(message[0])
        else:
            assert stack, f"pop without a push on thread {tid}"
            closed.setdefault(int(tid), []).append(stack.pop())
    assert all(not s for s in stacks.values()), f"ranges left open: {stacks}"
    return closed


@pytest.mark.parametrize("run", list(RUNS))
def test_ranges_reach_an_nvtx_tool(recorded, run):
    executor, device = RUNS[run]
    runs, events = recorded
    expected = runs[f"{executor}:{device}"]
    assert expected["executor"] == executor  # the compared calls ran this executor's schedule
    created = [e[2] for e in events if e[0] == "domain"]
    assert "streamsched" in created
    tasks = [(name, stream) for name, stream in expected["tasks"]]
    assert len({stream for _, stream in tasks}) > 1 or executor == "serial"

    window = _between_marks(events, f"{executor} {device}")
    per_thread = _ranges_per_thread(window, "streamsched")
    names = Counter(name for ranges in per_thread.values() for name in ranges)
    if executor == "eager-dispatch":
        # Dispatch places each call's branches anew: one range per @branch call, by name.
        assert sum(names.values()) == len(tasks) * CALLS and {n.split(" [s")[0] for n in names} == {"tower"}
    else:
        # One range per task and call, named "<module path> [s<k>]" with the task's stream.
        assert names == Counter([f"{name} [s{stream}]" for name, stream in tasks] * CALLS)
    if executor == "eager-dispatch":
        assert {name for name, _ in tasks} == {"tower"}, tasks  # each @branch call, by name
    else:
        assert any(name.startswith(("left.", "middle.", "right.")) for name, _ in tasks), tasks

    caller = expected["caller"]
    if executor in ("threads", "eager-dispatch"):
        # Lanes run on pool threads: the side streams' ranges are never on the caller's
        # thread, and several threads opened ranges.
        side = {name for name in names if not name.endswith(" [s0]")}
        assert side and not side & set(per_thread.get(caller, []))
        assert len(per_thread) > 1
    else:
        # serial and streams issue every task from the caller's thread.
        assert set(per_thread) == {caller}
