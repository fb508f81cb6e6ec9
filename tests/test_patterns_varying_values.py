"""Plain numbers passed on every call with a new value (a sampler's timestep counting down,
a temperature drawn at random, a float keyword, a tuple of scales), or cycling through a
few values (noise levels). A value new to its call structure runs the model as written
(new_signatures), and later calls of the same layout with values not met take the
settled shortcut (a varying layout, settled_calls.py) instead of binding and keying each
call; a value met before comes back to the full path and is planned, each value with a
trace of its own: the trace bakes the value in (a factor of a tensor op, or the branch
it selects), and a plan must never run for another value.

Every call is compared with eager on fresh inputs (outputs, and in training the input's
and every parameter's gradient), its path is asserted, and the calls that took the full
path are counted."""

from __future__ import annotations

import copy

import pytest
import torch

import streamsched as ss
from streamsched import new_signatures, runner
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_patterns_state import D, Towers

EXECUTORS = ["serial", "threads", pytest.param("streams", marks=pytest.mark.cuda), "auto"]


class Scaled(Towers):
    """Three towers summed, scaled by a plain number read into a tensor op (``* t``), and
    by a tuple of scales where one is passed."""

    def forward(self, x, t=1.0, scales=None):
        y = torch.stack(self.branches(x)).sum(0) * t
        if scales is not None:
            y = y * scales[0] + scales[1]
        return y


class Gated(Towers):
    """A plain number that only selects which tower's output is used (control flow)."""

    def forward(self, x, t=1.0):
        a, b, c = self.branches(x)
        return (a if t > 0.5 else b) + c


# (model, call i -> (args, kwargs)): a value new on every call.
NEW_EVERY_CALL = {
    "float": (Scaled, lambda i: ((0.5 + i / 7,), {})),
    "int timestep counting down": (Scaled, lambda i: ((1000 - i,), {})),
    "float keyword": (Scaled, lambda i: ((), {"t": 0.5 + i / 7})),
    "tuple of floats": (Scaled, lambda i: ((), {"scales": (1.0 + i / 9, i / 11)})),
    "float selecting a branch": (Gated, lambda i: ((0.3 + 0.4 * (i % 2) + i / 1000,), {})),
}


def _device(executor):
    return "cuda" if executor == "streams" else "cpu"


def _counting_full_path(monkeypatch):
    """Count the calls that reach the full path's handling of a signature with no plan
    (``new_signature``), and the traces made."""
    entries, traces = [], []
    new_signature, trace_model = runner.new_signature, new_signatures.trace_model

    def entering(*args, **kwargs):
        entries.append(1)
        return new_signature(*args, **kwargs)

    def tracing(*args, **kwargs):
        traces.append(1)
        return trace_model(*args, **kwargs)

    monkeypatch.setattr(runner, "new_signature", entering)
    monkeypatch.setattr(new_signatures, "trace_model", tracing)
    return entries, traces


