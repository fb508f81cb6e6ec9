"""A buffer given another tensor under its name on every call (a branch keeping its last
output, ``self.last = y.detach()``; running statistics assigned rather than updated in
place). Traces read buffers on every call, so such a call needs no re-check of every
trace's modules: that re-check, on every call, made a small model three times slower than
eager. Every call equals eager, fused stacks of buffers included."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.frontend.trace import Traced
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_patterns_state import D, Towers


class KeepsItsLast(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.register_buffer("last", torch.zeros(4, D))

    def forward(self, x):
        y = self.linear(x)
        self.last = y.detach()  # a buffer given another tensor: as eager, every call
        return y


class TowersAndAKeeper(Towers):
    def __init__(self):
        super().__init__()
        self.keeper = KeepsItsLast()

    def forward(self, x):
        return torch.stack(self.branches(x) + [self.keeper(x)]).sum(0)


class NormedTowers(nn.Module):
    """Identical towers with batch norms (fused: their statistics stacked)."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D)) for _ in range(3))

    def forward(self, x):
        return torch.stack([t(x) for t in self.towers]).sum(0)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_branch_replacing_its_buffer_every_call_costs_no_re_check(executor, monkeypatch):
    torch.manual_seed(0)
    model = TowersAndAKeeper()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    checks = []
    original = Traced.modules_unchanged

    def counting(self):
        checks.append(1)
        return original(self)

    monkeypatch.setattr(Traced, "modules_unchanged", counting)
    with torch.no_grad():
        for call in range(10):
            x = torch.randn(4, D)
            expected = reference(x)
            actual = sm(x)
            path = assert_path(sm, "recorded", "plan")
            assert_close(actual, expected, what=f"call {call} ({path})")
            assert_close(model.keeper.last, reference.keeper.last, what=f"the kept buffer, call {call}")
    assert path == "plan:" + executor
    assert not checks, f"{len(checks)} re-checks of the traces' modules"


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_fused_statistics_given_other_tensors_are_read_anew(executor):
    torch.manual_seed(0)
    model = NormedTowers().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor).eval()
    with torch.no_grad():
        for call in range(8):
            if call % 2:
                for m in (reference, model):
                    m.towers[1][1].running_mean = torch.full((D,), float(call))
                    m.towers[2][1].running_var = torch.full((D,), 1.0 + call)
            x = torch.randn(4, D)
            expected = reference(x)
            actual = sm(x)
            path = assert_path(sm, "recorded", "plan")
            assert_close(actual, expected, what=f"call {call} ({path})")
    assert path == "plan:" + executor
