"""Plain arguments whose values change from call to call (a float temperature, a dropout
``p``, an ``eps``): each value is its own traced call structure, and a value new on every
call was traced and recorded node by node on every call, many times the model's own
cost. Under the default executor such a value runs the model as written the first time
it is met (as a size is) and is planned when it comes back. Every call equals eager."""

from __future__ import annotations

import copy

import pytest
import torch

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_patterns_state import D, Towers


class Tempered(Towers):
    def forward(self, x, temperature=1.0, p=0.0):
        y = torch.stack(self.branches(x)).sum(0) / temperature
        return torch.nn.functional.dropout(y, p, training=False) + p


def _run(values, training=True):
    torch.manual_seed(0)
    model = Tempered()
    reference = copy.deepcopy(model).train(training)
    sm = ss.StreamScheduledModule(model).train(training)
    paths = []
    for call, (temperature, p) in enumerate(values):
        x = torch.randn(4, D)
        x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x_ref, temperature=temperature, p=p)
        actual = sm(x_new, temperature=temperature, p=p)
        paths.append(assert_path(sm, "recorded", "plan", "as-written"))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        expected.square().sum().backward()
        actual.square().sum().backward()
        assert_close(x_new.grad, x_ref.grad, what=f"input grad, call {call} ({paths[-1]})")
        for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
            assert_close(p_new.grad, p_ref.grad, what=f"grad {name}, call {call}")
            p_ref.grad = p_new.grad = None
    return sm, paths


@pytest.mark.parametrize("which", ["temperature", "p"])
def test_a_plain_argument_new_on_every_call_runs_as_written_not_recorded(which):
    values = [(0.5 + call / 8, 0.0) if which == "temperature" else (1.0, call / 50) for call in range(22)]
    sm, paths = _run(values)
    # The first value is traced; every later one is new and runs as written.
    assert paths[0] == "recorded" and paths[1:] == ["as-written"] * 21, paths
    assert "has not met" in sm.plan.summary()


def test_a_plain_argument_cycling_through_values_is_planned_when_they_come_back():
    values = [(t, 0.0) for _ in range(8) for t in (0.5, 1.0, 2.0)]
    _, paths = _run(values, training=False)
    assert paths[1:3] == ["as-written"] * 2, paths  # met once: as written
    assert paths.count("recorded") <= 3, paths  # traced once per value at most
    assert all(p != "recorded" for p in paths[6:]), paths


class Typed(Towers):
    """What ``t`` does depends on its type, not only on what it equals: ``1``, ``1.0`` and
    ``True`` are equal in Python (so are ``0.0`` and ``-0.0``), and a trace made with one
    bakes in what it does."""

    def forward(self, x, t=1):
        y = torch.stack(self.branches(x)).sum(0)
        if t is True:
            return y * 100
        if isinstance(t, float) and t == 0.0:
            return y / t  # inf for 0.0, -inf for -0.0
        return (y > 0).long() * t  # an integer tensor for 1, a float one for 1.0


@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_equal_plain_values_of_other_types_or_signs_are_other_values(executor):
    # Each value three times in a row (planned by its third call under every executor),
    # then the next: a plan of one must not run for another that equals it.
    torch.manual_seed(0)
    model = Typed().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    with torch.no_grad():
        for t in (1, 1.0, True, 0.0, -0.0, 1, True):
            for call in range(3):
                x = torch.randn(4, D)
                expected, actual = model(x, t), sm(x, t)
                path = assert_path(sm, "recorded", "plan", "as-written")
                what = f"t={t!r} call {call} ({path})"
                assert_close(actual, expected, what=what)  # (the dtypes too)
        assert path.startswith("plan") or executor == "auto", path
