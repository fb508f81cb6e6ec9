"""Inputs that alias the model's own state, or alias each other in a way that changes
from call to call. A plan orders the in-place writes of the call that recorded it: an
input that becomes a buffer the forward writes gets a plan of its own (equal to eager),
and inputs that alias one way and then another each find their plan again instead of
recording on every call."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close

D = 6


def towers():
    return nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(3))


class WritesBuffer(nn.Module):
    """Writes its buffer in place between reads of the argument ``w``."""

    def __init__(self):
        super().__init__()
        self.towers = towers()
        self.register_buffer("buf", torch.zeros(4, D))

    def forward(self, x, w):
        a = self.towers[0](w)
        self.buf.add_(x)
        return a, self.towers[1](w), self.towers[2](self.buf)


class WritesArgument(nn.Module):
    """Writes its argument ``x`` in place between reads of ``y``."""

    def __init__(self):
        super().__init__()
        self.towers = towers()

    def forward(self, x, y):
        a = self.towers[0](y)
        x.mul_(2)
        return a, self.towers[1](y), self.towers[2](x)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_an_argument_that_becomes_a_written_buffer(executor):
    torch.manual_seed(0)
    model = WritesBuffer().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    with torch.no_grad():
        for call in range(7):
            x = torch.randn(4, D)
            aliased = call >= 3
            expected = reference(x, reference.buf if aliased else reference.buf.clone())
            actual = sm(x, model.buf if aliased else model.buf.clone())
            paths.append(last_path(sm))
            assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
            assert_close(model.buf, reference.buf, what=f"buffer after call {call}")
    # The aliased calls got a plan of their own, recorded once, then run.
    assert paths[3] == "recorded", paths
    assert paths[4:] == [f"plan:{executor}"] * 3, paths


def test_aliasing_that_alternates_finds_each_plan():
    torch.manual_seed(0)
    model = WritesArgument().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with torch.no_grad():
        for call in range(10):
            x = torch.randn(4, D)
            x_ref, x_new = x.clone(), x.clone()
            same = call % 2 == 1
            expected = reference(x_ref, x_ref if same else x_ref.clone())
            actual = sm(x_new, x_new if same else x_new.clone())
            paths.append(last_path(sm))
            assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
            assert_close(x_new, x_ref, what=f"input after call {call}")
    # One recording per alias pattern; every later call runs its plan.
    assert paths[:2] == ["recorded", "recorded"], paths
    assert paths[2:] == ["plan:serial"] * 8, paths


class WritesAReshape(nn.Module):
    """``x.reshape(-1).add_(1)`` writes ``x`` only where ``x`` is contiguous (a view)."""

    def __init__(self):
        super().__init__()
        self.towers = towers()

    def forward(self, x):
        a = self.towers[0](x)
        x.reshape(-1).add_(1)
        return a, self.towers[1](x), self.towers[2](x)


@pytest.mark.parametrize("first", ["strided", "contiguous"])
def test_a_write_through_a_reshape_follows_the_layout(first):
    torch.manual_seed(0)
    model = WritesAReshape().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with torch.no_grad():
        for call in range(8):
            base = torch.randn(D, 4)
            strided = (call % 2 == 0) == (first == "strided")
            x = base.t() if strided else base.t().contiguous()
            x_ref, x_new = copy.deepcopy(x), copy.deepcopy(x)
            expected = reference(x_ref)
            actual = sm(x_new)
            paths.append(last_path(sm))
            assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
            assert_close(x_new, x_ref, what=f"input after call {call}")
    assert paths[:2] == ["recorded", "recorded"], paths
    assert paths[2:] == ["plan:serial"] * 6, paths
