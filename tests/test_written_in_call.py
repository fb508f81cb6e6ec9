"""Code run inside a call (a submodule's hook, a ``@streamsched.branch`` function, an
opaque module) that assigns a plain attribute the forward reads: ``self.count += 1`` in
a hook, read by the forward after the hooked module ran. The trace bakes in the value
the attribute held when traced; eager reads the value assigned during the call. A traced
call reads it stale, so once such an assignment is seen (around the recording call and
every call of a plan whose graph runs such code) the model runs as written, with one
``UntraceableWarning`` naming the attribute. The call in which it is first seen read the
value from before it (for code that assigns on every call: the recording call); every
call after it equals eager."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.errors import UntraceableWarning
from streamsched.testing import last_path

from .helpers import assert_close

EXECUTORS = ["serial", "auto"]


class CountingHook(nn.Module):
    """A hook on ``a`` counts its calls; the forward scales ``b`` by the count."""

    def __init__(self, every: int = 1) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.count = 0
        self.calls = 0
        self.every = every  # the hook assigns on every ``every``-th call of ``a`` only
        self.a.register_forward_hook(self._bump)

    def _bump(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        self.calls += 1
        if self.calls % self.every == 0:
            self.count += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h) * self.count + self.c(h)


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The model and an eager copy of it whose hook bumps the copy's own count."""
    eager = copy.deepcopy(model)
    eager.a._forward_hooks.clear()
    eager.a.register_forward_hook(eager._bump)
    return model, eager


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("grad", [True, False])
def test_an_attribute_a_hook_assigns_every_call_stops_the_schedule_after_one_call(executor, grad):
    torch.manual_seed(0)
    model, eager = _pair(CountingHook())
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    with torch.set_grad_enabled(grad), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            x = torch.randn(3, 4)
            out, want = sm(x), eager(x)
            path = last_path(sm)
            paths.append(path)
            if path != "recorded":  # (the call in which the assignment is seen)
                assert_close(out, want)
    assert model.count == eager.count == 8
    # The recording call sees the assignment; every call after it runs as written.
    assert paths == ["recorded"] + ["as-written"] * 7, paths
    said = [w for w in caught if issubclass(w.category, UntraceableWarning)]
    assert len(said) == 1 and "CountingHook.count" in str(said[0].message)
    assert "CountingHook.count" in sm.plan.reason


def test_an_assignment_on_a_later_call_stops_the_plan_from_the_next_call():
    """The hook assigns on every fifth call only: the trace's first call sees nothing, the
    plan runs; the call in which the hook assigns is seen, and the calls after it run as
    written. (That call itself read the value from before it: see the module docstring.)"""
    torch.manual_seed(0)
    model, eager = _pair(CountingHook(every=5))
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntraceableWarning)
        for i in range(12):
            x = torch.randn(3, 4)
            out, want = sm(x), eager(x)
            paths.append(last_path(sm))
            if i != 4:
                assert_close(out, want)
    assert paths[0] == "recorded" and paths[1:5] == ["plan:serial"] * 4, paths
    assert paths[5:] == ["as-written"] * 7, paths
    assert "CountingHook.count" in sm.plan.reason


def test_a_hook_that_assigns_nothing_keeps_the_plan():
    """A hook that assigns nothing (the calls of its plan are watched all the same)."""
    torch.manual_seed(0)
    model = CountingHook()
    model.a._forward_hooks.clear()
    model.a.register_forward_hook(lambda m, i, o: None)
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    for _ in range(4):
        x = torch.randn(3, 4)
        assert_close(sm(x), eager(x))
        paths.append(last_path(sm))
    assert paths == ["recorded", "plan:serial", "plan:serial", "plan:serial"], paths


class BranchCounts(nn.Module):
    """A ``@streamsched.branch`` function assigns the attribute the forward reads next."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.scale = 1

    @ss.branch
    def first(self, x: torch.Tensor) -> torch.Tensor:
        self.scale += 1
        return self.a(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.b(x) * self.scale


def test_a_branch_assigning_what_the_forward_reads_runs_as_written():
    torch.manual_seed(0)
    model = BranchCounts()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with pytest.warns(UntraceableWarning, match="BranchCounts.scale"):
        for i in range(6):
            x = torch.randn(3, 4)
            out, want = sm(x), eager(x)
            assert last_path(sm) == ("recorded" if i == 0 else "as-written")
            if i:
                assert_close(out, want)
    assert model.scale == eager.scale == 7


def test_invalidate_traces_again():
    """``sm.invalidate()`` lifts the refusal: the trace is made again, and its first call
    sees the hook still assigning (once the hook is gone, the plan runs)."""
    torch.manual_seed(0)
    model, eager = _pair(CountingHook())
    sm = ss.StreamScheduledModule(model, executor="serial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntraceableWarning)
        for _ in range(3):
            x = torch.randn(3, 4)
            sm(x), eager(x)
        assert sm._ss.state_written is not None and last_path(sm) == "as-written"
        model.a._forward_hooks.clear()
        eager.a._forward_hooks.clear()
        sm.invalidate()
        assert sm._ss.state_written is None
        paths = []
        for _ in range(4):
            x = torch.randn(3, 4)
            assert_close(sm(x), eager(x))
            paths.append(last_path(sm))
    assert paths[-1] == "plan:serial", paths


class AssignsWhileTraced(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # ASSIGNS-HERE
        return self.a(x)


def test_a_forward_assigning_an_attribute_is_named_at_its_own_line():
    """The refusal of a forward that assigns ``self.calls`` while traced names the user's
    forward and line, not the library's ``__setattr__`` it was refused from."""
    import inspect

    model = AssignsWhileTraced()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with pytest.warns(UntraceableWarning) as caught:
        x = torch.randn(3, 4)
        assert_close(sm(x), eager(x))
    text = "\n".join(str(w.message) for w in caught if issubclass(w.category, UntraceableWarning))
    source, first = inspect.getsourcelines(AssignsWhileTraced.forward)
    line = first + next(i for i, s in enumerate(source) if "ASSIGNS-HERE" in s)
    assert f"{__file__}:{line}" in text, text
    assert "AssignsWhileTraced.forward" in text and "_generation" not in text, text
