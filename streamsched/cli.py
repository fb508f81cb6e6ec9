"""``python -m streamsched``: the environment, a model's plan, its timeline, its profile.

::

    python -m streamsched info [--json]
    python -m streamsched plan benchmarks.zoo:Inception3 --input-shape 1,3,299,299 [num_streams=4 ...]
    python -m streamsched timeline benchmarks.zoo:Inception3 --input-shape 1,3,299,299 --out out/inception
    python -m streamsched profile benchmarks.zoo:Inception3 --input-shape 1,3,299,299 --out prof.json
    python -m streamsched bench [...]        # benchmarks.suite (source checkout only)
    python -m streamsched stress [...]       # benchmarks.stress (source checkout only)

``MODULE:FACTORY`` names a callable that returns the ``nn.Module`` to wrap (a class with
default arguments, or a function); ``key=value`` arguments are
:class:`~streamsched.SchedulerConfig` options. A bad argument is reported in one line on
stderr with exit status 2; a model that fails to run, with status 1.

``benchmarks.zoo`` (the reference models), the benchmark suite and the stress driver live
in the source tree's ``benchmarks/`` folder, not in the installed package: run those
commands from the repository root of a checkout.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ._version import __version__
from .envinfo import environment_report, format_report
from .errors import ConfigError, ProfileMismatchError
from .module import StreamScheduledModule
from .observe.schedule_profiles import measure_profile
from .observe.timeline import timeline
from .testing import in_trial

__all__ = ["main", "build_parser", "parse_shape", "parse_options", "load_factory"]

PROG = "python -m streamsched"
_DTYPES = ("float32", "float64", "float16", "bfloat16")
# Commands run by a module of the source checkout (see _delegate), not of the package.
_DELEGATES = {
    "bench": "benchmarks.suite",
    "stress": "benchmarks.stress",
}


# A profile whose rounds' total task times spread wider than this, (slowest - fastest) /
# fastest, is refused by `streamsched profile` unless --max-spread says otherwise.
MAX_PROFILE_SPREAD = 0.5


class UsageError(Exception):
    """A bad command-line argument: reported on stderr, exit status 2."""


class RunError(Exception):
    """The model could not be built or run: reported on stderr, exit status 1."""


# --- argument parsing ----------------------------------------------------------------------


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3,299,299"`` (or ``"1x3x299x299"``) -> ``(1, 3, 299, 299)``."""
    parts = text.replace("x", ",").split(",")
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(
            f"bad input shape {text!r}: expected positive integers separated by commas, like 1,3,299,299"
        )
    return shape


def _coerce(raw: str) -> Any:
    lowered = raw.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["num_streams=4", "fuse=false", "executor=threads"]`` -> ``{"num_streams": 4, "fuse": False,
    "executor": "threads"}`` (ints, floats, ``true``/``false`` and ``none`` are converted)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"scheduler options are written key=value (for example num_streams=4), got {item!r}")
        options[key] = _coerce(raw)
    return options


def load_factory(target: str) -> Callable[[], Any]:
    """Import ``MODULE:FACTORY`` (``FACTORY`` may be dotted: ``module:Class.build``)."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"expected MODULE:FACTORY (for example benchmarks.zoo:Inception3), got {target!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import module {module_name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing
        raise UsageError(f"importing module {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UsageError(f"{module_name}:{attr}: {obj.__name__ if obj is module else attr} has no {part!r}{hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{target} is a {type(obj).__name__}, not a callable that returns an nn.Module")
    return obj


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="MODULE:FACTORY", help="callable returning the nn.Module, e.g. benchmarks.zoo:Inception3"
    )
    parser.add_argument(
        "--input-shape",
        dest="shapes",
        metavar="SHAPE",
        type=parse_shape,
        action="append",
        required=True,
        help="shape of one input tensor, e.g. 1,3,299,299 (repeat for each input of forward)",
    )
    parser.add_argument("--dtype", choices=_DTYPES, default="float32", help="dtype of inputs and model (float32)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (cpu)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eval", dest="train", action="store_false", help="eval mode under no_grad (the default)")
    mode.add_argument("--train", dest="train", action="store_true", help="training mode, autograd on")
    parser.set_defaults(train=False)
    parser.add_argument("--seed", type=int, default=0, help="seed for the model's weights and the inputs (0)")
    parser.add_argument(
        "options",
        metavar="option=value",
        nargs="*",
        help="SchedulerConfig options, e.g. num_streams=4 executor=threads",
    )


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps prose paragraphs to the terminal; keeps indented lines (examples) as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        paragraphs = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(line.startswith("  ") for line in lines):
                paragraphs.append("\n".join(indent + line for line in lines))
            else:
                paragraphs.append(
                    textwrap.fill(" ".join(para.split()), width, initial_indent=indent, subsequent_indent=indent)
                )
        return "\n\n".join(paragraphs)


_MODEL_EPILOG = """MODULE:FACTORY is an importable callable returning the nn.Module (a class with default
arguments, or a function). option=value pairs are SchedulerConfig options (README, Options):
numbers, true/false and none are converted.

