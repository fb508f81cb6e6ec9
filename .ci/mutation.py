"""``make mutation``: remove or move each synchronisation call of the stream runtimes, one
at a time, and require the ``cuda``-marked tests (on the emulated device) to fail.

Mutants cover the Python executor (``runtime/streams.py``), the CUDA stream backend and
the native runtime's stream operations (``runtime/backends.py``), eager dispatch
(``runtime/dispatch/launchers.py``), CUDA graph capture (``runtime/graphs.py``) and the
native runtime itself (``csrc/runtime.cpp``): waits, event records, ``record_stream``,
forks, joins, the caller's stream restored, capture begin and end.

The working tree is never touched: it is copied to a temporary directory and every
mutant is applied there. Python mutants are edited in and out of the copy's sources.
Native mutants are compiled once, together, as a *mutant schema*: each site becomes
``if (mutant() == K) { mutated } else { original }`` with ``K`` read from
``STREAMSCHED_MUTANT``, so one compile of ``runtime.cpp`` (linked with the working
tree's other objects from ``build/``) serves them all.

Before any mutant, each test set runs on the unmodified copy (and on the schema build
with no mutant chosen) and must pass, otherwise a kill proves nothing. The last line is
``N killed, M survived``; the exit status is non-zero if any mutant survived or could
not be applied.

    .venv/bin/python .ci/mutation.py [--only NAME ...] [--sample N] [--keep]
"""

from __future__ import annotations

import argparse
import glob
import random
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = ROOT / ".venv" / "bin" / "python"

# The test sets (pytest arguments). Each runs with -x: a killed mutant stops at its
# first failing test.
PROTOCOL = ["tests/test_cuda_protocol.py"]
PROTOCOL_PYTHON = ["tests/test_cuda_protocol.py", "-k", "python or eager"]
PROTOCOL_NATIVE = ["tests/test_cuda_protocol.py", "-k", "native"]
EAGER = ["tests/test_cuda_protocol.py", "-k", "eager"]
GRAPHS = [
    "tests/test_cuda.py",
    "-k",
    "graph_replay_equals_eager and towers and not conv or failed_capture or pin_memory_thread "
    "or capture_failure_falls_back or weights_updated_after_capture",
]


@dataclass
class Mutant:
    name: str
    path: str
    edits: list[tuple[str, str]]  # (old, new), each old occurring once
    tests: list[str]
    native: bool = False


def m(name: str, path: str, old: str, new: str, tests: list[str], native: bool = False) -> Mutant:
    return Mutant(name, path, [(old, new)], tests, native)


STREAMS = "streamsched/runtime/streams.py"
BACKENDS = "streamsched/runtime/backends.py"
EAGER_PY = "streamsched/runtime/dispatch/launchers.py"
GRAPHS_PY = "streamsched/runtime/graphs.py"
RUNTIME_CPP = "csrc/runtime.cpp"

