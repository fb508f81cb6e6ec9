"""In-place writes, aliasing and grad-mode patterns, each compared with eager PyTorch
on fresh inputs under several executors: outputs, which storages the outputs share with
the inputs, the parameters and each other, the inputs after the call (a forward may
write them), the state, and the gradients of parameters and inputs.

Every pattern is a small model whose forward does one thing a trace cannot see by
looking at data flow alone. A pattern the wrapper cannot reproduce must run as written
(and still match); none may return a silently different result.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

# The recorded call and the plan's calls are compared with eager from the first call on.
pytestmark = pytest.mark.usefixtures("plan_first_calls")

D = 16


class Tower(nn.Module):
    def __init__(self, d: int = D):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Pair(nn.Module):
    """Two independent towers reading one stem: the smallest model with branches (and a
    fusable pair)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.left = Tower()
        self.right = Tower()


# --- the patterns --------------------------------------------------------------------


class ReturnsInput(Pair):
    def forward(self, x):
        return x, self.left(x) + self.right(x)


class ReturnsViewOfInput(Pair):
    def forward(self, x):
        return x[0], x.t(), self.left(x) + self.right(x)


class ReturnsSameTensorTwice(Pair):
    def forward(self, x):
        y = self.left(x) + self.right(x)
        return y, y, {"again": y}


class ReturnsParameterAndBuffer(Pair):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(D))

    def forward(self, x):
        return self.left(x) * self.scale + self.right(x), self.stem.weight, self.scale


class WritesInputAndReturnsIt(Pair):
    def forward(self, x):
        y = self.left(x)
        x.add_(1.0)
        return x, y + self.right(x)


class WritesViewOfInput(Pair):
    def forward(self, x):
        h = self.left(x)
        x[:, 0].zero_()
        x.diagonal().fill_(2.0)
        return h + self.right(x)


class WritesInputThroughOut(Pair):
    def forward(self, x, buf):
        a, b = self.left(x), self.right(x)
        torch.add(a, b, out=buf)
        return buf * 2, a


class CatIntoPreallocated(Pair):
    def forward(self, x):
        buf = torch.empty(x.shape[0], 2 * D)
        torch.cat([self.left(x), self.right(x)], dim=1, out=buf)
        return buf


class HeadsThenInPlaceOnCat(nn.Module):
    """Fusable heads ending in Sigmoid (whose backward reads its output), concatenated,
    then written in place: eager's cat is a new tensor, so the write cannot reach the
    sigmoid outputs autograd saved."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 4), nn.Sigmoid()) for _ in range(4))

    def forward(self, x):
        y = torch.cat([h(x) for h in self.heads], dim=1)
        y.mul_(2.0)
        y[:, 0] = 0.0
        return y


class HeadsThenInPlaceOnStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 4), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        y = torch.stack([h(x) for h in self.heads])
        y[0] += 1.0
        return y.relu_()


class HeadsWrittenThenRead(nn.Module):
    """One fused member's output written in place, then every member's output read."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        outs = [h(x) for h in self.heads]
        outs[1].mul_(-1.0)
        return torch.stack(outs).sum(0), outs[0]


class HeadWrittenThroughAView(nn.Module):
    """A fused member's output written through a view of it (no direct in-place user)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        outs = [h(x) for h in self.heads]
        outs[1].view(-1)[:5].zero_()
        return torch.cat(outs, dim=1)


class CatOfHeadsAndAHead(nn.Module):
    """The cat of a group and one member, both returned: in eager they share no storage."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, 4) for _ in range(3))

    def forward(self, x):
        outs = [h(x) for h in self.heads]
        return torch.cat(outs, dim=1), outs[0]


class NoGradInsideForward(Pair):
    def forward(self, x):
        with torch.no_grad():
            frozen = self.left(x)
        return frozen + self.right(x)


class EnableGradInsideForward(Pair):
    def forward(self, x):
        with torch.enable_grad():
            y = self.left(x)
        return y + self.right(x)


class DetachOneBranch(Pair):
    def forward(self, x):
        return self.left(x).detach() + self.right(x)


