"""``make mutation-lite``: plant known breakages one at a time and require a test to fail.

Each mutant is a small edit of the library that makes results wrong in a way a user
would not see (a fused member 1e-3 off, an in-place write unordered, an output of the
wrong type ...). For each one the working tree is copied to a temporary directory (the
shared tree is never touched), the edit is applied there, and the tests that guard that
part of the library run against the copy. A mutant is *killed* when a test fails, and
*survives* when every test passes: the suite would not have noticed the bug.

    .venv/bin/python tests/mutation_lite.py [NAME ...]

Before any mutant, the same tests run on an unmodified copy and must pass (otherwise a
kill proves nothing). The model tier (``tests/models``) runs for the mutants that name it
when ``.venv-cuda`` has timm and transformers. The last line is ``N killed, M survived``;
the exit status is non-zero if any mutant survived or could not be applied.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
MAIN_PY = ROOT / ".venv" / "bin" / "python"
MODELS_PY = ROOT / ".venv-cuda" / "bin" / "python"
MODELS_ENV = {"STREAMSCHED_DISABLE_EXT": "1", "STREAMSCHED_REQUIRE_EXT": "0", "HF_HUB_OFFLINE": "1"}


class AnchorMissing(Exception):
    """The text a mutant edits is no longer in the file: the mutant must be updated."""


def replace(path: str, old: str, new: str) -> Callable[[Path], None]:
    """An edit that replaces the one occurrence of ``old`` in ``path``."""

    def apply(tree: Path) -> None:
        file = tree / path
        text = file.read_text()
        if text.count(old) != 1:
            raise AnchorMissing(f"{path}: expected one occurrence of {old.strip()!r}, found {text.count(old)}")
        file.write_text(text.replace(old, new))

    return apply


def append(path: str, code: str) -> Callable[[Path], None]:
    """An edit that appends ``code`` to ``path`` (wrapping what the module defined)."""

    def apply(tree: Path) -> None:
        file = tree / path
        file.write_text(file.read_text() + "\n\n# --- mutation-lite ---\n" + code)

    return apply


@dataclass
class Mutant:
    name: str
    what: str
    edit: Callable[[Path], None]
    tests: list[str]
    """Arguments to pytest in the main environment."""
    model_tests: list[str] = field(default_factory=list)
    """Arguments to pytest in ``.venv-cuda`` (the model tier), run where it is installed."""


# Every compiled schedule's outputs +1: the executors' run() wrapped, whatever the path
# through the executor (the threads executor's nested serial runs included).
_PLUS_ONE = """
def _mutation_plus_one(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value + 1
    if isinstance(value, (list, tuple)):
        return type(value)(_mutation_plus_one(v) for v in value)
    return value


def _mutation_wrap(cls):
    run = cls.run

    def mutated(self, *args, **kwargs):
        return _mutation_plus_one(run(self, *args, **kwargs))

    cls.run = mutated


_mutation_wrap({cls})
"""

# A fused Linear kernel's member 1 off by 1e-3, in every dtype.
_MEMBER_OFF = """
_mutation_linear_call = LinearKernel.__call__


def _mutation_member_off(self, x):
    y = _mutation_linear_call(self, x)
    delta = torch.zeros_like(y)
    to_stack(delta, self.out_layout, self.n, self.out_shape)[1] += 1e-3
    return y + delta


LinearKernel.__call__ = _mutation_member_off
"""

# Every output of a fused Linear kernel 1e-3 off, in float32 only: a float64 copy of the
# wrapper (the model tier's last resort for fused values) is exact.
_FLOAT32_ONLY = """
_mutation_linear_call = LinearKernel.__call__


def _mutation_float32_only(self, x):
    y = _mutation_linear_call(self, x)
    return y + 1e-3 if y.dtype == torch.float32 else y


LinearKernel.__call__ = _mutation_float32_only
"""

# The main-suite tests that compare a compiled schedule's call with eager (issue 27's
# list among them): each must fail when every compiled-schedule output is off by one.
_PLAN_CALL_TESTS = [
    "tests/test_module.py",
    "tests/test_fusion.py",
    "tests/test_semantics.py",
    "tests/test_reliability.py::test_modules_added_and_removed_after_wrapping",
    "tests/test_reliability.py::test_output_structure_that_depends_on_a_flag",
    "tests/test_reliability.py::test_fault_in_branch_k_propagates_releases_memory_and_recovers",
    "tests/test_executors.py::test_exception_in_a_branch_propagates_joins_and_next_call_works",
    "tests/test_observe.py::test_ranges_are_closed_when_a_task_raises",
    "tests/test_plan_key.py",
]

MODEL_KERNEL_TESTS = ["tests/models/test_vision_models.py", "-k", "mlp_x8 and serial and eval_outputs"]

MUTANTS = [
    Mutant(
        "fused-member-off",
        "member 1 of every fused Linear kernel 1e-3 off",
        append("streamsched/passes/fusion/kernels.py", _MEMBER_OFF),
        ["tests/test_fusion.py", "tests/test_fused_kernel_check.py"],
    ),
    Mutant(
        "effect-edges-dropped",
        "no ordering edges from recorded in-place effects",
        replace("streamsched/frontend/effects.py", "        after = effect_edges(accesses)\n", "        after = {}\n"),
        ["tests/test_inplace_effects.py"],
    ),
    Mutant(
        "mode-key-ignores-submodules",
        "the plan key reads only the wrapped model's own training flag",
        replace(
            "streamsched/state.py",
            "        flags = _mode_flags(model)\n",
            "        flags = (model.training,)\n",
        ),
        ["tests/test_plan_key.py", "tests/test_semantics.py"],
    ),
    Mutant(
        "output-types-lost",
        "the output rebuild returns a plain tuple of leaves",
        replace(
            "streamsched/frontend/output_tree.py",
            "            return _identity\n        return self.rebuild\n",
            "            return _identity\n        return tuple\n",
        ),
        ["tests/test_semantics.py"],
    ),
    Mutant(
        "eager-fallback-disabled",
        "the auto trial never lets the model's own forward compete",
        replace(
            "streamsched/planning/choice.py",
            '(["eager"] if as_written else [])',
            "[]",
        ),
        # The trial's decisions with planted delays of 20-50 ms (the close-call test times
        # two 10 ms ways against each other: too close on a loaded machine).
        [
            "tests/test_eager_fallback.py::test_a_slower_schedule_falls_back_to_the_models_own_forward",
            "tests/test_eager_fallback.py::test_a_far_slower_schedule_is_dropped_after_two_calls",
            "tests/test_eager_fallback.py::test_gradients_equal_eager_before_and_after_the_fallback",
        ],
    ),
    Mutant(
        "stacked-optim-unstack-broken",
        "unstack_state gives every member the state of member 0",
        replace(
            "streamsched/optim.py",
            "out[key] = s.member_slice(v.detach(), i).clone()",
            "out[key] = s.member_slice(v.detach(), 0).clone()",
        ),
        ["tests/test_stacked_optim.py"],
    ),
    Mutant(
        "record-stream-removed",
        "the CUDA backend never calls record_stream",
        replace(
            "streamsched/runtime/backends.py",
            "        if tensor.is_cuda:\n            tensor.record_stream(stream)\n",
            "        pass\n",
        ),
        # Streams plans whose values cross streams, on the emulated device (which reports
        # an unsafe reuse of freed memory); the whole CUDA files take over 15 minutes.
        [
            "tests/test_cuda.py::test_streams_outputs_and_grads_equal_eager",
            "tests/test_cuda.py::test_inception_streams_use_several_streams_and_match_eager",
        ],
    ),
    Mutant(
        "float32-kernel-error",
        "every fused Linear kernel's float32 output 1e-3 off (float64 exact)",
        append("streamsched/passes/fusion/kernels.py", _FLOAT32_ONLY),
        ["tests/test_fused_kernel_check.py", "tests/test_fusion.py"],
        MODEL_KERNEL_TESTS,
    ),
    Mutant(
        "compiled-output-plus-one",
        "every compiled schedule's outputs +1 (recording calls and the model as written untouched)",
        lambda tree: [
            append(f"streamsched/runtime/{mod}.py", _PLUS_ONE.format(cls=cls))(tree)
            for mod, cls in (("serial", "SerialExecutor"), ("threads", "ThreadExecutor"), ("streams", "StreamExecutor"))
        ],
        _PLAN_CALL_TESTS,
        ["tests/models/test_vision_models.py", "-k", "mlp_x8 and threads and eval_train_eval"],
    ),
]


# --- running ---------------------------------------------------------------------------


def tree_files() -> list[str]:
    """The working tree as git sees it (tracked and untracked files git does not ignore),
    plus the native extension built in place."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.decode()
    files = [f for f in listed.split("\0") if f and (ROOT / f).is_file()]
    files += [str(p.relative_to(ROOT)) for p in (ROOT / "streamsched").glob("_C*.so")]
    return files


def copy_tree(dest: Path, files: list[str]) -> None:
    for f in files:
        target = dest / f
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, target)


