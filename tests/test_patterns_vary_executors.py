"""Calls that vary, under an executor asked for by name: state the traces read changed on
every step (``model.tau = f(step)``, a kept view of a fused weight an optimizer trains, a
global), and a plain argument new on every call (a temperature, a dropout ``p``). Each
change is a new trace and recording call: under ``executor="serial"``, ``"threads"`` or
``"streams"`` every call was traced and recorded anew, 30-100x slower than eager, where
``executor="auto"`` ran the model as written (a churn window, a value met once). Those
rules hold under every executor (``Runner.may_vary``); ``sm.plan`` says that the calls
ran as written although an executor was asked for. Every call equals eager (outputs,
input and parameter gradients), its path is asserted, and the traces over 200 calls are
counted."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import streamsched as ss
from streamsched import new_signatures, runner
from streamsched.testing import assert_path

from .helpers import assert_close, step_alongside
from .test_patterns_state import D, Towers

MIX = 1.0

EXECUTORS = ["serial", "threads", pytest.param("streams", marks=pytest.mark.cuda), "auto"]
PATTERNS = ["tau", "kept view", "global", "temperature", "dropout p"]


class Varying(Towers):
    """Three towers (fused into one stacked group), summed and scaled by what ``pattern``
    changes on every step."""

    def __init__(self, pattern):
        super().__init__()
        self.pattern = pattern
        self.tau = 1.0

    def keep_view(self):
        self.rows = self.towers[0][0].weight.detach()[:2]

    def forward(self, x, temperature=1.0, p=0.0):
        y = torch.stack(self.branches(x)).sum(0)
        if self.pattern == "tau":
            y = y * self.tau
        elif self.pattern == "kept view":
            y = y * self.rows.sum()
        elif self.pattern == "global":
            y = y * MIX
        return torch.nn.functional.dropout(y / temperature, p, training=False) + p


def _device(executor):
    return "cuda" if executor == "streams" else "cpu"


def run_varying(pattern, executor, calls, monkeypatch):
    """Call a ``Varying`` model eagerly and wrapped ``calls`` times on fresh inputs, what
    ``pattern`` names changed on every call and an SGD step after each; compare outputs and
    gradients every call. Returns (paths, traces made, the wrapper)."""
    global MIX
    traces = []
    trace_model = new_signatures.trace_model

    def counting(*args, **kwargs):
        traces.append(1)
        return trace_model(*args, **kwargs)

    monkeypatch.setattr(new_signatures, "trace_model", counting)
    device = _device(executor)
    torch.manual_seed(0)
    model = Varying(pattern).to(device)
    reference = copy.deepcopy(model)
    model.keep_view()
    reference.keep_view()
    sm = ss.StreamScheduledModule(model, executor=executor)
    # (SGD's default step: a foreach step for CUDA parameters, which moves the version
    # counter the kept view's guard reads on the emulated device as on CUDA.)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (reference, model)]
    paths = []
    try:
        for call in range(calls):
            value = 1.0 / (2 + call)
            kwargs = {}
            if pattern == "tau":
                model.tau = reference.tau = value
            elif pattern == "global":
                MIX = value
            elif pattern == "temperature":
                kwargs["temperature"] = 0.5 + value
            elif pattern == "dropout p":
                kwargs["p"] = value
            x = torch.randn(4, D, device=device)
            what = f"{pattern}, {executor}, call {call}"
            paths.append(
                step_alongside(reference, sm, model, x, optimizers, ("recorded", "plan", "as-written"), what, **kwargs)
            )
    finally:
        MIX = 1.0
    return paths, len(traces), sm


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_calls_that_vary_run_as_written_under_every_executor(pattern, executor, monkeypatch):
    paths, traces, sm = run_varying(pattern, executor, 200, monkeypatch)
    if pattern in ("temperature", "dropout p"):
        # The first value is traced and recorded; every later one is new to the call
        # structure and runs as written, untraced.
        assert traces == 1, (traces, paths)
        assert paths[0] == "recorded" and paths[1:] == ["as-written"] * 199, paths
        reason = sm.plan.reason
        assert "has not met" in reason, reason
    else:
        # Three re-traces begin a window of 64 calls as written; the churn going on at its
        # end doubles it (128), and the next end's trace doubles it again: a recording call
        # per window, not per call (five in 200 calls; each flag assigned traces twice: once
        # to see whether the program changed, once for the new plan).
        recorded = paths.count("recorded")
        assert recorded <= runner.CHURN_RETRACES + 2, paths
        assert traces <= 2 * recorded, (traces, paths)
        assert paths.count("as-written") >= 195, paths
        reason = sm.plan.reason
        assert "call after call" in reason, reason
    if executor != "auto":
        # The executor asked for did not run these calls: sm.plan says so, and why.
        assert f"executor={executor!r} was asked for" in reason, reason


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_planning_resumes_under_the_executor_once_the_state_holds_still(executor, monkeypatch):
    monkeypatch.setattr(runner, "CHURN_FIRST_WINDOW", 8)
    global MIX
    torch.manual_seed(0)
    model = Varying("tau")
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(50):
        if call < 20:
            model.tau = 1.0 / (2 + call)
        x = torch.randn(4, D)
        expected = Varying.forward(model, x)
        assert_close(sm(x), expected, what=f"call {call}")
        paths.append(assert_path(sm, "recorded", "plan", "as-written"))
    assert "as-written" in paths[:20], paths
    # The state holds still: the window's end traces it once, and the executor asked for
    # runs every call after that.
    assert paths[20:].count("recorded") == 1, paths
    assert paths[-10:] == ["plan:" + executor] * 10, paths
    assert sm.plan.executor == executor, sm.plan.reason


def test_a_value_that_comes_back_is_planned_on_the_executor_asked_for():
    torch.manual_seed(0)
    model = Varying("temperature")
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    for call in range(12):
        temperature = (0.5, 1.0, 2.0)[call % 3]
        x = torch.randn(4, D)
        expected = Varying.forward(model, x, temperature=temperature)
        assert_close(sm(x, temperature=temperature), expected, what=f"call {call}")
        paths.append(assert_path(sm, "recorded", "plan", "as-written"))
    assert paths[1:3] == ["as-written"] * 2, paths  # met once: as written
    assert paths.count("recorded") == 3, paths  # each value planned when it comes back
    assert paths[-3:] == ["plan:serial"] * 3, paths


@pytest.mark.parametrize("option", [{"sync_log": True}, {"chaos": 3}])
def test_sync_log_and_chaos_run_the_schedule_on_every_call(option):
    # They exist to check the schedule: a call as written would check nothing (and leave
    # the previous call's sync log in place), so the churn does not run as written there.
    torch.manual_seed(0)
    model = Varying("tau")
    sm = ss.StreamScheduledModule(model, executor="threads", **option)
    paths = []
    for call in range(12):
        model.tau = 1.0 / (2 + call)
        x = torch.randn(4, D)
        expected = Varying.forward(model, x)
        assert_close(sm(x), expected, what=f"call {call}")
        paths.append(assert_path(sm, "recorded", "plan", "as-written"))
    assert paths == ["recorded"] * 12, paths


class _Untraceable(torch.nn.Module):
    """Branches behind control flow on a tensor (untraceable: eager dispatch), with a plain
    argument passed the same value on every call."""

    def __init__(self):
        super().__init__()
        self.towers = Towers()

    def forward(self, x, steps=2):
        for _ in range(steps):
            if x.sum() > -1e9:  # control flow on a tensor: the forward cannot be traced
                x = x + torch.stack(self.towers.branches(x)).sum(0)
        return x


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_plain_argument_with_the_value_of_the_first_call_is_not_new(executor):
    """A call structure that makes no plan (an untraceable forward runs under eager
    dispatch) met its plain arguments' values on its first call: the second call with the
    same values is not one of a new value (which runs as written once, nested children
    unscheduled), but eager dispatch again."""
    model = _Untraceable()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for i in range(4):
        x = torch.randn(4, D)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the untraceable forward's warning)
            assert_close(sm(x, steps=2), model(x, steps=2), what=f"call {i}")
        assert_path(sm, "eager-dispatch")