example (from the root of a checkout, where benchmarks.zoo is):
  {prog} {command} benchmarks.zoo:ParallelFCN --input-shape 16,20000 executor=serial{extra}"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, one subcommand per job."""
    return _parsers()[0]


def _parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="streamsched: run the independent branches of a PyTorch model side by side; see what ran where.",
        epilog=f"""examples (from the root of a checkout, where benchmarks.zoo is):
  {PROG} info
  {PROG} plan benchmarks.zoo:ParallelFCN --input-shape 16,20000
  {PROG} plan mypackage.models:build --input-shape 8,3,224,224 num_streams=4 executor=threads

`{PROG} COMMAND --help` lists a command's options; docs/observability.md describes each.""",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"streamsched {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = commands.add_parser(
        "info",
        help="this machine: Python, PyTorch, CPU, GPUs (NVML), native runtime",
        description="What this machine offers: Python, PyTorch and its CUDA/cuDNN, the CPU and its threads, "
        "whether the native runtime (streamsched._C) is loaded, and the GPUs NVML sees (without NVML it "
        "says why and reports the rest).",
    )
    info.add_argument("--json", action="store_true", help="print the report as JSON")

    plan = commands.add_parser(
        "plan",
        help="plan a model and print the plan",
        description="Build the model, wrap it, call it on random inputs of the given shapes (the first call "
        "traces and plans; under executor=auto the next calls are the trial that times the plan against the "
        "model as written, until it decides) and print sm.plan: the executor and why, what the trial measured, "
        "the tasks in issue order with their streams, waits and estimated costs, and the fused groups.",
        epilog=_MODEL_EPILOG.format(prog=PROG, command="plan", extra=""),
        formatter_class=_HelpFormatter,
    )
    _add_model_arguments(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument("--all-tasks", action="store_true", help="list every task (not only the first 40)")

    tl = commands.add_parser(
        "timeline",
        help="measure when each task ran: Chrome trace (.json) and Gantt chart (.png)",
        description="Run the model's schedule --warmup times, then --runs times observed, and keep the fastest: "
        "each task's measured start and end per stream, written as PATH.json (a Chrome trace: open it in "
        "https://ui.perfetto.dev) and PATH.png (a Gantt chart; needs matplotlib). Prints the wall time, the "
        "overlap of the streams, the measured critical path and the largest idle gaps.",
        epilog=_MODEL_EPILOG.format(prog=PROG, command="timeline", extra=" --out out/fcn"),
        formatter_class=_HelpFormatter,
    )
    _add_model_arguments(tl)
    tl.add_argument("--out", required=True, metavar="PATH", help="writes PATH.json and PATH.png")
    tl.add_argument("--runs", type=int, default=3, help="observed calls; the fastest is kept (3)")
    tl.add_argument("--warmup", type=int, default=2, help="calls before observing; the first one plans (2)")

    prof = commands.add_parser(
        "profile",
        help="measure per-task costs into a schedule profile (JSON)",
        description="Measure every task of the model's schedule in rounds of calls and write the costs as a "
        "profile; SchedulerConfig(profile=PATH.json) then plans with them instead of estimates. A profile "
        "made for another model, input signature or device is refused when used.",
        epilog=_MODEL_EPILOG.format(prog=PROG, command="profile", extra=" --out fcn.json"),
        formatter_class=_HelpFormatter,
    )
    _add_model_arguments(prof)
    prof.add_argument("--out", required=True, metavar="PATH.json", help="where to write the profile")
    prof.add_argument("--runs", type=int, default=5, help="observed calls per round; a task's median is taken (5)")
    prof.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of --runs calls; each task keeps its fastest round median (3). While the fastest "
        "rounds spread wider than --max-spread, up to twice as many more are measured, slowed ones set aside",
    )
    prof.add_argument(
        "--max-spread",
        type=float,
        default=MAX_PROFILE_SPREAD,
        metavar="FRACTION",
        help="refuse the profile when the rounds' total task times spread wider than this: "
        f"(slowest - fastest) / fastest ({MAX_PROFILE_SPREAD}); tasks spreading wider are warned about",
    )

    for name, module in _DELEGATES.items():
        commands.add_parser(name, help=f"run {module} (arguments are passed through; `{name} --help` for its own)")
    return parser, {"info": info, "plan": plan, "timeline": tl, "profile": prof}