def models_available() -> bool:
    if not MODELS_PY.exists():
        return False
    probe = subprocess.run([str(MODELS_PY), "-c", "import timm, transformers"], capture_output=True)
    return probe.returncode == 0


def pytest(
    tree: Path, python: Path, args: list[str], extra_env: dict, timeout: float, every: bool = False
) -> tuple[int, str]:
    """Run pytest on ``tree``'s copy of the package (checked: never the shared tree's).
    ``every``: run every selected test (no ``-x``) and list each failing one."""
    env = {**os.environ, **extra_env, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    check = subprocess.run(
        [str(python), "-c", "import streamsched; print(streamsched.__file__)"],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if not check.stdout.strip().startswith(str(tree)):
        raise RuntimeError(f"the tests would import streamsched from {check.stdout.strip() or check.stderr}")
    cmd = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["-rf"] if every else ["-x"]), *args]
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    lines = [line for line in done.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else done.stderr.strip()[-200:]
    if every:
        failed = [line.split(" - ")[0].removeprefix("FAILED ") for line in lines if line.startswith("FAILED ")]
        summary += "".join(f"\n    failed: {name}" for name in failed)
    return done.returncode, summary


def run_suites(
    tree: Path, mutant: Mutant, models: bool, timeout: float, every: bool = False
) -> list[tuple[str, int, str]]:
    """``(tier, returncode, summary)`` per tier run."""
    results = [("main", *pytest(tree, MAIN_PY, mutant.tests, {}, timeout, every))]
    if models and mutant.model_tests:
        results.append(("models", *pytest(tree, MODELS_PY, mutant.model_tests, MODELS_ENV, timeout, every)))
    return results


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pytest run")
    parser.add_argument(
        "--every", action="store_true", help="run every selected test under each mutant and list those that fail"
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the run on the unmodified tree")
    opts = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not opts.names or m.name in opts.names]
    unknown = set(opts.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {sorted(unknown)}; known: {[m.name for m in MUTANTS]}")
    models = models_available()
    if not models:
        print("mutation-lite: .venv-cuda with timm and transformers not found: the model tier is not run")
    files = tree_files()
    with tempfile.TemporaryDirectory(prefix="mutation-lite-") as tmp:
        # Baseline: the unmodified tree passes every selection (else a kill proves nothing).
        base = Path(tmp) / "baseline"
        copy_tree(base, files)
        for mutant in [] if opts.no_baseline else chosen:
            for tier, rc, summary in run_suites(base, mutant, models, opts.timeout):
                if rc != 0:
                    print(f"mutation-lite: the unmodified tree fails {mutant.name}'s {tier} tests: {summary}")
                    print("0 killed, 0 survived")
                    return 2
        shutil.rmtree(base)
        killed, survived = [], []
        for mutant in chosen:
            tree = Path(tmp) / mutant.name
            copy_tree(tree, files)
            start = time.perf_counter()
            try:
                mutant.edit(tree)
            except AnchorMissing as exc:
                print(f"{mutant.name}: NOT APPLIED ({exc}); counted as survived")
                survived.append(mutant.name)
                continue
            results = run_suites(tree, mutant, models, opts.timeout, opts.every)
            # Killed: every tier run for it has a failing test (pytest's status 1); a
            # collection error or a crash (other statuses) proves nothing about the tests.
            ok = all(rc == 1 for _, rc, _ in results)
            (killed if ok else survived).append(mutant.name)
            detail = "; ".join(f"{tier}: {summary}" for tier, _, summary in results)
            verdict = "killed" if ok else "SURVIVED"
            print(
                f"{mutant.name}: {verdict} in {time.perf_counter() - start:.0f}s ({mutant.what}) [{detail}]", flush=True
            )
            shutil.rmtree(tree)
    print(f"{len(killed)} killed, {len(survived)} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
