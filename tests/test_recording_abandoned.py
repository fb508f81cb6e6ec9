"""A recording call whose leaf call returns what no trace can follow (an object holding
``None`` where the traced code took it for a tensor, which learning the call's output
structure cannot stand in for) runs the call as written instead of raising, where the
nodes it ran wrote no state; later calls go to eager dispatch. Equal to eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close

D = 6


class Result:
    """A plain object (no structure a trace can learn) holding a tensor and an extra."""

    def __init__(self, hidden, extra):
        self.hidden = hidden
        self.extra = extra


class Attention(nn.Module):
    """Untraceable (a branch on a tensor's value): an opaque call of the trace."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if h.sum() > -1e9:  # always: eager returns no extra
            return Result(h, None)
        return Result(h, h)  # pragma: no cover


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.towers = nn.ModuleList(nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        out = self.attention(x)
        h = out.hidden
        if out.extra is not None:  # the trace's proxy is not None: it takes this branch
            h = h + out.extra
        return sum(t(h) for t in self.towers)


@pytest.mark.parametrize(("executor", "training"), [("serial", False), ("auto", True), ("threads", True)])
def test_a_leaf_output_no_trace_can_follow_runs_as_written(executor, training):
    torch.manual_seed(0)
    model = Model().train(training)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(4):
        x = torch.randn(4, D)
        with torch.set_grad_enabled(training):
            expected = reference(x)
            actual = sm(x)
        paths.append(last_path(sm))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        if training:
            expected.sum().backward()
            actual.sum().backward()
            for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
                assert_close(p_new.grad, p_ref.grad, what=f"{name}.grad after call {call}")
    assert set(paths) <= {"eager-dispatch", "as-written"}, paths


def test_strict_raises_the_trace_error():
    torch.manual_seed(0)
    sm = ss.StreamScheduledModule(Model().eval(), executor="serial", strict=True)
    with pytest.raises(ss.TraceError, match="attention"):
        sm(torch.randn(4, D))