class NormalisesWeightInPlace(Pair):
    """Weight clamped in place under no_grad every call (a max-norm constraint)."""

    def forward(self, x):
        with torch.no_grad():
            self.stem.weight.clamp_(-0.1, 0.1)
        h = self.stem(x)
        return self.left(h) + self.right(h)


class CopiesIntoBuffer(Pair):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(D))

    def forward(self, x):
        h = self.stem(x)
        self.mean.copy_(h.detach().mean(0))
        return self.left(h) + self.right(h - self.mean)


class ReassignsBuffer(Pair):
    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x):
        h = self.stem(x)
        self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return self.left(h) + self.right(h) + self.ema


class CountsCalls(Pair):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.left(x) * self.calls + self.right(x)


class CachesActivation(Pair):
    def __init__(self):
        super().__init__()
        self.last = None

    def forward(self, x):
        h = self.stem(x)
        self.last = h.detach()
        return self.left(h) + self.right(h)


class SiameseSharedEncoder(nn.Module):
    """One encoder applied to two inputs: a fused pair would share every parameter."""

    def __init__(self):
        super().__init__()
        self.encoder = Tower()
        self.head = nn.Linear(D, 1)

    def forward(self, a, b):
        return self.head(self.encoder(a) - self.encoder(b))


class SharedModuleTwiceOnOneInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Tower()
        self.other = Tower()

    def forward(self, x):
        return self.block(x) + self.other(x) + self.block(x * 2)


class InPlaceReluSharedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.left = Tower()
        self.act = nn.ReLU(inplace=True)
        self.right = Tower()

    def forward(self, x):
        h = self.stem(x)
        a = self.left(h)
        b = self.right(self.act(h))
        return a + b + h


class MetadataInPlace(Pair):
    def forward(self, x):
        y = self.left(x) + self.right(x)
        y.unsqueeze_(0)
        y.transpose_(1, 2)
        return y


class ItemInForward(Pair):
    def forward(self, x):
        scale = float(x.abs().max().item())
        return self.left(x) * scale + self.right(x)


class InputsThatAreViewsOfOneBase(Pair):
    def forward(self, a, b):
        y = self.left(a)
        b.mul_(2.0)
        return y + self.right(a) + b.sum()


class RequiresGradInput(Pair):
    def forward(self, x):
        h = self.stem(x)
        return self.left(h) * x + self.right(h)


class WeightNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = torch.nn.utils.parametrizations.weight_norm(nn.Linear(D, D))
        self.right = torch.nn.utils.parametrizations.weight_norm(nn.Linear(D, D))

    def forward(self, x):
        return self.left(x) + self.right(x)


class SpectralNormed(nn.Module):
    """spectral_norm updates its power-iteration vectors in training (a buffer write in
    a parametrization)."""

    def __init__(self):
        super().__init__()
        self.left = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))
        self.right = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(D, D))

    def forward(self, x):
        return self.left(x) + self.right(x)


