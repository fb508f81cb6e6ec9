"""The checks of the model suite: a wrapped model and an eager copy of it run in lockstep,
and everything observable is compared after every call.

Tolerances. Without fusion the wrapper runs the very same kernels in the same order as
eager, so outputs, gradients and buffers must be bitwise equal; except gradients under a
``threads`` plan, where autograd may sum a gradient that several branches feed in
another order (docs/reliability.md), and which are held to the fused rule. Where the
plan fused something, summation order changes; then a value passes if it is within float32's
default tolerances of eager (``torch.testing``'s rtol 1.3e-6, atol 1e-5), or if its L2
distance from a float64 run of the same model (same inputs, same state before the call;
for buffers, the same sequence of calls) is at most ``FLOAT64_FACTOR`` times float32
eager's own distance from it (more for tensors of fewer than ``SMALL`` elements, see
``factor``; and at least a few ulps of the value's norm).
Gradients of deep models are sums over many terms, so the float64 rule is the one that
usually decides for them. L2 rather than the largest element: which element is the
worst one under a reordered sum is chance, the overall size of the error is not.

Where both rules fail, the decisive check runs the *wrapper itself* in float64: a
float64 copy of the model, wrapped with the same options, given the same state and
inputs, must agree with float64 eager to 1e-9 of the value's norm. Some inputs sit next
to a kink (a ReLU or max-pool choosing between two nearly equal values): there a
rounding difference of 1e-6 in float32 flips the choice and moves gradients by 0.1 (a
1e-6 relative perturbation of the input moves *eager's own* hrnet gradients by 0.09),
and no float32 rule can tell that from a wrong result. In float64 the flip does not
happen, and a fused computation that is wrong stays wrong. Integer outputs (detection
labels picked by NMS and top-k over fused scores) are exact, or decided the same way:
the float64 wrapper's integers must equal float64 eager's.

Kernels first. On a call that ran a fused plan, every fused kernel is run on that call's
inputs and compared with its members run one by one, in float32 (``tests/fused_kernels.py``,
the first plan call of each signature). A kernel that fails fails the call before any
whole-model rule is tried: the float64 rules exist for differences that eager's own
float32-to-float64 distance explains, and a float32-only kernel error (exact in float64,
so the float64 wrapper agrees with float64 eager) must never pass through them.

Paths. Every call says which way it ran (``streamsched.testing.last_path``), and the
options say which ways it may: ``serial`` and ``threads`` name an executor, so no trial
runs the model as written: the first call of each signature (mode, grad mode) is the
recording call, every later one the compiled plan, and each is asserted. ``default`` is
what users run: the recording call, then the ``auto`` trial (the plan, or the model's
own forward), each call's path reported. The rules above apply by path: a recording
call and a call run as written run eager's kernels in eager's order (bitwise equal), as
does a plan that fused nothing; a call that ran a fused plan gets the fused rules, and so
does any later call of a model with buffers (BatchNorm statistics a fused kernel updated
carry its rounding into every later call, whatever its path).

Values are compared tensor by tensor in output order, whatever the containers; the
output-types check compares the structure: the same types at every level (a transformers
``ModelOutput`` subclass, tuples, dicts), the same keys, shapes and dtypes.
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Optional

import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path, last_path

from ..fused_kernels import fused_kernel_problems
from .zoo import ModelSpec

FLOAT64_FACTOR = 4.0
SMALL = 64


def factor(numel: int) -> float:
    """How many times eager's distance from float64 a fused value may be. The ratio of
    two rounding-error norms over ``n`` elements spreads like ``1/sqrt(n)``: a 2-element
    BatchNorm weight in a fused branch can be 5x off eager's error by chance, a tensor of
    a thousand elements cannot. ``FLOAT64_FACTOR`` from ``SMALL`` elements up."""
    return FLOAT64_FACTOR * max(1.0, (SMALL / max(numel, 1)) ** 0.5)


ULPS = 16 * torch.finfo(torch.float32).eps
RTOL32, ATOL32 = 1.3e-6, 1e-5

# The ways each model is wrapped: as users run it, and under each executor this machine
# has, named explicitly so that no trial replaces the schedule with the model's own forward.
OPTIONS = {"default": {}, "serial": {"executor": "serial"}, "threads": {"executor": "threads"}}

# (model, options) -> how many calls ran each path, for the run's summary (conftest.py).
PATHS_SEEN: dict[tuple[str, str], Counter] = {}

_BN = nn.modules.batchnorm._BatchNorm


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BN) for m in model.modules())


def freeze_batchnorm(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, _BN):
            m.eval()


# --- structure -------------------------------------------------------------------------


def _is_model_output(value: Any) -> bool:
    try:
        from transformers.utils import ModelOutput
    except ImportError:
        return False
    return isinstance(value, ModelOutput)


def leaves(value: Any, path: str = "out") -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs of a nested output, in a fixed order."""
    if isinstance(value, torch.Tensor):
        return [(path, value)]
    if _is_model_output(value) or isinstance(value, dict):
        return [p for k, v in value.items() for p in leaves(v, f"{path}.{k}")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in leaves(v, f"{path}[{i}]")]
    return [(path, value)]


