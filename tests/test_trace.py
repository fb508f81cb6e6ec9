import numpy as np
import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.branch import BranchCall
from streamsched.frontend import trace as trace_module
from streamsched.testing import last_path

from .helpers import assert_close, check_against_eager


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.fc(x)) * 2


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Block()
        self.b = Block()

    def forward(self, x):
        return self.a(x) + self.b(x)


def _plan_names(sm):
    return [n for t in sm.plan.tasks for n in t.nodes]


def test_builtin_modules_are_leaves_and_custom_ones_are_traced_through():
    sm = ss.StreamScheduledModule(Net(), executor="serial", fuse=False)
    sm(torch.randn(2, 8))
    graph = sm._ss.last.graph
    targets = [n.target for n in graph.nodes if n.op == "call_module"]
    assert targets == ["a.fc", "b.fc"]


def test_leaf_modules_option_makes_a_custom_class_opaque():
    sm = ss.StreamScheduledModule(Net(), executor="serial", fuse=False, leaf_modules=(Block,))
    sm(torch.randn(2, 8))
    targets = [n.target for n in sm._ss.last.graph.nodes if n.op == "call_module"]
    assert targets == ["a", "b"]


@ss.branch
def data_dependent(x):
    # Anything goes inside a branch: control flow on values, .item(), Python lists.
    if x.sum() > 0:
        return x * 2
    return [x - 1][0]


class WithBranches(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    @ss.branch
    def head(self, h):
        return h.relu() if float(h.detach().mean()) > -10 else h

    def forward(self, x):
        return self.head(self.fc(x)) + data_dependent(x)


def test_branch_functions_and_methods_are_single_opaque_nodes():
    model = WithBranches()
    sm = check_against_eager(model, (torch.randn(4, 8),), executor="serial")
    branch_nodes = [n for n in sm._ss.last.graph.nodes if isinstance(n.target, BranchCall)]
    assert sorted(n.target.task_name for n in branch_nodes) == ["data_dependent", "head"]
    # The data-dependent branch takes the other path on other data, as in eager.
    x = -torch.ones(4, 8) * 5
    assert_close(sm(x), model(x))


def test_branch_outside_a_wrapper_is_the_plain_function():
    x = torch.ones(3)
    assert torch.equal(data_dependent(x), x * 2)
    assert torch.equal(data_dependent(-x), -x - 1)


@ss.branch
class OpaqueBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def test_branch_decorated_module_class_is_a_leaf():
    model = nn.Sequential(nn.Linear(8, 8), OpaqueBlock())
    sm = check_against_eager(model, (torch.randn(3, 8),), executor="serial")
    assert [n.target for n in sm._ss.last.graph.nodes if n.op == "call_module"] == ["0", "1"]


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x)