# --- commands ------------------------------------------------------------------------------


def _cmd_info(ns: argparse.Namespace) -> int:
    report = environment_report()
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


class _Prepared:
    """The wrapped model, a source of fresh inputs, and the grad mode to call it in."""

    def __init__(self, ns: argparse.Namespace):
        try:
            device = torch.device(ns.device)
        except RuntimeError as exc:
            raise UsageError(f"bad --device {ns.device!r}: {exc}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {ns.device}: CUDA is not available here (torch {torch.__version__})")
        options = parse_options(ns.options)
        factory = load_factory(ns.target)
        self.dtype = getattr(torch, ns.dtype)
        self.device = device
        self.shapes = ns.shapes
        self.generator = torch.Generator().manual_seed(ns.seed)
        torch.manual_seed(ns.seed)
        try:
            model = factory()
        except Exception as exc:  # noqa: BLE001 - the user's factory failed
            raise RunError(f"{ns.target}() failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{ns.target}() returned a {type(model).__name__}, not an nn.Module")
        self.name = type(model).__name__
        model = model.to(device=device, dtype=self.dtype).train(ns.train)
        try:
            self.sm = StreamScheduledModule(model, **options)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        self.grad = torch.enable_grad if ns.train else torch.no_grad

    def inputs(self) -> list[Any]:
        return [
            torch.randn(shape, generator=self.generator, dtype=torch.float32).to(self.device, self.dtype)
            for shape in self.shapes
        ]

    def describe(self) -> str:
        shapes = ", ".join("x".join(map(str, s)) for s in self.shapes)
        return f"{self.name} on {str(self.dtype).replace('torch.', '')}[{shapes}] ({self.device})"

    @contextlib.contextmanager
    def running(self, what: str):
        """Report a failure of the model (or of a config that only shows at plan time) in one line."""
        with self.grad():
            try:
                yield
            except (ConfigError, ProfileMismatchError) as exc:
                raise UsageError(str(exc)) from None
            except Exception as exc:  # noqa: BLE001 - reported, not re-raised: a CLI prints one line
                raise RunError(f"{what} {self.describe()} failed: {type(exc).__name__}: {exc}") from None


# Calls ``plan`` makes at most for an ``auto`` trial to decide (it takes 5 to 15 of each way).
_TRIAL_CALLS = 64


def _cmd_plan(ns: argparse.Namespace) -> int:
    prepared = _Prepared(ns)
    sm = prepared.sm
    with prepared.running("planning"):
        sm(*prepared.inputs())  # records shapes and plans
        sm(*prepared.inputs())  # runs the plan
        # Under executor="auto" the calls after planning are a trial of the ways to run
        # the plan (docs/design.md): the plan printed is the one the trial decided on.
        for _ in range(_TRIAL_CALLS):
            if not in_trial(sm):
                break
            sm(*prepared.inputs())
    plan = sm.plan
    if ns.json:
        print(plan.to_json())
    elif ns.all_tasks:
        print(plan.summary() + "\n" + plan.table(limit=None))
    else:
        print(plan)
    return 0


def _positive(value: int, flag: str) -> int:
    if value < 1:
        raise UsageError(f"{flag} must be at least 1, got {value}")
    return value


def _cmd_timeline(ns: argparse.Namespace) -> int:
    runs, warmup = _positive(ns.runs, "--runs"), _positive(ns.warmup, "--warmup")
    prepared = _Prepared(ns)
    with prepared.running("timing"):
        result = timeline(prepared.sm, *prepared.inputs(), runs=runs, warmup=warmup)
    written = result.save(ns.out)
    print(result.summary())
    print("wrote " + ", ".join(str(p) for p in written) + "  (open the .json in https://ui.perfetto.dev)")
    return 0