class OldWeightNorm(nn.Module):
    """The old weight_norm recomputes the weight in a forward pre-hook."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.left = torch.nn.utils.weight_norm(nn.Linear(D, D))
            self.right = torch.nn.utils.weight_norm(nn.Linear(D, D))

    def forward(self, x):
        return self.left(x) + self.right(x)


class AutocastInsideForward(Pair):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.left(x)
        return y.float() + self.right(x)


class ScatterIntoZeros(Pair):
    def forward(self, x, index):
        out = torch.zeros(x.shape[0], 3 * D)
        out[:, :D] = self.left(x)
        out[:, D : 2 * D] = self.right(x)
        out.index_add_(1, index, x)
        return out


# --- inputs -----------------------------------------------------------------------------


def _x(requires_grad: bool = False) -> Callable[[], tuple]:
    def make() -> tuple:
        return (torch.randn(D, D, requires_grad=requires_grad),)

    return make


def _x_and_buf() -> tuple:
    return torch.randn(D, D), torch.empty(D, D)


def _two() -> tuple:
    return torch.randn(D, D), torch.randn(D, D)


def _views_of_one_base() -> tuple:
    base = torch.randn(2 * D, D)
    return base[:D], base[D:]


def _x_and_index() -> tuple:
    return torch.randn(D, D), torch.randint(0, 3 * D, (D,))


PATTERNS: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple]]] = {
    "returns_input": (ReturnsInput, _x()),
    "returns_view_of_input": (ReturnsViewOfInput, _x()),
    "returns_same_tensor_twice": (ReturnsSameTensorTwice, _x()),
    "returns_parameter_and_buffer": (ReturnsParameterAndBuffer, _x()),
    "writes_input_and_returns_it": (WritesInputAndReturnsIt, _x()),
    "writes_view_of_input": (WritesViewOfInput, _x()),
    "writes_input_through_out": (WritesInputThroughOut, _x_and_buf),
    "cat_into_preallocated": (CatIntoPreallocated, _x()),
    "heads_then_in_place_on_cat": (HeadsThenInPlaceOnCat, _x()),
    "heads_then_in_place_on_stack": (HeadsThenInPlaceOnStack, _x()),
    "heads_written_then_read": (HeadsWrittenThenRead, _x()),
    "head_written_through_a_view": (HeadWrittenThroughAView, _x()),
    "cat_of_heads_and_a_head": (CatOfHeadsAndAHead, _x()),
    "no_grad_inside_forward": (NoGradInsideForward, _x()),
    "enable_grad_inside_forward": (EnableGradInsideForward, _x()),
    "detach_one_branch": (DetachOneBranch, _x()),
    "normalises_weight_in_place": (NormalisesWeightInPlace, _x()),
    "copies_into_buffer": (CopiesIntoBuffer, _x()),
    "reassigns_buffer": (ReassignsBuffer, _x()),
    "counts_calls": (CountsCalls, _x()),
    "caches_activation": (CachesActivation, _x()),
    "siamese_shared_encoder": (SiameseSharedEncoder, _two),
    "shared_module_twice": (SharedModuleTwiceOnOneInput, _x()),
    "in_place_relu_shared_input": (InPlaceReluSharedInput, _x()),
    "metadata_in_place": (MetadataInPlace, _x()),
    "item_in_forward": (ItemInForward, _x()),
    "inputs_views_of_one_base": (InputsThatAreViewsOfOneBase, _views_of_one_base),
    "requires_grad_input": (RequiresGradInput, _x(requires_grad=True)),
    "weight_norm": (WeightNormed, _x()),
    "spectral_norm": (SpectralNormed, _x()),
    "old_weight_norm": (OldWeightNorm, _x()),
    "autocast_inside_forward": (AutocastInsideForward, _x()),
    "scatter_into_zeros": (ScatterIntoZeros, _x_and_index),
}

EXECUTORS = {
    "default": {},
    "serial": {"executor": "serial"},
    "threads-chaos": {"executor": "threads", "num_streams": 3, "min_task_cost": 0.0, "chaos": 1},
}

# Forwards that cannot be traced: eager dispatch runs them (no @streamsched.branch in
# them, so nothing is dispatched), the same way under every executor; they run under
# the default options only, each call asserted to be that path.
NOT_TRACED = {
    "no_grad_inside_forward",
    "enable_grad_inside_forward",
    "normalises_weight_in_place",
    "reassigns_buffer",
    "counts_calls",
    "caches_activation",
    "item_in_forward",
    "autocast_inside_forward",
}
# Eager itself raises on every training call of these: no call is ever recorded, no plan
# made, so the executors have nothing to run differently.
REFUSED_IN_TRAINING = {"writes_input_through_out", "cat_into_preallocated"}


def _cases(train: bool) -> list:
    """(pattern, executor) pairs where the executor changes what runs."""
    return [
        pytest.param(name, executor, id=f"{name}-{executor}")
        for name in PATTERNS
        for executor in EXECUTORS
        if executor == "default" or not (name in NOT_TRACED or (train and name in REFUSED_IN_TRAINING))
    ]


def _expected_paths(name: str, executor: str, call: int) -> tuple[str, ...]:
    """Which ways call ``call`` may run (``streamsched.testing.last_path``)."""
    if name in NOT_TRACED:
        return ("eager-dispatch", "as-written")
    if call == 0:
        return ("recorded",)
    if executor == "default":  # the auto trial: the plan, or the model as written
        return ("plan", "as-written")
    return ("plan:threads",) if executor.startswith("threads") else ("plan:serial",)


# --- the comparison ----------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def alias_map(outputs: Any, inputs: tuple, model: nn.Module) -> list[tuple]:
    """For each output tensor: which input, parameter or buffer, or earlier output it
    shares storage with (by position or name), and whether it is that very object."""
    named = [(f"input {i}", t) for i, t in enumerate(_tensors(inputs))]
    named += [(f"state {n}", t) for n, t in model.state_dict(keep_vars=True).items()]
    out = _tensors(outputs)
    result = []
    for i, t in enumerate(out):
        shared = [(name, other is t) for name, other in named if _storage(other) == _storage(t)]
        earlier = [(f"output {j}", out[j] is t) for j in range(i) if _storage(out[j]) == _storage(t)]
        result.append((tuple(shared), tuple(earlier)))
    return result


def _seeded(make: Callable[[], Any], seed: int) -> Any:
    """``make()`` under a fixed seed: called twice, two equal, unrelated copies (deepcopy
    would lose views' bases and parametrizations)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return make()


def _run_pattern(name: str, executor: str, train: bool, calls: int = 3) -> None:
    make_model, make_inputs = PATTERNS[name]
    model, ref = _seeded(make_model, 0), _seeded(make_model, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = ss.StreamScheduledModule(model, **EXECUTORS[executor])
    sm.train(train)
    ref.train(train)
    for call in range(calls):
        inputs, inputs_ref = _seeded(make_inputs, call + 1), _seeded(make_inputs, call + 1)
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
        what = f"{name} call {call}"
        with torch.set_grad_enabled(train), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                expected = ref(*inputs_ref)
            except RuntimeError as exc:
                # Eager itself refuses: the wrapper must refuse with the same error.
                with pytest.raises(type(exc), match=str(exc).split(",")[0][:60].replace("(", ".").replace(")", ".")):
                    sm(*inputs)
                continue
            actual = sm(*inputs)
        what = f"{what} ({assert_path(sm, *_expected_paths(name, executor, call))})"
        assert_close(actual, expected, what=f"{what}: outputs")
        for a, e in zip(_tensors(actual), _tensors(expected)):
            assert a.requires_grad == e.requires_grad, f"{what}: an output's requires_grad differs"
        assert alias_map(actual, inputs, model) == alias_map(expected, inputs_ref, ref), f"{what}: aliasing"
        assert_close(inputs, inputs_ref, what=f"{what}: inputs after the call")
        assert_close(
            list(model.state_dict().values()), list(ref.state_dict().values()), what=f"{what}: state after the call"
        )
        if train:
            loss = sum((t.float() * (k + 1)).sum() for k, t in enumerate(_tensors(actual)) if t.requires_grad)
            loss_ref = sum((t.float() * (k + 1)).sum() for k, t in enumerate(_tensors(expected)) if t.requires_grad)
            if isinstance(loss_ref, torch.Tensor):
                try:
                    loss_ref.backward()
                except RuntimeError as exc:
                    # Eager itself refuses (a tensor autograd saved was written in
                    # place): the wrapper must refuse the same way.
                    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                        loss.backward()
                    assert "modified by an inplace operation" in str(exc)
                    continue
                loss.backward()
            for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
                # A fused member whose output reaches no loss (a detached branch) has no
                # gradient, as in eager.
                assert (p.grad is None) == (q.grad is None), f"{what}: {n}.grad set in one only"
                if q.grad is not None:
                    assert_close(p.grad, q.grad, what=f"{what}: {n}.grad")
            for i, (a, e) in enumerate(zip(_tensors(inputs), _tensors(inputs_ref))):
                if e.requires_grad:
                    assert_close(a.grad, e.grad, what=f"{what}: input {i} grad")
        if hasattr(ref, "calls"):
            assert model.calls == ref.calls, f"{what}: a Python counter in forward"


@pytest.mark.parametrize("name, executor", _cases(train=False))
def test_pattern_in_eval_equals_eager(name, executor):
    _run_pattern(name, executor, train=False)


@pytest.mark.parametrize("name, executor", _cases(train=True))
def test_pattern_in_training_equals_eager(name, executor):
    _run_pattern(name, executor, train=True)