def assert_same_structure(actual: Any, expected: Any, path: str = "out") -> None:
    """Same types at every level, same keys, same shapes and dtypes; attribute access of
    ``ModelOutput`` fields works and agrees with item access."""
    assert type(actual) is type(expected), (
        f"{path}: the wrapper returned {type(actual).__module__}.{type(actual).__qualname__}, "
        f"eager {type(expected).__module__}.{type(expected).__qualname__}"
    )
    if isinstance(expected, torch.Tensor):
        assert actual.shape == expected.shape, f"{path}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{path}: dtype {actual.dtype} vs {expected.dtype}"
        assert actual.device == expected.device, f"{path}: device {actual.device} vs {expected.device}"
        return
    if _is_model_output(expected) or isinstance(expected, dict):
        keys_a, keys_e = list(actual.keys()), list(expected.keys())
        assert keys_a == keys_e, f"{path}: keys {keys_a} vs {keys_e}"
    if _is_model_output(expected):
        for i, k in enumerate(expected.keys()):
            by_attr = getattr(actual, k)
            # Index access goes through to_tuple(), which some outputs override (CLIP's
            # turns nested outputs into tuples): agree with eager's own access, whatever it is.
            same = by_attr is actual[k] and by_attr is actual[i]
            same_eager = getattr(expected, k) is expected[k] and getattr(expected, k) is expected[i]
            assert same == same_eager, f"{path}.{k}: attribute, key and index access disagree"
            assert_same_structure(by_attr, expected[k], f"{path}.{k}")
        return
    if isinstance(expected, dict):
        for k in expected:
            assert_same_structure(actual[k], expected[k], f"{path}.{k}")
        return
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{path}: length {len(actual)} vs {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_same_structure(a, e, f"{path}[{i}]")
        return
    if is_dataclass(expected):
        for f in fields(expected):
            assert_same_structure(getattr(actual, f.name), getattr(expected, f.name), f"{path}.{f.name}")
        return
    if isinstance(expected, (int, float, bool, str, type(None))):
        assert actual == expected, f"{path}: {actual!r} vs {expected!r}"


# --- values ----------------------------------------------------------------------------


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    d = (a.detach().double() - b.detach().double()).abs()
    both_nan = a.isnan() & b.isnan()
    d = torch.where(both_nan, torch.zeros_like(d), d.nan_to_num(float("inf")))
    return float(d.max())


def _distance(a: torch.Tensor, ref: torch.Tensor) -> float:
    """L2 distance (NaN where both are NaN counts as equal)."""
    d = a.detach().double() - ref
    d = torch.where(a.isnan() & ref.isnan(), torch.zeros_like(d), d.nan_to_num(float("inf")))
    return float(d.norm())


def _differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((~((a == b) | (a.isnan() & b.isnan()))).sum())


FUSED64_RTOL = 1e-9


def compare_tensor(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    fused: bool,
    reference64: Optional[Callable[[], torch.Tensor]] = None,
    wrapped64: Optional[Callable[[], Optional[tuple[torch.Tensor, torch.Tensor]]]] = None,
) -> Optional[str]:
    """None if ``actual`` passes against ``expected`` (see the module's docstring),
    else a one-line description of the mismatch. ``wrapped64`` gives the value of the
    float64 wrapper and of float64 eager, or None where the float64 plan fused nothing."""
    actual, expected = actual.detach(), expected.detach()
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{name}: {tuple(actual.shape)} {actual.dtype} vs {tuple(expected.shape)} {expected.dtype}"
    if torch.equal(actual, expected) or (
        actual.is_floating_point() and bool(((actual == expected) | (actual.isnan() & expected.isnan())).all())
    ):
        return None
    diff = _max_diff(actual, expected)
    count = f"{_differing(actual, expected)}/{actual.numel()} elements differ, max |diff| {diff:.3g}"
    if not actual.is_floating_point():
        failure = f"{name}: {count} (integers)"
        if fused and wrapped64 is not None:
            # Integers computed from floats (detection labels after NMS and top-k):
            # a fused kernel's rounding may flip a near tie, as at a kink. The float64
            # wrapper decides: its integers must be float64 eager's.
            try:
                w64 = wrapped64()
            except Exception as exc:  # noqa: BLE001 - the float64 wrapper could not run: exact rule
                return f"{failure}; float64 wrapper: {type(exc).__name__}: {exc}"
            if w64 is not None:
                w, e64 = w64
                if w.shape == e64.shape and torch.equal(w, e64):
                    return None
                return f"{failure}; in float64 the wrapper differs from eager too"
        return failure
    if fused and torch.allclose(actual, expected, rtol=RTOL32, atol=ATOL32, equal_nan=True):
        return None
    kind = "fused, beyond float32 tolerances" if fused else "not bitwise equal without fusion"
    if reference64 is None:
        return f"{name}: {kind}: {count}"
    try:
        ref = reference64().detach().double()
    except Exception as exc:  # noqa: BLE001 - no float64 reference: float32 tolerances decide
        return f"{name}: {kind}: {count} (no float64 reference: {exc})"
    d_wrapped = _distance(actual, ref)
    d_eager = _distance(expected, ref)
    allowed = factor(ref.numel()) * max(d_eager, ULPS * _distance(torch.zeros_like(ref), ref))
    versus = f"L2 distance from float64 {d_wrapped:.3g}, {d_wrapped / max(d_eager, 1e-300):.3g}x eager's {d_eager:.3g}"
    if not fused:
        # Always a failure; the float64 distance says whether it looks like summation order.
        return f"{name}: {kind}: {count}; {versus}"
    if d_wrapped <= allowed:
        return None
    failure = f"{name}: fused: {count}; {versus} (allowed {allowed:.3g})"
    if wrapped64 is not None:
        try:
            w64 = wrapped64()
        except Exception as exc:  # noqa: BLE001 - the float64 wrapper could not run: the float32 rule stands
            return f"{failure}; float64 wrapper: {type(exc).__name__}: {exc}"
        if w64 is not None:
            w, e64 = (t.detach().double() for t in w64)
            d64, norm = float((w - e64).norm()), float(e64.norm())
            if d64 <= FUSED64_RTOL * max(norm, 1e-300):
                return None
            return f"{failure}; in float64 the wrapper is {d64:.3g} from eager (norm {norm:.3g})"
    return failure


def report(problems: list[str], what: str) -> None:
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise AssertionError(f"{what}: {len(problems)} mismatch(es)\n  {shown}{more}")


# --- running in lockstep -----------------------------------------------------------------


def _to_double(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to_double(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_double(v) for v in value)
    return value


def loss_of(out: Any) -> torch.Tensor:
    """A scalar that depends on every element of every floating output: a fixed random
    weighting (the same for float32 and float64 runs)."""
    total = None
    for i, (_, t) in enumerate(leaves(out)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or not t.requires_grad:
            continue
        g = torch.Generator().manual_seed(1000 + i)
        w = torch.randn(t.shape, generator=g).to(t.dtype)
        term = (t * w).sum()
        total = term if total is None else total + term
    assert total is not None, "the model's output has no floating tensor that requires grad"
    return total


def double_copy(model: nn.Module) -> nn.Module:
    """A float64 copy of ``model`` for reference runs. transformers' default MoE experts
    kernel (``grouped_mm``) has no float64 version: the copy uses its loop over experts
    (the same mathematics). A tensor attribute a forward left holding its graph
    (RecurrentGemma keeps its last recurrent state) is copied detached: ``deepcopy``
    refuses tensors that are not graph leaves."""
    memo: dict = {}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and not value.is_leaf:
                memo[id(value)] = value.detach().clone()
    m64 = copy.deepcopy(model, memo).double()
    if hasattr(m64, "set_experts_implementation") and getattr(m64.config, "_experts_implementation", None):
        m64.set_experts_implementation("eager")
    return m64


def _plan_fused(sm: ss.StreamScheduledModule) -> bool:
    plan = sm.plan
    return bool(plan is not None and getattr(plan, "fused_groups", None))


def _nested_fused(sm: ss.StreamScheduledModule) -> bool:
    """Whether a nested plan (streamsched.nesting: a child of what runs as written) with
    fused kernels runs its schedule: its kernels round as the root's would."""
    return any(p.fused_groups and p.executor != "eager" for p in sm.nested_plans.values())


def ran_plan(path: str) -> bool:
    """Whether a call on ``path`` ran the compiled schedule (any executor, or its CUDA graph)."""
    return path.startswith("plan:") or path == "graph"


def options_name(options: dict) -> str:
    return next((name for name, o in OPTIONS.items() if o == options), repr(options))


class Lockstep:
    """An eager model and a wrapped deep copy, called with the same inputs."""

    def __init__(self, spec: ModelSpec, base: nn.Module, options: dict, exact_grads: bool = True):
        """``exact_grads=False`` holds gradients of unfused plans to the fused (float64)
        rule too: a rounding-level difference in a gradient's summation order is then
        not reported, a wrong gradient still is."""
        self.spec = spec
        self.exact_grads = exact_grads
        self.base = base
        self.ref = copy.deepcopy(base)
        self.sm = ss.StreamScheduledModule(copy.deepcopy(base), **options)
        self.options = options
        self.seed = 0
        self.fused_seen = False
        self.calls = 0
        # An explicit executor: no trial, every call after a signature's first runs the plan.
        self.explicit = options.get("executor", "auto") != "auto"
        self.last_of: dict = {}  # signature -> the path of its most recent call
        self.recordings: dict = {}  # signature -> how many of its calls recorded
        self.kernels_checked: set = set()
        # The path of every call, and of the calls whose output types were compared.
        self.paths: list[str] = []
        # Signatures whose first call ran as written (a call structure's first call in
        # inference under auto, planning.signatures.FIRST_CALL_AS_WRITTEN): their next
        # call records, as a first call does.
        self.deferred: set = set()
        self.structure_paths: list[str] = []
        self.seen = PATHS_SEEN.setdefault((spec.name, options_name(options)), Counter())
        # (args, kwargs, every module's training flag) of each call: replayed in float64
        # when buffers need a reference.
        self.history: list[tuple] = []

    # Mode changes, applied to both: the wrapper through its own API.
    def train(self) -> None:
        self.ref.train()
        self.sm.train()

    def eval(self) -> None:
        self.ref.eval()
        self.sm.eval()

    def freeze_batchnorm(self) -> None:
        freeze_batchnorm(self.ref)
        freeze_batchnorm(self.sm)

    def _inputs(self) -> tuple:
        self.seed += 1
        return self.spec.inputs(self.seed)

    @property
    def rng_seed(self) -> int:
        """The global random seed both models' forwards start from on this call."""
        return 7919 * self.seed

    def _reference64(self, buffers: dict, args: tuple, kwargs: dict, backward: bool) -> Callable:
        """A memoised float64 run of the eager model as it was before the call (its
        parameters never change here; ``buffers`` are its buffers from before the call)."""
        memo: dict = {}

        def run() -> tuple[Any, dict]:
            if not memo:
                m64 = double_copy(self.ref)
                for name, b in m64.named_buffers():
                    b.copy_(buffers[name])
                for p in m64.parameters():
                    p.grad = None
                with torch.set_grad_enabled(backward):
                    torch.manual_seed(self.rng_seed)
                    out = m64(*_to_double(args), **_to_double(kwargs))
                    if backward:
                        loss_of(out).backward()
                memo["out"] = out
                memo["grads"] = {n: p.grad for n, p in m64.named_parameters() if p.grad is not None}
            return memo["out"], memo["grads"]

        return run

    def _wrapped64(self, buffers: dict, args: tuple, kwargs: dict, backward: bool) -> Callable:
        """A memoised float64 run of the *wrapper* on this call: a float64 copy of the
        model as it was before the call, wrapped with the same options, called twice on
        the call's inputs (the first call traces and records; the state is restored
        before the second, which runs the fused plan). Returns ``(outputs, grads,
        fused)``; ``fused`` says whether that plan fused anything."""
        memo: dict = {}

        def run() -> tuple[Any, dict, bool]:
            if not memo:
                m64 = double_copy(self.ref)
                for m, r in zip(m64.modules(), self.ref.modules()):
                    m.training = r.training
                sm64 = ss.StreamScheduledModule(m64, **self.options)
                for _ in range(2):  # the first call records, the second runs the plan (checked below)
                    with torch.no_grad():
                        for name, b in m64.named_buffers():
                            b.copy_(buffers[name])
                    for p in m64.parameters():
                        p.grad = None
                    with torch.set_grad_enabled(backward):
                        torch.manual_seed(self.rng_seed)
                        out = sm64(*_to_double(args), **_to_double(kwargs))
                        if backward:
                            loss_of(out).backward()
                memo["out"] = out
                memo["grads"] = {n: p.grad for n, p in m64.named_parameters() if p.grad is not None}
                memo["fused"] = (_plan_fused(sm64) and ran_plan(last_path(sm64))) or _nested_fused(sm64)
            return memo["out"], memo["grads"], memo["fused"]

        return run

    @property
    def scheduled(self) -> bool:
        """Whether any call so far ran the compiled schedule (an untraceable model under
        eager dispatch, or one the trial runs as written, never does)."""
        return any(ran_plan(p) for p in self.paths)

    def _chain_in_inference(self, training: bool, grad: bool) -> bool:
        """Whether the last call's plan decided, under ``auto`` in inference, that the
        traced forward is a chain (``CHAIN_AS_WRITTEN``: nothing to run side by side or
        batch): it runs as written from its first planned call, with nothing recorded."""
        if self.explicit or training or grad:
            return False
        plan = self.sm.plan
        return plan is not None and "is a chain" in (plan.reason or "")

    def _check_path(self, label: str, signature: tuple) -> str:
        """The path of the wrapper's last call, asserted against what the options allow.

        A signature's first call records. One later call may record it again, where the
        model changed itself on its first call (transformers registers its
        output-capturing hooks then, and a registered hook re-traces: segformer and llama
        with hidden states record on their first two calls); every other call runs the
        plan (explicit executor) or the trial's choice. A first call under eager dispatch
        may be followed by a recording call for the same reason (the forward registered
        those hooks while traced, which a trace refuses: hf_bert_hidden_states_attentions);
        from then on the same rules hold. Under ``auto``, a call structure's first call in
        inference (``eval()``, no gradients) runs as written and its next call is the
        first one: it is not counted as a call of the signature; and a traced forward that
        is a chain runs as written from then on, nothing recorded (``CHAIN_AS_WRITTEN``)."""
        path = last_path(self.sm)
        self.seen[path] += 1
        before = self.last_of.get(signature)
        training, grad = signature[0][0], signature[1]
        if (
            before is None
            and path == "as-written"
            and not (self.explicit or training or grad)
            and signature not in self.deferred
        ):
            self.deferred.add(signature)
            return path  # the next call of the signature is its first planned one
        self.paths.append(path)
        self.last_of[signature] = path
        if path == "recorded":
            self.recordings[signature] = self.recordings.get(signature, 0) + 1
        untraceable = self.paths[0] == "eager-dispatch" and "recorded" not in self.paths
        try:
            if untraceable:
                # The model's forward cannot be traced: eager dispatch (its branch calls
                # scheduled), or after quiet calls under the default options, as written.
                assert_path(self.sm, "eager-dispatch", *(() if self.explicit else ("as-written",)))
            elif before is None and path == "as-written" and self._chain_in_inference(training, grad):
                pass  # a chain in inference: decided as written once traced, nothing recorded
            elif before is None or (path == "recorded" and self.recordings[signature] <= 2):
                assert_path(self.sm, "recorded")
            elif self.explicit:
                assert_path(self.sm, "plan", "graph")
            else:
                assert_path(self.sm, "plan", "graph", "as-written")
        except AssertionError as exc:
            raise AssertionError(f"{label}: {exc} (previous call of this signature: {before})") from None
        return path

    def call(self, what: str, backward: bool, values: bool = True, structure: bool = False) -> tuple[Any, Any]:
        """One call of both with fresh inputs. ``backward``: in grad mode, then
        ``loss_of(out).backward()`` on each (gradients set to None first); else under
        ``no_grad``. ``values``: compare the outputs' tensors (in order, whatever the
        containers) and, with ``backward``, every parameter's gradient. ``structure``:
        compare the outputs' types and structure. The wrapper's path is asserted (see the
        module's docstring); a fused plan's kernels are checked against their members
        first. Returns ``(wrapped, eager)`` outputs."""
        args, kwargs = self._inputs()
        self.calls += 1
        flags = [m.training for m in self.ref.modules()]
        self.history.append((args, kwargs, flags))
        signature = (tuple(flags), backward)
        buffers = {n: b.clone() for n, b in self.ref.named_buffers()} if values else {}
        for p in list(self.ref.parameters()) + list(self.sm.parameters()):
            p.grad = None
        with torch.set_grad_enabled(backward):
            # The same random draws for both (a model may draw in its forward: ViTMAE's
            # masking noise, PhiMoE's sampled routing in training).
            torch.manual_seed(self.rng_seed)
            expected = self.ref(*args, **kwargs)
            torch.manual_seed(self.rng_seed)
            actual = self.sm(*args, **kwargs)
            path = self._check_path(f"{what}: call {self.calls}", signature)
            # Only a call that ran a fused plan ran fused kernels: the recording call and
            # the model as written run eager's own.
            root_fused = ran_plan(path) and _plan_fused(self.sm)
            # Nested plans' kernels round as the root's would (their own check: the unit
            # tests of streamsched.nesting and the per-kernel check of root plans).
            fused = root_fused or _nested_fused(self.sm)
            self.fused_seen |= fused
            # Buffers a fused kernel updated (BatchNorm statistics summed in another order)
            # carry its rounding into every later call, whatever path that call runs.
            inexact = fused or (self.fused_seen and any(True for _ in self.sm.buffers()))
            kind = "fused" if fused else "state from fused calls" if inexact else "no fused kernel"
            label = f"{what}: call {self.calls} ({path}, {kind})"
            if backward:
                loss_of(expected).backward()
                loss_of(actual).backward()
        if root_fused and signature not in self.kernels_checked:
            # After backward: the check writes the buffers back in place, which moves
            # their version counters (BatchNorm saves its running statistics for backward).
            self.kernels_checked.add(signature)
            checked, problems = fused_kernel_problems(self.sm, *args, **kwargs)
            assert checked, f"{label}: the plan lists fused groups but its graph ran no fused kernel"
            report(problems, f"{label}: fused kernels vs their members, float32")
        # Branches run side by side on CPU threads create their autograd nodes
        # interleaved, and the engine sums a gradient several branches feed in that
        # order: float rounding, held to the float64 rule as fused values are.
        reordered = inexact or path == "plan:threads" or not self.exact_grads
        if structure:
            self.structure_paths.append(path)
            try:
                assert_same_structure(actual, expected)
            except AssertionError as exc:
                raise AssertionError(f"{label}: {exc}") from None
        if not values:
            return actual, expected
        ref64 = self._reference64(buffers, args, kwargs, backward)
        wrapped64 = self._wrapped64(buffers, args, kwargs, backward)
        got = [t for _, t in leaves(actual) if isinstance(t, torch.Tensor)]
        want = [(path, t) for path, t in leaves(expected) if isinstance(t, torch.Tensor)]
        assert len(got) == len(want), f"{label}: {len(got)} output tensors, eager {len(want)}"
        problems = []
        for i, (a, (path, e)) in enumerate(zip(got, want)):

            def reference(i: int = i) -> torch.Tensor:
                out64 = [t for _, t in leaves(ref64()[0]) if isinstance(t, torch.Tensor)]
                return out64[i].float()

            def in_float64(i: int = i) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
                out, _, fused64 = wrapped64()
                if not fused64:
                    return None
                out64 = [t for _, t in leaves(ref64()[0]) if isinstance(t, torch.Tensor)]
                return [t for _, t in leaves(out) if isinstance(t, torch.Tensor)][i], out64[i]

            problem = compare_tensor(path, a, e, inexact, reference, in_float64)
            if problem:
                problems.append(problem)
        report(problems, f"{label}: outputs")
        if backward:
            self.check_grads(label, reordered, ref64, wrapped64)
        return actual, expected

    def check_grads(self, what: str, fused: bool, ref64: Callable, wrapped64: Optional[Callable] = None) -> None:
        g_e = {n: p.grad for n, p in self.ref.named_parameters()}
        g_a = {n: p.grad for n, p in self.sm.module.named_parameters()}
        assert g_a.keys() == g_e.keys(), f"{what}: parameter names differ: {set(g_a) ^ set(g_e)}"
        missing = [n for n in g_e if (g_e[n] is None) != (g_a[n] is None)]
        problems = [
            f"{n}: .grad is {'None' if g_a[n] is None else 'set'} in the wrapper, "
            f"{'None' if g_e[n] is None else 'set'} in eager"
            for n in missing
        ]
        for n in g_e:
            if n in missing or g_e[n] is None:
                continue

            def reference(n: str = n) -> torch.Tensor:
                return ref64()[1][n].float()

            def in_float64(n: str = n) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
                if wrapped64 is None:
                    return None
                _, grads, fused64 = wrapped64()
                if not fused64 or n not in grads:
                    return None
                return grads[n], ref64()[1][n]

            p = compare_tensor(f"{n}.grad", g_a[n], g_e[n], fused, reference, in_float64)
            if p:
                problems.append(p)
        report(problems, f"{what}: gradients")

    def _state64(self) -> dict:
        """The state_dict of a float64 copy of the model after the same calls."""
        m64 = double_copy(self.base)
        with torch.no_grad():
            for args, kwargs, flags in self.history:
                for m, flag in zip(m64.modules(), flags):
                    m.training = flag
                m64(*_to_double(args), **_to_double(kwargs))
        return m64.state_dict()

    def check_state(self, what: str) -> None:
        s_a = self.sm.state_dict()
        s_e = self.ref.state_dict()
        assert list(s_a.keys()) == list(s_e.keys()), f"{what}: state_dict keys differ: {set(s_a) ^ set(s_e)}"
        memo: dict = {}

        def state64() -> dict:
            if not memo:
                memo["state"] = self._state64()
            return memo["state"]

        problems = []
        for k, e in s_e.items():

            def reference(k: str = k) -> torch.Tensor:
                return state64()[k]

            p = compare_tensor(k, s_a[k], e, self.fused_seen, reference)
            if p:
                problems.append(p)
        report(problems, f"{what}: state_dict after call {self.calls}")