def run_calls(make, executor, values, training, expected_paths):
    """Call ``make()`` eagerly and wrapped with ``values(i)`` on fresh inputs; compare the
    outputs (and, in training, the gradients) on every call. Returns (paths, wrapper)."""
    device = _device(executor)
    torch.manual_seed(0)
    model = make().to(device).train(training)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for i, (args, kwargs) in enumerate(values):
        x = torch.randn(4, D, device=device)
        x_ref, x_new = x.clone().requires_grad_(training), x.clone().requires_grad_(training)
        with torch.set_grad_enabled(training):
            expected = reference(x_ref, *args, **kwargs)
            actual = sm(x_new, *args, **kwargs)
        path = assert_path(sm, *expected_paths)
        paths.append(path)
        what = f"call {i} {args} {kwargs} ({path})"
        assert_close(actual, expected, what=what)
        if training:
            expected.square().sum().backward()
            actual.square().sum().backward()
            assert_close(x_new.grad, x_ref.grad, what=f"input grad, {what}")
            for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
                assert_close(p_new.grad, p_ref.grad, what=f"grad {name}, {what}")
                p_ref.grad = p_new.grad = None
    return paths, sm


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("pattern", list(NEW_EVERY_CALL))
def test_a_value_new_on_every_call_runs_as_written_through_the_settled_shortcut(
    pattern, executor, training, monkeypatch
):
    make, value = NEW_EVERY_CALL[pattern]
    entries, traces = _counting_full_path(monkeypatch)
    paths, sm = run_calls(make, executor, [value(i) for i in range(40)], training, ("recorded", "plan", "as-written"))
    # The first value is traced and recorded (in inference under auto: run as written, as
    # any call structure's first call); every later one is new and runs as written.
    assert paths[0] in ("recorded", "as-written") and paths[1:] == ["as-written"] * 39, paths
    assert len(traces) <= 1, (traces, paths)
    # The first call and the second (the first of a new value, which settles the varying
    # layout) take the full path; the other 38 the settled shortcut.
    assert len(entries) == 2, (entries, paths)
    assert sm._ss.settled is not None and sm._ss.settled.varying
    reason = sm.plan.reason
    assert "has not met" in reason, reason
    if executor != "auto":
        assert f"executor={executor!r} was asked for" in reason, reason


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("make", [Scaled, Gated], ids=["tensor op", "control flow"])
def test_values_cycling_are_planned_when_they_come_back_each_with_its_own_trace(make, executor, monkeypatch):
    # 0.25 and 0.75 select different branches of Gated; every value scales Scaled.
    levels = (0.25, 0.75, 2.0, 3.0)
    entries, traces = _counting_full_path(monkeypatch)
    values = [((levels[i % 4],), {}) for i in range(24)]
    paths, _ = run_calls(make, executor, values, False, ("recorded", "plan", "as-written"))
    plan = f"plan:{executor}"
    # The first level is recorded; the next three are new (as written: the second settles
    # the varying layout, which notes the third and fourth); the first comes back to the
    # shortcut, which had not met it (the full path had); the others come back through
    # the shortcut's table and are planned at once; then each level runs its own plan.
    assert paths[:5] == ["recorded"] + ["as-written"] * 4, paths
    assert paths[5:8] == ["recorded"] * 3, paths
    assert paths[8:] == [plan] * 16, paths
    assert len(traces) == 4, (traces, paths)
    # The varying layout's check sends the planned levels on to their plans.
    assert len(entries) == 5, (entries, paths)


@pytest.mark.parametrize("make", [Scaled, Gated], ids=["tensor op", "control flow"])
def test_values_cycling_under_auto_each_run_their_own_plan_or_as_written(make):
    levels = (0.25, 0.75, 2.0, 3.0)
    values = [((levels[i % 4],), {}) for i in range(40)]
    for training in (False, True):
        paths, _ = run_calls(make, "auto", values, training, ("recorded", "plan", "as-written"))
        assert paths.count("recorded") <= 4, paths
        assert "recorded" not in paths[12:], paths


def test_a_cycle_longer_than_the_values_remembered_is_never_planned(monkeypatch):
    # A sampler's timesteps come back run after run, more of them than the wrapper keeps
    # plans for (plan_cache_size): each is forgotten before it comes back, by the
    # shortcut's table as by the full path's, and runs as written, never traced.
    entries, traces = _counting_full_path(monkeypatch)
    steps = ss.SchedulerConfig().plan_cache_size + 4
    values = [((steps - i % steps,), {}) for i in range(3 * steps)]
    paths, _ = run_calls(Scaled, "serial", values, False, ("recorded", "plan", "as-written"))
    assert paths[0] == "recorded" and paths[1:] == ["as-written"] * (len(values) - 1), paths
    assert len(traces) == 1 and len(entries) == 2, (traces, entries)


def test_what_the_varying_layout_does_not_admit_takes_the_full_path(monkeypatch):
    # Another rank, number type, keyword or grad mode than the layout was settled with:
    # the full path, which plans the call or runs it as written, equal to eager.
    entries, _ = _counting_full_path(monkeypatch)
    torch.manual_seed(0)
    model = Scaled().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    calls = [
        ((torch.randn(2, 4, D), 0.3), {}, False),
        ((torch.randn(4, D), 3), {}, False),
        ((torch.randn(4, D), 0.3), {"scales": (1.0, 2.0)}, False),
        ((torch.randn(4, D), 0.3), {}, True),
    ]
    with torch.no_grad():
        for i in range(4):
            x = torch.randn(4, D)
            assert_close(sm(x, 0.5 + i / 7), model(x, 0.5 + i / 7))
        assert len(entries) == 2
    for n, (args, kwargs, grad) in enumerate(calls):
        before = len(entries)
        with torch.set_grad_enabled(grad):
            assert_close(sm(*args, **kwargs), model(*args, **kwargs), what=f"call {n}")
        assert_path(sm, "recorded", "plan", "as-written")
        assert len(entries) == before + 1, (n, entries)