MUTANTS: list[Mutant] = [
    # --- the Python executor ---
    m("py-no-wait", STREAMS, "                    be.wait(stream, events[producer])\n", "", PROTOCOL_PYTHON),
    Mutant(
        "py-record-before-task",
        STREAMS,
        [
            (
                "                run_task(task, env, ranges, task.stream)\n                log.launch(",
                "                if task.records:\n                    be.record(stream, events[task.id])\n"
                "                run_task(task, env, ranges, task.stream)\n                log.launch(",
            ),
            (
                "                if task.records:\n                    be.record(stream, events[task.id])\n"
                "                    log.record(sid, task.id)\n",
                "                if task.records:\n                    log.record(sid, task.id)\n",
            ),
        ],
        PROTOCOL_PYTHON,
    ),
    m(
        "py-no-cross-record-stream",
        STREAMS,
        "                        be.record_stream(tensor, stream)\n",
        "                        pass\n",
        PROTOCOL_PYTHON,
    ),
    m(
        "py-no-output-record-stream",
        STREAMS,
        "                be.record_stream(tensor, caller)\n",
        "                pass\n",
        PROTOCOL_PYTHON,
    ),
    m("py-no-fork", STREAMS, "        be.fork(caller, side)\n", "", PROTOCOL_PYTHON),
    m(
        "py-partial-join",
        STREAMS,
        "            if completed:\n                be.join(caller, side)\n",
        "            if completed:\n                be.join(caller, side[:1])\n",
        PROTOCOL_PYTHON,
    ),
    m(
        "py-no-restore",
        STREAMS,
        "            if current != 0:\n                be.set_stream(caller)\n",
        "            pass\n",
        PROTOCOL_PYTHON,
    ),
    m(
        "py-streams-collapsed-to-caller",
        STREAMS,
        "        streams = [caller] + pool[1:]\n",
        "        streams = [caller] * len(pool)\n",
        PROTOCOL_PYTHON,
    ),
    # --- the CUDA stream backend (both runtimes issue through it on the emulator) ---
    m(
        "backend-fork-first-only",
        BACKENDS,
        "        self._fork_event.record(caller)\n        for s in side:\n",
        "        self._fork_event.record(caller)\n        for s in side[:1]:\n",
        PROTOCOL,
    ),
    m(
        "backend-join-first-only",
        BACKENDS,
        "        for s in side:\n            caller.wait_stream(s)\n",
        "        for s in side[:1]:\n            caller.wait_stream(s)\n",
        PROTOCOL,
    ),
    m(
        "backend-one-side-stream",
        BACKENDS,
        "        self._grow(count - 1)\n        return [None] + self._pool[: count - 1]\n",
        "        self._grow(count - 1)\n        return [None] + self._pool[:1] * (count - 1)\n",
        PROTOCOL,
    ),
    m(
        "backend-no-wait",
        BACKENDS,
        "    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:\n"
        "        stream.wait_event(event)\n",
        "    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:\n        pass\n",
        PROTOCOL,
    ),
    m(
        "backend-no-record-stream",
        BACKENDS,
        "        if tensor.is_cuda:\n            tensor.record_stream(stream)\n",
        "        pass\n",
        PROTOCOL,
    ),
    m(
        "native-ops-caller-is-default",
        BACKENDS,
        "        self._caller = self.backend.current_stream()\n",
        "        self._caller = torch.cuda.default_stream(self.backend.device)\n",
        PROTOCOL_NATIVE,
    ),
    # --- eager dispatch ---
    m(
        "eager-no-fork",
        EAGER_PY,
        "        backend.fork(backend.current_stream(), [side])\n",
        "",
        EAGER,
    ),
    Mutant(
        "eager-record-before-branch",
        EAGER_PY,
        [
            (
                "            try:\n                launch.value = self.runner.run(launch, fn, args, kwargs)\n"
                "            finally:\n                launch.event = backend.event(launch.id)\n"
                "                backend.record(side, launch.event)\n",
                "            launch.event = backend.event(launch.id)\n            backend.record(side, launch.event)\n"
                "            launch.value = self.runner.run(launch, fn, args, kwargs)\n",
            )
        ],
        EAGER,
    ),
    m("eager-no-wait", EAGER_PY, "            backend.wait(stream, launch.event)\n", "", EAGER),
    m(
        "eager-no-result-record-stream",
        EAGER_PY,
        "                _record_stream(backend, t, stream)\n",
        "                pass\n",
        EAGER,
    ),
    m(
        "eager-no-join",
        EAGER_PY,
        "            backend.join(backend.current_stream(), [backend.stream(lane) for lane in sorted(streams)])\n",
        "            pass\n",
        EAGER,
    ),
    # --- CUDA graph capture ---
    m(
        "graph-no-warmup-fork",
        GRAPHS_PY,
        "        side.wait_stream(torch.cuda.current_stream(device))\n        with torch.cuda.stream(side):\n"
        "            # Warm up",
        "        with torch.cuda.stream(side):\n            # Warm up",
        GRAPHS,
    ),
    m(
        "graph-failed-capture-never-ended",
        GRAPHS_PY,
        "    def _abandon(self, graph: Any, device: Any, side: Any) -> None:\n"
        "        try:\n            graph.capture_end()\n",
        "    def _abandon(self, graph: Any, device: Any, side: Any) -> None:\n        try:\n            pass\n",
        GRAPHS,
    ),
    m(
        "graph-global-capture-mode",
        GRAPHS_PY,
        'capture_error_mode="thread_local"',
        'capture_error_mode="global"',
        GRAPHS,
    ),
    Mutant(
        "graph-capture-begins-after-the-run",
        GRAPHS_PY,
        [
            (
                "            try:\n"
                '                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")\n',
                "            out = self.streams.run(program, static_inputs)\n"
                "            try:\n"
                '                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")\n',
            ),
            ("                out = self.streams.run(program, static_inputs)\n", "                pass\n"),
        ],
        GRAPHS,
    ),
    # A pool every graph released is refused by PyTorch's allocator (an assert at capture).
    m(
        "graph-pool-reused-after-release",
        GRAPHS_PY,
        "        if self.pool is None or not self._graphs:\n",
        "        if self.pool is None:\n",
        GRAPHS,
    ),
    # A failed capture leaves the CUDA generator in capture mode: random kernels then fail.
    m(
        "graph-generator-left-capturing",
        GRAPHS_PY,
        "    graph = torch.cuda.CUDAGraph()\n    try:\n",
        "    return\n    graph = torch.cuda.CUDAGraph()\n    try:\n",
        GRAPHS,
    ),
    # --- the native runtime (one schema build) ---
    m("cpp-no-fork", RUNTIME_CPP, "if (backend_) backend_->fork(side_streams_);", ";", PROTOCOL_NATIVE, True),
    m(
        "cpp-no-set-stream",
        RUNTIME_CPP,
        "if (backend_) backend_->set_stream(t.stream);",
        ";",
        PROTOCOL_NATIVE,
        True,
    ),
    m(
        "cpp-no-wait",
        RUNTIME_CPP,
        "if (backend_) backend_->wait(t.stream, event_of_task_[producer]);",
        ";",
        PROTOCOL_NATIVE,
        True,
    ),
    m(
        "cpp-no-cross-record-stream",
        RUNTIME_CPP,
        "        backend_->record_stream(tensor, t.stream);",
        "        (void)tensor;",
        PROTOCOL_NATIVE,
        True,
    ),
    m(
        "cpp-no-record",
        RUNTIME_CPP,
        "if (backend_) backend_->record(t.stream, event_of_task_[t.id]);",
        ";",
        PROTOCOL_NATIVE,
        True,
    ),
    Mutant(
        "cpp-record-before-task",
        RUNTIME_CPP,
        [
            (
                "if (backend_) backend_->record(t.stream, event_of_task_[t.id]);",
                ";",
            ),
            (
                'if (logging_) add("wait", t.stream, producer);\n  }',
                'if (logging_) add("wait", t.stream, producer);\n  }\n'
                "  if (t.records && backend_) backend_->record(t.stream, event_of_task_[t.id]);",
            ),
        ],
        PROTOCOL_NATIVE,
        True,
    ),
    m("cpp-no-restore", RUNTIME_CPP, "if (current_ != 0) backend_->restore();", ";", PROTOCOL_NATIVE, True),
    m(
        "cpp-partial-join",
        RUNTIME_CPP,
        "backend_->join(side_streams_);",
        "backend_->join(std::vector<int64_t>(side_streams_.begin(), "
        "side_streams_.begin() + std::min<size_t>(1, side_streams_.size())));",
        PROTOCOL_NATIVE,
        True,
    ),
    m(
        "cpp-no-output-record-stream",
        RUNTIME_CPP,
        "        backend_->record_stream(tensor, 0);",
        "        (void)tensor;",
        PROTOCOL_NATIVE,
        True,
    ),
]


