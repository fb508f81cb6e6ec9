"""A trace can take a path the code as written does not: ``hasattr(x, "name")`` holds
for every traced value, and a method called on it inside ``try`` never raises while
tracing. The traced graph then fails where the model runs (transformers' models met this
with ``jax`` installed: ``'Tensor' object has no attribute 'jax'``). The wrapper must run
such a call as written, say why, and keep raising the model's own errors as they are."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close, called_on

D = 16


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.right = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))
        self.head = nn.Linear(D, 4)


class HasattrProbe(_Branches):
    """What a library's ``is_jax_tensor``-style check can amount to."""

    def forward(self, x):
        y = self.left(x)
        if hasattr(y, "jax"):  # never on a tensor
            y = y * 2
        return self.head(y + self.right(x))


class GetattrDefault(_Branches):
    def forward(self, x):
        y = self.left(x)
        scale = getattr(y, "scale", None)
        if scale is not None:
            y = y * scale
        return self.head(y + self.right(x))


class TryMethod(_Branches):
    def forward(self, x):
        y = self.left(x)
        try:
            y = y.as_numpy_array()  # raises on a tensor
        except AttributeError:
            y = y + 1
        return self.head(y + self.right(x))


def _planned_as_eager(model: nn.Module, training: bool) -> None:
    """Three calls of ``model`` wrapped (recorded, then the plan), each output and input
    gradient equal to eager's."""
    sm = ss.StreamScheduledModule(model, executor="serial")
    for call, path in enumerate(["recorded", "plan:serial", "plan:serial"]):
        x = torch.randn(8, D, requires_grad=training)
        out, expected = called_on(sm, path, x), model(x)
        assert_close(out, expected, what=f"call {call} ({path})")
        if training:
            (g_out,) = torch.autograd.grad(out.sum(), x)
            (g_eager,) = torch.autograd.grad(expected.sum(), x)
            assert_close(g_out, g_eager, what=f"call {call}: input gradient")


@pytest.mark.parametrize("make", [HasattrProbe, GetattrDefault, TryMethod])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_traced_tensor_lacks_what_a_tensor_lacks(make, training):
    # The trace knows these values for tensors: it answers as a tensor does, and the plan
    # computes what the model does (fx alone took the other path: a wrong result).
    torch.manual_seed(0)
    model = make().train(training)
    _planned_as_eager(model, training)


def _passed_on(t):
    return t if t.shape[0] > 0 else t * 0


torch.fx.wrap("_passed_on")  # called as it is, its result opaque to the trace


class OpaqueProbe(_Branches):
    """A hasattr() test of a value the trace cannot tell for a tensor (a wrapped
    function's result), then a method only the other path calls, or arithmetic (which
    would run on any value: a wrong result, unless the test itself is checked)."""

    def __init__(self, then: str = "method"):
        super().__init__()
        self.then = then

    def forward(self, x):
        y = _passed_on(self.left(x))
        if hasattr(y, "jax"):
            y = y.jax() if self.then == "method" else y * 2
        return self.head(y + self.right(x))


