"""The training flags in the plan key: every module's flag, not only the wrapped model's.

A trace bakes in the flags traced-through code reads, and a fused kernel runs its members
under one mode, so a plan is only valid for the flags it was made under. Each test flips
the flag of a module below the root (nested, fused, traced through), compares the next
calls with eager on fresh inputs, and says which path each call ran: the flip must make
a new plan (a recording call), and flipping back must find the first plan again.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamsched as ss

from .helpers import assert_close, called_on


class TracedNorm(nn.BatchNorm1d):
    """A BatchNorm outside torch.nn: traced through, its ``self.training`` branch baked
    into the trace."""

    def forward(self, x):
        if self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = TracedNorm(d)

    def forward(self, x):
        return torch.relu(self.norm(self.fc(x)))


class Nested(nn.Module):
    """Traced-through norms two and three levels below the root."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.stage = nn.Sequential(Block(d), nn.Sequential(Block(d)))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        return self.head(self.stage(x))


class FusedNorms(nn.Module):
    """Three identical Linear-BatchNorm towers on one input: fused when they share a mode."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.BatchNorm1d(d), nn.ReLU()) for _ in range(3))

    def forward(self, x):
        return torch.cat([t(x) for t in self.towers], dim=1)


def _planned_calls(eager, sm, first: str) -> None:
    """Two calls on fresh inputs compared with eager: ``first`` then the plan."""
    for path in (first, "plan"):
        x = torch.randn(8, 16)
        assert_close(called_on(sm, path, x), eager(x), atol=1e-5, rtol=1e-5)


def _flip(eager: nn.Module, sm: ss.StreamScheduledModule, path: str, mode: bool) -> None:
    eager.get_submodule(path).train(mode)
    sm.module.get_submodule(path).train(mode)


EXECUTORS = ["serial", "threads"]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("where", ["stage.0.norm", "stage.1.0.norm"], ids=["depth2", "depth3"])
def test_a_nested_traced_through_module_switched_to_eval_makes_a_new_plan(executor, where):
    model = Nested()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _planned_calls(eager, sm, "recorded")
    _flip(eager, sm, where, False)
    assert model.training  # the root's flag did not move
    _planned_calls(eager, sm, "recorded")
    assert len(sm.plans) == 2
    _flip(eager, sm, where, True)
    _planned_calls(eager, sm, "plan")  # the first plan again, no new recording
    assert len(sm.plans) == 2
    for name, buf in eager.state_dict().items():
        assert torch.equal(sm.state_dict()[name], buf), name


@pytest.mark.parametrize("executor", EXECUTORS)
def test_one_fused_member_switched_to_eval_leaves_the_group(executor):
    model = FusedNorms()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _planned_calls(eager, sm, "recorded")
    norms = [g for g in sm.plan.fused_groups if g.kind == "BatchNorm1d"]
    assert norms and norms[0].size == 3
    _flip(eager, sm, "towers.1.1", False)
    _planned_calls(eager, sm, "recorded")
    # Members of one kernel run under one mode: the eval member is not in a group now.
    fused = {m for g in sm.plan.fused_groups for m in g.members}
    assert "towers.1.1" not in fused
    _flip(eager, sm, "towers.1.1", True)
    _planned_calls(eager, sm, "plan")
    assert len(sm.plans) == 2
    for name, buf in eager.state_dict().items():
        assert_close(sm.state_dict()[name], buf, atol=1e-6, rtol=1e-6, what=name)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_every_fused_member_switched_to_eval_uses_running_statistics(executor):
    model = FusedNorms()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _planned_calls(eager, sm, "recorded")
    for i in range(3):
        _flip(eager, sm, f"towers.{i}.1", False)
    _planned_calls(eager, sm, "recorded")
    assert [g.size for g in sm.plan.fused_groups if g.kind == "BatchNorm1d"] == [3]
    for name, buf in eager.state_dict().items():
        assert_close(sm.state_dict()[name], buf, atol=1e-6, rtol=1e-6, what=name)