class AnchorMissing(Exception):
    """The text a mutant edits is not (or not once) in the file: update the mutant."""


def edit(text: str, old: str, new: str, where: str) -> str:
    if text.count(old) != 1:
        raise AnchorMissing(f"{where}: expected one occurrence of {old.strip()!r}, found {text.count(old)}")
    return text.replace(old, new)


def tree_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    return [f for f in out if f and (ROOT / f).is_file()]


def copy_tree(dest: Path) -> None:
    for f in tree_files():
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)
    for so in glob.glob(str(ROOT / "streamsched" / "_C*.so")):
        shutil.copy2(so, dest / "streamsched")


def pytest(tree: Path, args: list[str], env: dict, timeout: float) -> tuple[int, str]:
    cmd = [str(PY), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "cuda", *args]
    full = {**_base_env(), **env}
    try:
        done = subprocess.run(cmd, cwd=tree, env=full, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    lines = [ln for ln in done.stdout.strip().splitlines() if ln.strip()]
    return done.returncode, lines[-1] if lines else done.stderr.strip()[-300:]


def _base_env() -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("STREAMSCHED_")}
    env["STREAMSCHED_REQUIRE_EXT"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


# --- the native schema build ---------------------------------------------------------------------

_SCHEMA_HEADER = """
#include <cstdlib>
namespace {
// The mutant chosen by STREAMSCHED_MUTANT (0: none); written by .ci/mutation.py.
int mutant() {
  static const int chosen = [] {
    const char* value = std::getenv("STREAMSCHED_MUTANT");
    return value ? std::atoi(value) : 0;
  }();
  return chosen;
}
}  // namespace
"""


def schema_source(text: str, mutants: list[tuple[int, Mutant]]) -> str:
    """``runtime.cpp`` with every native mutant's sites guarded by its number. Sites are
    rewritten from the end of the file backwards, so offsets stay valid."""
    sites: list[tuple[int, int, str, str, int]] = []
    for number, mutant in mutants:
        for old, new in mutant.edits:
            if text.count(old) != 1:
                raise AnchorMissing(f"{mutant.path}: expected one occurrence of {old.strip()!r}")
            start = text.index(old)
            sites.append((start, start + len(old), old, new, number))
    sites.sort()
    merged: list[tuple[int, int, str, list[tuple[int, str]]]] = []
    for start, end, old, new, number in sites:
        if merged and merged[-1][0] == start:
            merged[-1][3].append((number, new))  # two mutants at one site
        else:
            merged.append((start, end, old, [(number, new)]))
    for start, end, old, choices in reversed(merged):
        indent = old[: len(old) - len(old.lstrip())]
        if all(new.startswith(old) for _, new in choices):
            # An insertion after the site: the site stays, the inserted code is guarded.
            extra = "".join(f"\n  if (mutant() == {n}) {{ {new[len(old) :].strip()} }}" for n, new in choices)
            text = text[:end] + extra + text[end:]
            continue
        body = "".join(f"if (mutant() == {n}) {{ {new.strip()} }} else " for n, new in choices)
        text = text[:start] + f"{indent}{body}{{ {old.strip()} }}" + text[end:]
    head = text.index("namespace streamsched {")
    return text[:head] + _SCHEMA_HEADER + "\n" + text[head:]


def build_schema(tree: Path, mutants: list[tuple[int, Mutant]]) -> None:
    """Compile the schema ``runtime.cpp`` and link it with the working tree's other
    objects into the copy's extension."""
    temp = next(iter(glob.glob(str(ROOT / "build" / "temp.*"))), None)
    if temp is None:
        raise SystemExit("mutation: build/temp.* is missing: run `make ext` first")
    ninja = (Path(temp) / "build.ninja").read_text()
    flags = {}
    for line in ninja.splitlines():
        if " = " in line and line.split(" = ", 1)[0] in ("cflags", "post_cflags"):
            key, value = line.split(" = ", 1)
            flags[key] = value
    objects = []
    for source in sorted(glob.glob(str(ROOT / "csrc" / "*.cpp"))):
        name = Path(source).stem
        if name == "runtime":
            continue
        obj = Path(temp) / "csrc" / f"{name}.o"
        if not obj.exists() or obj.stat().st_mtime < Path(source).stat().st_mtime:
            raise SystemExit(f"mutation: {obj} is older than its source: run `make ext` first")
        objects.append(str(obj))
    src = tree / RUNTIME_CPP
    src.write_text(schema_source(src.read_text(), mutants))
    out = tree / "build" / "mutation" / "runtime.o"
    out.parent.mkdir(parents=True, exist_ok=True)
    cxx = sysconfig.get_config_var("CXX") or "c++"
    # -O1: the schema is compiled once per run; optimisation level does not change what it does.
    post = flags["post_cflags"].replace("-O3", "-O1")
    cflags = flags["cflags"].replace("-O3", "-O1")
    compile_cmd = f"{cxx} {cflags} -c {shlex.quote(str(src))} -o {shlex.quote(str(out))} {post}"
    subprocess.run(compile_cmd, shell=True, check=True, cwd=tree)
    import torch.utils.cpp_extension as cpp_extension  # noqa: PLC0415 - only for the link

    so = next(iter(glob.glob(str(tree / "streamsched" / "_C*.so"))))
    libs = " ".join(f"-L{p}" for p in cpp_extension.library_paths())
    link = f"{cxx} -shared -pthread {out} {' '.join(objects)} {libs} -lc10 -ltorch -ltorch_cpu -ltorch_python -o {so}"
    subprocess.run(link, shell=True, check=True, cwd=tree)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="run only these mutants (names)")
    parser.add_argument("--sample", type=int, default=0, help="run a random sample of this many mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per pytest run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="apply every mutant's edits (no tests) and exit")
    opts = parser.parse_args(argv)
    chosen = MUTANTS
    if opts.list:
        for mu in MUTANTS:
            print(f"{mu.name:40s} {mu.path}")
        return 0
    if opts.check:
        for mu in MUTANTS:
            if not mu.native:
                text = (ROOT / mu.path).read_text()
                for old, new in mu.edits:
                    text = edit(text, old, new, mu.path)
        native = [(i + 1, mu) for i, mu in enumerate(mu for mu in MUTANTS if mu.native)]
        print(schema_source((ROOT / RUNTIME_CPP).read_text(), native))
        return 0
    if opts.only:
        unknown = set(opts.only) - {mu.name for mu in MUTANTS}
        if unknown:
            raise SystemExit(f"unknown mutants: {sorted(unknown)}")
        chosen = [mu for mu in MUTANTS if mu.name in opts.only]
    if opts.sample:
        chosen = random.Random(opts.seed).sample(chosen, min(opts.sample, len(chosen)))
    started = time.monotonic()
    tree = Path(tempfile.mkdtemp(prefix="streamsched-mutation-"))
    killed, survived, broken = [], [], []
    try:
        copy_tree(tree)
        check = subprocess.run(
            [str(PY), "-c", "import streamsched; print(streamsched.__file__)"],
            cwd=tree,
            capture_output=True,
            text=True,
            env=_base_env(),
        )
        if not check.stdout.strip().startswith(str(tree)):
            raise SystemExit(f"mutation: the copy imports streamsched from {check.stdout.strip()!r}, not {tree}")
        python_mutants = [mu for mu in chosen if not mu.native]
        native_mutants = [(i + 1, mu) for i, mu in enumerate(mu for mu in MUTANTS if mu.native) if mu in chosen]
        baseline_sets = {tuple(mu.tests) for mu in python_mutants}
        for tests in sorted(baseline_sets):
            rc, summary = pytest(tree, list(tests), {}, opts.timeout)
            print(f"baseline {' '.join(tests)}: {summary}", flush=True)
            if rc != 0:
                print("the unmodified copy fails its tests: a kill would prove nothing")
                return 2
        for mu in python_mutants:
            file = tree / mu.path
            original = file.read_text()
            try:
                text = original
                for old, new in mu.edits:
                    text = edit(text, old, new, mu.path)
            except AnchorMissing as exc:
                broken.append(mu.name)
                print(f"BROKEN   {mu.name}: {exc}", flush=True)
                continue
            file.write_text(text)
            t0 = time.monotonic()
            try:
                rc, summary = pytest(tree, mu.tests, {}, opts.timeout)
            finally:
                file.write_text(original)
            verdict = "killed" if rc not in (0, 5) else "SURVIVED"
            (killed if rc not in (0, 5) else survived).append(mu.name)
            print(f"{verdict:8s} {mu.name} ({time.monotonic() - t0:.0f} s): {summary}", flush=True)
        if native_mutants:
            t0 = time.monotonic()
            try:
                build_schema(tree, native_mutants)
            except AnchorMissing as exc:
                broken.extend(mu.name for _, mu in native_mutants)
                print(f"BROKEN   native schema: {exc}", flush=True)
                native_mutants = []
            else:
                print(f"native schema built ({time.monotonic() - t0:.0f} s)", flush=True)
            native_sets = {tuple(mu.tests) for _, mu in native_mutants}
            for tests in sorted(native_sets):
                rc, summary = pytest(tree, list(tests), {"STREAMSCHED_MUTANT": "0"}, opts.timeout)
                print(f"baseline (schema build) {' '.join(tests)}: {summary}", flush=True)
                if rc != 0:
                    print("the schema build without a mutant fails its tests: a kill would prove nothing")
                    return 2
            for number, mu in native_mutants:
                t0 = time.monotonic()
                rc, summary = pytest(tree, mu.tests, {"STREAMSCHED_MUTANT": str(number)}, opts.timeout)
                verdict = "killed" if rc not in (0, 5) else "SURVIVED"
                (killed if rc not in (0, 5) else survived).append(mu.name)
                print(f"{verdict:8s} {mu.name} ({time.monotonic() - t0:.0f} s): {summary}", flush=True)
    finally:
        if opts.keep:
            print(f"kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    print(
        f"({time.monotonic() - started:.0f} s; survived: {', '.join(survived) or 'none'}; "
        f"could not apply: {', '.join(broken) or 'none'})"
    )
    print(f"{len(killed)} killed, {len(survived)} survived")
    return 0 if not survived and not broken else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
