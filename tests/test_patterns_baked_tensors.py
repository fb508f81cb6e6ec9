"""A forward computing with a tensor that is not a graph value (a module's plain tensor
attribute, an item of a list it holds, a namespace's, a global, a view of a weight the
module keeps): the trace ran that computation once on the real tensor (``self.t.sum()``)
and baked its result into the graph as a constant. The tensor updated in place between
calls (an optimizer step on the weight the view shows), or replaced, left the plan adding
the old result. Every call equals eager."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import streamsched as ss
from streamsched import runner
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_patterns_state import D, Towers

GLOBAL_TABLE = torch.zeros(D)


class ComputesWithHeldTensors(Towers):
    def __init__(self, where):
        super().__init__()
        self.where = where
        self.table = torch.zeros(D)
        self.tables = [torch.zeros(D)]
        self.state = types.SimpleNamespace(table=torch.zeros(D))

    def held(self):
        if self.where == "attribute":
            return self.table
        if self.where == "list":
            return self.tables[0]
        if self.where == "namespace":
            return self.state.table
        return GLOBAL_TABLE

    def forward(self, x):
        return torch.stack(self.branches(x)).sum(0) * (1 + self.held().sum()) + self.held() * 2

    def change(self, call):
        if call % 4 == 1 and self.where == "attribute":
            self.table = torch.full((D,), 0.25 * call)  # replaced
        elif self.where != "global":
            self.held().add_(0.5)  # updated in place


@pytest.mark.parametrize("where", ["attribute", "list", "namespace", "global"])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_computation_on_a_held_tensor_changed_between_calls_is_made_anew(executor, where, monkeypatch):
    # Changes this frequent are churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    global GLOBAL_TABLE
    torch.manual_seed(0)
    model = ComputesWithHeldTensors(where)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    try:
        for call in range(12):
            if call % 2:
                if where == "global":
                    GLOBAL_TABLE.add_(0.5)
                reference.change(call)
                model.change(call)
            x = torch.randn(4, D)
            expected = reference(x)
            actual = sm(x)
            paths.append(assert_path(sm, "recorded", "plan"))
            assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
    finally:
        GLOBAL_TABLE = torch.zeros(D)
    assert "plan:" + executor in paths, paths


class KeepsAViewOfAWeight(Towers):
    """Three identical towers (their first linears fused, the weights stacked); the
    forward computes with a view of the first tower's weight the module keeps."""

    def __init__(self):
        super().__init__()
        self.rows = self.towers[0][0].weight.detach()[:2]

    def forward(self, x):
        return torch.stack(self.branches(x)).sum(0) + self.rows.sum()


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_kept_view_of_a_fused_weight_follows_the_optimizer(executor, monkeypatch):
    # Changes this frequent are churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    # The view's storage was the weight's; stacking moved the weight into the stack, and
    # the optimizer's steps no longer showed in the view (nor, in the baked constant).
    torch.manual_seed(0)
    model = KeepsAViewOfAWeight()
    torch.manual_seed(0)
    reference = KeepsAViewOfAWeight()
    sm = ss.StreamScheduledModule(model, executor=executor)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    paths = []
    for call in range(6):
        x = torch.randn(4, D)
        expected = reference(x)
        actual = sm(x)
        paths.append(assert_path(sm, "recorded", "plan"))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        for out, opt in zip((expected, actual), optimizers):
            out.square().sum().backward()
            opt.step()
            opt.zero_grad()
    assert "wide linear" in sm.plan.summary()  # the towers' first linears are still one kernel