def _cmd_profile(ns: argparse.Namespace) -> int:
    runs, rounds = _positive(ns.runs, "--runs"), _positive(ns.rounds, "--rounds")
    if not ns.max_spread > 0:
        raise UsageError(f"--max-spread must be above 0, got {ns.max_spread}")
    prepared = _Prepared(ns)
    with prepared.running("profiling"):
        profile = measure_profile(
            prepared.sm, *prepared.inputs(), runs=runs, rounds=rounds, steady=ns.max_spread, max_rounds=3 * rounds
        )
    total = sum(profile.task_us.values())
    rounds_ms = ", ".join(f"{us / 1000:.2f}" for us in profile.kept_totals())
    aside = len(profile.round_total_us) - len(profile.kept_totals())
    set_aside = ""
    if aside:
        slowed = ", ".join(
            f"{us / 1000:.2f}" for i, us in enumerate(profile.round_total_us) if i not in profile.kept_rounds
        )
        set_aside = f"; {aside} slower round(s) set aside: {slowed} ms"
    print(
        f"profile of {profile.model} {profile.signature} on {profile.device} ({profile.device_name}), "
        f"executor {profile.executor}: {len(profile.task_us)} tasks, {total / 1000:.2f} ms of task time "
        f"(fastest of {len(profile.kept_totals())} rounds of {profile.runs} calls, each task's median; "
        f"round totals {rounds_ms} ms, spread {profile.spread():.0%}{set_aside})"
    )
    for name, us in sorted(profile.task_us.items(), key=lambda kv: -kv[1])[:5]:
        print(f"  {us:10.1f} us  {name}  (spread {profile.task_spread.get(name, 0.0):.0%})")
    if profile.spread() > ns.max_spread:
        raise RunError(
            f"the measurements are not steady: after {profile.rounds} rounds the fastest {len(profile.kept_totals())} "
            f"still spread {profile.spread():.0%} ({rounds_ms} ms), more than --max-spread "
            f"{ns.max_spread:.0%}; nothing written. Measure on a "
            "quieter machine (other processes share the cores or the GPU), with more --runs/--rounds, or "
            "raise --max-spread to accept it"
        )
    unsteady = profile.unsteady_tasks(ns.max_spread)
    if unsteady:
        listed = ", ".join(f"{name} ({spread:.0%})" for name, spread in unsteady[:5])
        more = f" and {len(unsteady) - 5} more" if len(unsteady) > 5 else ""
        print(
            f"warning: {len(unsteady)} task(s) spread more than {ns.max_spread:.0%} between rounds: {listed}{more}; "
            "the profile keeps each task's fastest round",
            file=sys.stderr,
        )
    path = profile.save(ns.out)
    print(f"wrote {path}  (use it with SchedulerConfig(profile={str(path)!r}))")
    return 0


def _exit_status(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _find_checkout() -> Optional[Path]:
    """The source checkout that holds ``benchmarks/suite/``: the parent of the ``streamsched``
    package directory (an in-place or editable install), else the current directory; None
    when neither has it (an installed package run from elsewhere)."""
    package_root = Path(__file__).resolve().parent.parent
    for root in (package_root, Path.cwd().resolve()):
        if (root / "benchmarks" / "suite").is_dir():
            return root
    return None


def _delegate(command: str, argv: list[str]) -> int:
    module_name = _DELEGATES[command]
    root = _find_checkout()
    if root is None:
        print(
            f"{PROG} {command}: error: {module_name} is not part of the installed package: the benchmark suite "
            "lives in the source tree's benchmarks/ folder; run this command from the root of a streamsched checkout",
            file=sys.stderr,
        )
        return 1
    if not any(os.path.realpath(entry or os.curdir) == str(root) for entry in sys.path):
        sys.path.insert(0, str(root))
    try:
        # A function-level import of an optional component: the suite and the stress driver
        # live in the checkout's benchmarks/, outside the package, and only these commands
        # need them; importing the library must never depend on a checkout.
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(f"{PROG} {command}: error: {module_name} is not available: {exc}", file=sys.stderr)
        return 1
    entry = getattr(module, "main", None)
    if not callable(entry):
        print(f"{PROG} {command}: error: {module_name} has no main(argv) function", file=sys.stderr)
        return 1
    try:
        return _exit_status(entry(argv))
    except SystemExit as exc:
        return _exit_status(exc.code)


_COMMANDS = {"info": _cmd_info, "plan": _cmd_plan, "timeline": _cmd_timeline, "profile": _cmd_profile}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run one command line (``sys.argv[1:]`` by default); return the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DELEGATES:
        # Everything after the command belongs to the delegate, --help included.
        return _delegate(args[0], args[1:])
    parser, subparsers = _parsers()
    try:
        if args and args[0] in _COMMANDS:
            # Intermixed parsing lets key=value options follow the flags (argparse's plain
            # parse would leave them unrecognised once --input-shape came in between).
            ns = subparsers[args[0]].parse_intermixed_args(args[1:])
            ns.command = args[0]
        else:
            ns = parser.parse_args(args)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return _exit_status(exc.code)
    command = ns.command
    try:
        return _COMMANDS[command](ns)
    except UsageError as exc:
        print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
        return 2
    except RunError as exc:
        print(f"{PROG} {command}: error: {exc}", file=sys.stderr)
        return 1