class Inner(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # control flow on a traced value
            return x
        return -x


def test_untraceable_submodule_becomes_opaque_and_the_rest_is_traced():
    model = Untraceable()
    # (serial: under auto a chain around an opaque call runs as written, test_nested_plans)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for x in (torch.randn(3).abs(), -torch.randn(3).abs()):
        assert torch.equal(sm(x), model(x))
    assert [o.path for o in sm.plan.opaque] == ["inner"]
    assert "control flow" in sm.plan.opaque[0].reason
    assert "opaque: 1 module call run as written" in sm.plan.summary()


class InnerBeside(nn.Module):
    """An untraceable child beside a traced branch: a plan with the child opaque."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.side = nn.Linear(3, 3)

    def forward(self, x):
        return self.inner(x) + self.side(x)


def _count_trace_attempts(monkeypatch) -> list:
    """The models each attempt of a trace is made of (a retry is another attempt)."""
    attempts = []
    trace_once = trace_module._trace_once

    def counted(model, *args, **kwargs):
        attempts.append(model)
        return trace_once(model, *args, **kwargs)

    monkeypatch.setattr(trace_module, "_trace_once", counted)
    return attempts


def test_a_new_call_structure_starts_from_the_opaque_classes_found(monkeypatch):
    """Each call structure is traced on its own; the second starts with the class the
    first trace's retry made opaque, so it traces the model once, not twice, and gets
    the same plan."""
    attempts = _count_trace_attempts(monkeypatch)
    model = InnerBeside()
    sm = ss.StreamScheduledModule(model, executor="serial")
    calls = [(torch.randn(3), "recorded"), (-torch.randn(3).abs(), "plan:serial")]
    calls += [(torch.randn(2, 3), "recorded"), (torch.randn(4, 2, 3), "recorded")]  # a structure per rank
    for x, path in calls:
        with torch.no_grad():
            assert_close(sm(x), model(x))
        assert last_path(sm) == path
        assert [o.path for o in sm.plan.opaque] == ["inner"]
        assert "control flow" in sm.plan.opaque[0].reason
    # rank 1: failed in Inner, then traced with Inner opaque; ranks 2 and 3: once each.
    assert len(attempts) == 4, attempts


def test_the_opaque_classes_found_are_forgotten_when_the_model_changes(monkeypatch):
    """A submodule registered anew (the generation moves) starts the next trace afresh:
    the class found untraceable before is tried again."""
    attempts = _count_trace_attempts(monkeypatch)
    model = InnerBeside()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        sm(torch.randn(3))
    assert len(attempts) == 2
    model.side = nn.Linear(3, 3)
    with torch.no_grad():
        x = torch.randn(2, 3)
        assert_close(sm(x), model(x))
    assert len(attempts) == 4  # failed in Inner again, then Inner opaque
    assert [o.path for o in sm.plan.opaque] == ["inner"]


class UntraceableRoot(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a traced value, in the root's own forward
            return self.fc(x)
        return -x


def test_untraceable_root_names_module_line_and_fix():
    sm = ss.StreamScheduledModule(UntraceableRoot(), strict=True)
    with pytest.raises(ss.TraceError) as info:
        sm(torch.randn(3))
    msg = str(info.value)
    assert "UntraceableRoot.forward" in msg and "the root module" in msg
    assert "test_trace.py" in msg and "if x.sum() > 0" in msg
    assert "@streamsched.branch" in msg and "strict=False" in msg
    # The wrapper is not corrupted: the next call fails the same clear way, and the
    # model's own forward is untouched.
    with pytest.raises(ss.TraceError, match="the root module"):
        sm(torch.ones(3))
    assert torch.equal(sm.module(torch.ones(3)), sm.module.fc(torch.ones(3)))


class Optional_(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, y=None, scale: float = 1.0, shape=(2, -1)):
        out = self.fc(x)
        if y is not None:
            out = out + y
        return (out * scale).reshape(shape)


def test_non_tensor_arguments_are_specialised_per_value():
    model = Optional_()
    sm = ss.StreamScheduledModule(model)
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    assert_close(sm(x), model(x))
    assert_close(sm(x, y), model(x, y))
    assert_close(sm(x, y=y, scale=3.0), model(x, y=y, scale=3.0))
    assert_close(sm(x, scale=2.0, shape=(-1,)), model(x, scale=2.0, shape=(-1,)))
    assert len(sm._ss.traces) == 4


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, inputs: dict, extra: list):
        h = self.fc(inputs["a"]) + inputs["b"]
        return {"sum": h + extra[0], "pair": (h, extra[1] * 2)}


def test_nested_inputs_and_outputs():
    model = Structured()
    sm = ss.StreamScheduledModule(model)
    args = ({"a": torch.randn(3, 4), "b": torch.randn(3, 4)}, [torch.randn(3, 4), torch.randn(2)])
    for _ in range(2):
        out = sm(*args)
        ref = model(*args)
        assert set(out) == {"sum", "pair"} and isinstance(out["pair"], tuple)
        assert_close(out, ref)


def test_bad_call_arguments_raise_type_error_naming_forward():
    sm = ss.StreamScheduledModule(Net())
    with pytest.raises(TypeError, match="Net.forward"):
        sm()
    with pytest.raises(TypeError, match="Net.forward"):
        sm(torch.randn(2, 8), torch.randn(2, 8))
    assert sm(torch.randn(2, 8)).shape == (2, 8)


# numpy given a traced value: a slice of the shape (transformers' Perceiver flattens with
# np.prod(x.shape[1:-1])), the shape itself, a number computed from it.
NUMPY_ON_SHAPES = {
    "prod of a slice of the shape": lambda x: np.prod(x.shape[1:-1]) / 12,
    "sum of the shape": lambda x: np.sum(x.shape) / 9,
    "rounding of a number": lambda x: np.round(x.shape[-1] * 0.5),
}


class NumpyScale(nn.Module):
    """Scales by a number numpy computes from its input's shape. numpy's reductions call
    the method of the same name on what they are given (``x.shape[1:-1].prod()``), which
    a traced value seems to have."""

    def __init__(self, numpy_of_shape):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.numpy_of_shape = numpy_of_shape

    def forward(self, x):
        return self.fc(x) * self.numpy_of_shape(x)


class NumpyModel(nn.Module):
    def __init__(self, numpy_of_shape):
        super().__init__()
        self.pre = NumpyScale(numpy_of_shape)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h = self.pre(x)
        return self.a(h) + self.b(h)


@pytest.mark.parametrize("executor", ["serial", "auto"])
@pytest.mark.parametrize("case", sorted(NUMPY_ON_SHAPES))
def test_numpy_on_a_traced_shape_runs_as_written(case, executor):
    """numpy given a traced value (a shape, a number) would be recorded as a method call
    of that value, which a ``torch.Size`` or an ``int`` does not have at run time: the
    module doing it runs as written (opaque), the rest is traced."""
    model = NumpyModel(NUMPY_ON_SHAPES[case])
    sm = ss.StreamScheduledModule(model, executor=executor)
    for seed in range(4):
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            # (a and b may be fused: a batched product sums in another order)
            torch.testing.assert_close(sm(x), model(x))
        assert last_path(sm) != "eager-dispatch"
    assert [o.path for o in sm.plan.opaque] == ["pre"]
    assert "numpy" in sm.plan.opaque[0].reason