@pytest.mark.parametrize("then", ["method", "arithmetic"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_trace_that_fails_where_the_model_runs_runs_the_model_as_written(training, then):
    torch.manual_seed(0)
    model = OpaqueProbe(then).train(training)
    sm = ss.StreamScheduledModule(model)
    warned = 0
    for call in range(6):
        x = torch.randn(8, D, requires_grad=training)
        expected = model(x)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sm(x)
        # Never the recording call's error: the model as written (as eager dispatch, then
        # settled as written).
        assert last_path(sm) in ("as-written", "eager-dispatch"), f"call {call}: {last_path(sm)}"
        assert_close(out, expected, what=f"call {call} ({last_path(sm)})")
        if training:
            (g_out,) = torch.autograd.grad(out.sum(), x)
            (g_eager,) = torch.autograd.grad(expected.sum(), x)
            assert_close(g_out, g_eager, what=f"call {call}: input gradient")
        said = [str(w.message) for w in caught if issubclass(w.category, ss.UntraceableWarning)]
        assert all("AttributeError" in s and "where the forward as written runs" in s for s in said), said
        assert all("in module 'getattr' of OpaqueProbe" in s for s in said), said  # where the trace raised it
        warned += len(said)
    assert warned == 1  # said once, after the recording call that failed


def test_under_strict_the_traces_error_is_raised():
    sm = ss.StreamScheduledModule(OpaqueProbe(), strict=True)
    with pytest.raises(AttributeError, match="no attribute 'jax'"):
        for _ in range(3):
            sm(torch.randn(8, D))


class Checked(_Branches):
    """Raises on a bad input, as written and traced alike."""

    def forward(self, x):
        return self.head(self.left(x) + self.right(x))


def test_an_error_the_model_raises_too_is_the_calls_and_the_next_call_is_still_planned():
    model = Checked()
    sm = ss.StreamScheduledModule(model, executor="serial")
    bad = torch.randn(8, D + 1)
    with pytest.raises(RuntimeError) as eager:
        model(bad)
    with pytest.raises(RuntimeError) as wrapped:
        sm(bad)  # the recording call: the traced graph raises, and so does the model
    assert str(eager.value).splitlines()[0] in str(wrapped.value)
    # The failed call is reported as what it was: run as written, its error the call's,
    # not a model that cannot be traced.
    assert last_path(sm) == "as-written"
    assert "error is the call's" in sm.plan.reason and "traced again" in sm.plan.reason
    assert "cannot be traced" not in sm.plan.reason
    assert f"[8, {D + 1}]" in str(sm.plan).splitlines()[0]
    # The error was the model's: the structure is not taken for untraceable.
    x = torch.randn(8, D)
    assert_close(called_on(sm, "recorded", x), model(x))
    assert_close(called_on(sm, "plan:serial", x), model(x))


class IsTensor(_Branches):
    """Type tests a forward makes of its values: eager takes the tensor path."""

    def __init__(self, test: str):
        super().__init__()
        self.test = test

    def forward(self, x):
        y = self.left(x)
        weight = self.left[0].weight
        if self.test == "isinstance":
            tensor = isinstance(y, torch.Tensor)
        elif self.test == "is_tensor":
            tensor = torch.is_tensor(y)
        elif self.test == "tuple of classes":
            tensor = isinstance(y, (torch.Tensor, list))
        elif self.test == "a size":
            tensor = isinstance(y.shape[0], int) and not isinstance(y.size(-1), torch.Tensor)
        elif self.test == "attributes":
            tensor = isinstance(y.shape, torch.Size) and isinstance(y.device, torch.device)
            tensor = tensor and isinstance(y.T, torch.Tensor) and isinstance(y.shape, tuple)
        else:  # a parameter read in the forward
            tensor = isinstance(weight, nn.Parameter)
        if tensor:
            y = y * 2
        return self.head(y + self.right(x))


@pytest.mark.parametrize("test", ["isinstance", "is_tensor", "tuple of classes", "a size", "attributes", "parameter"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_a_traced_value_is_an_instance_of_what_it_stands_for(test, training):
    # To fx a traced value is a Proxy, no tensor: the plan took the other path (a
    # wrong result, with nothing said).
    torch.manual_seed(0)
    model = IsTensor(test).train(training)
    _planned_as_eager(model, training)


def _halves(t):
    return t[:, : D // 2], t[:, D // 2 :]


torch.fx.wrap("_halves")


class TupleOrTensor(_Branches):
    """An opaque call's value tested for a tensor: it is a tuple."""

    def forward(self, x):
        out = _halves(self.left(x))
        if isinstance(out, torch.Tensor):
            y = out * 2
        else:
            y = torch.cat([out[1], out[0]], dim=-1)
        return self.head(y + self.right(x))


def test_a_value_taken_for_a_tensor_that_is_none_runs_the_call_as_written():
    model = TupleOrTensor()
    sm = ss.StreamScheduledModule(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in range(4):
            x = torch.randn(8, D)
            assert_close(sm(x), model(x), what=f"call {call} ({last_path(sm)})")
            assert last_path(sm) in ("as-written", "eager-dispatch"), f"call {call}: {last_path(sm)}"
    said = [str(w.message) for w in caught if issubclass(w.category, ss.UntraceableWarning)]
    assert len(said) == 1, said
    assert "tested the type of" in said[0] and "taken for Tensor" in said[0] and "gave tuple" in said[0], said


class ScalarArguments(_Branches):
    """torch functions given a traced value and a Python number, beside a type test:
    torch's C argument parser asks a value's class too, and a proxy it took for a tensor
    was read as one (the process crashed)."""

    def forward(self, x):
        y = self.left(x)
        if isinstance(y, torch.Tensor):
            y = 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * torch.pow(y, 3.0))))
        y = torch.clamp(y, min=-1.0) + torch.pow(y, 2)
        return self.head(y + self.right(x))


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_torch_functions_given_numbers_beside_a_type_test(training):
    torch.manual_seed(0)
    _planned_as_eager(ScalarArguments().train(training), training)


class SplitTuple(_Branches):
    """Type tests of calls' results, the calls given keyword arguments (the test's own
    call is the one to answer, never the torch function's inside it)."""

    def forward(self, x):
        parts = self.left(x).split(D // 2, dim=1)
        y = torch.cat(parts[::-1], dim=1) if isinstance(parts, tuple) else parts
        if isinstance(torch.pow(y, exponent=2.0), torch.Tensor):
            y = y * 2
        return self.head(y + self.right(x))


def test_a_type_test_of_a_call_given_keywords_is_the_tests_own():
    model = SplitTuple()
    sm = ss.StreamScheduledModule(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for call in range(4):
            x = torch.randn(8, D)
            assert_close(sm(x), model(x), what=f"call {call} ({last_path(sm)})")


class TaggedWeight(_Branches):
    """A Python attribute of a parameter, tested and read in the forward."""

    def forward(self, x):
        y = self.left(x)
        weight = self.left[0].weight
        if hasattr(weight, "gain"):
            y = y * weight.gain
        if hasattr(weight, "absent"):
            y = y * 0
        return self.head(y + self.right(x))


def test_a_parameters_own_attribute_is_tested_and_read_as_eager_does():
    model = TaggedWeight()
    model.left[0].weight.gain = 3.0
    sm = ss.StreamScheduledModule(model, executor="serial")
    for call, path in enumerate(["recorded", "plan:serial", "plan:serial"]):
        if call == 2:
            model.left[0].weight.gain = -0.5  # read on every call, not baked into the trace
        x = torch.randn(8, D)
        assert_close(called_on(sm, path, x), model(x), what=f"call {call} ({path})")
