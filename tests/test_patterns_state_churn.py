"""State the traces read that changes on call after call: a temperature annealed on the
root or a submodule (``model.tau = f(step)``), the same on a namespace or a dataclass the
model holds and on a global, a held tensor replaced or updated, a kept view of a fused
weight under an optimizer step per call. Each change re-traces; a re-trace on every call
made the wrapper 20-40x slower than eager. Such calls settle to run the model as written
for a window of calls (``Runner.retrace``), and are traced and planned again once the
state holds still. Every call equals eager, outputs and gradients."""

from __future__ import annotations

import copy
import dataclasses
import types

import pytest
import torch

import streamsched as ss
from streamsched import runner

from .helpers import assert_close, step_alongside
from .test_patterns_state import PATHS, D, Towers

MIX = 1.0


@dataclasses.dataclass
class Config:
    tau: float = 1.0


class Annealed(Towers):
    """Three towers scaled by a value the forward reads from ``where``."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.tau = 1.0
        self.towers[1].tau = 1.0
        self.ns = types.SimpleNamespace(tau=1.0)
        self.cfg = Config()
        self.table = torch.ones(D)
        self.tables = [torch.ones(D)]
        self.rows = self.towers[0][0].weight.detach()[:2]

    def scale(self):
        where = self.where
        if where == "root":
            return self.tau
        if where == "submodule":
            return self.towers[1].tau
        if where == "namespace":
            return self.ns.tau
        if where == "dataclass":
            return self.cfg.tau
        if where == "global":
            return MIX
        if where == "tensor":
            return self.table.sum()
        if where == "tensor list":
            return self.tables[0].sum()
        return self.rows.sum()  # "kept view"

    def forward(self, x):
        return torch.stack(self.branches(x)).sum(0) * self.scale()

    def change(self, step):
        value = 1.0 / (2 + step)
        where = self.where
        if where == "root":
            self.tau = value
        elif where == "submodule":
            self.towers[1].tau = value
        elif where == "namespace":
            self.ns.tau = value
        elif where == "dataclass":
            self.cfg.tau = value
        elif where == "tensor":
            self.table = torch.full((D,), value)
        elif where == "tensor list":
            self.tables[0].add_(value)


WHERE = ["root", "submodule", "namespace", "dataclass", "global", "tensor", "tensor list", "kept view"]


def run_churn(where, calls, changing, monkeypatch=None):
    """Call an ``Annealed`` model eagerly and wrapped (``executor="auto"``) ``calls`` times
    on fresh inputs, the state changed before each call while ``changing(call)``, an SGD
    step after each; compare outputs, input and parameter gradients on every call. Returns
    the paths and the wrapper."""
    global MIX
    torch.manual_seed(0)
    model = Annealed(where)
    reference = copy.deepcopy(model)
    reference.rows = reference.towers[0][0].weight.detach()[:2]
    sm = ss.StreamScheduledModule(model)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (reference, model)]
    paths = []
    try:
        for call in range(calls):
            if changing(call):
                if where == "global":
                    MIX = 1.0 / (2 + call)
                reference.change(call)
                model.change(call)
            x = torch.randn(4, D)
            paths.append(step_alongside(reference, sm, model, x, optimizers, (*PATHS, "plan"), f"call {call}"))
    finally:
        MIX = 1.0
    return paths, sm


@pytest.mark.parametrize("where", WHERE)
def test_state_changed_on_every_call_settles_to_run_as_written(where):
    paths, sm = run_churn(where, 40, lambda call: True)
    # Before: a trace and a recording call on every call. Now: three re-traces in a row,
    # then the model as written, untraced, for the window.
    assert paths.count("recorded") <= runner.CHURN_RETRACES + 1, paths
    assert paths[-30:] == ["as-written"] * 30, paths
    assert "call after call" in sm.plan.reason, sm.plan.reason


def test_the_window_grows_while_the_churn_goes_on_and_planning_resumes_when_it_stops(monkeypatch):
    monkeypatch.setattr(runner, "CHURN_FIRST_WINDOW", 8)
    stop = 60
    paths, sm = run_churn("root", stop + 40, lambda call: call < stop)
    # Windows of 8, 16 and 32 calls, one trace after each that finds the churn going on.
    churning = paths[:stop]
    assert churning.count("recorded") <= runner.CHURN_RETRACES + 3, churning
    assert churning.count("as-written") >= 8 + 16 + 24, churning
    # Once the state holds still, the window's end traces and plans it again, once, and
    # the calls after it are the plan's (or its trial's verdict), not the churn's.
    after = paths[stop:]
    assert after.count("recorded") == 1, after
    assert "call after call" not in sm.plan.reason, sm.plan.reason


def test_hooks_on_the_model_fire_while_it_runs_as_written_for_the_churn():
    torch.manual_seed(0)
    model = Annealed("root")
    sm = ss.StreamScheduledModule(model)
    seen = []
    for call in range(12):
        if call == 8:
            model.register_forward_hook(lambda m, a, out: seen.append(out.shape))
        model.change(call)
        x = torch.randn(4, D)
        expected = type(model).forward(model, x)
        assert_close(sm(x), expected, what=f"call {call}")
    assert len(seen) == 4, seen  # calls 8 to 11, run as written for the churn


@pytest.mark.parametrize("where", ["kept view", "tensor list"])
def test_calls_across_the_windows_ends_equal_eager(monkeypatch, where):
    # An optimizer step on the weight a kept view shows (or a held list's tensor updated)
    # churns on: each window's end traces and stacks the fused weights anew, and the
    # next call drops them again, the optimizer's steps in between.
    monkeypatch.setattr(runner, "CHURN_FIRST_WINDOW", 4)
    monkeypatch.setattr(runner, "CHURN_MAX_WINDOW", 8)
    paths, sm = run_churn(where, 60, lambda call: True)
    assert 5 <= paths.count("recorded") <= 12, paths
    assert "call after call" in sm.plan.reason, sm.plan.reason
