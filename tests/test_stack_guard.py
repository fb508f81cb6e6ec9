"""A compiled plan checks all the stacks its fused kernels read in one pass before each
call (``StackSetGuard``), and calls the serial program's one function directly when
nothing else is to be decided. Every change a per-stack check saw must still be seen:
a member given new storage, a member re-assigned (a new Parameter object, then that one
given new storage), a re-stack made by another plan's call, an in-place update, a hook,
a mode switch, an observer; with the native guard and with its pure-Python fallback.
Each step compares with the plain model on fresh random inputs and asserts the plan ran.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble
from streamsched._native import native
from streamsched.observe.nvtx_ranges import range_name
from streamsched.passes.fusion import params
from streamsched.testing import assert_path

from .helpers import assert_close

MODES = ["native", "python"] if native() is not None else ["python"]


@pytest.fixture(params=MODES)
def guard_mode(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(params, "native", lambda: None)
    return request.param


def wrapped():
    torch.manual_seed(0)
    model = CriticEnsemble(5, obs=6, hidden=7).eval()
    return model, ss.StreamScheduledModule(model, executor="serial")


def same(sm, model, batch=4, what="", planned=True):
    x = torch.randn(batch, 6)
    assert_close(sm(x), model(x), what=what)
    if planned:
        assert_path(sm, "plan:serial")


def warm(sm, model, batch=4):
    for _ in range(3):
        same(sm, model, batch, planned=False)
    same(sm, model, batch)


@torch.no_grad()
def test_new_storage_reassignment_and_in_place_updates_are_seen(guard_mode):
    model, sm = wrapped()
    warm(sm, model)
    guard = sm._ss.last.program.stack_guard
    assert (guard._guard is not None) == (guard_mode == "native")
    for layer in (0, 2, 4):
        lin = model.critics[1].net[layer]
        lin.weight.mul_(1.5)  # in place: the stack is the storage
        same(sm, model, what=f"in-place update, layer {layer}")
        lin.weight.data = lin.weight.data + 1.0  # new storage
        same(sm, model, what=f"new storage, layer {layer}")
        lin.weight = nn.Parameter(torch.randn_like(lin.weight))  # another Parameter object
        same(sm, model, what=f"re-assigned, layer {layer}")
        # The new Parameter is a member now: new storage for it must be seen too (a
        # guard still watching the replaced Parameter would miss it).
        lin.weight.data = torch.randn_like(lin.weight)
        same(sm, model, what=f"re-assigned, then new storage, layer {layer}")
        lin.bias.data = lin.bias.data - 2.0
        same(sm, model, what=f"bias new storage, layer {layer}")
        # Every member re-assigned: the re-stack leaves none of the watched tensors moved
        # (they are not members any more), so only the re-stack itself tells the guard.
        for critic in model.critics:
            critic.net[layer].weight = nn.Parameter(torch.randn_like(critic.net[layer].weight))
        same(sm, model, what=f"every member re-assigned, layer {layer}")
        lin.weight.data = torch.randn_like(lin.weight)
        same(sm, model, what=f"every member re-assigned, then new storage, layer {layer}")


@torch.no_grad()
def test_a_re_stack_made_by_another_plans_call_is_seen(guard_mode):
    """Two input signatures, two programs over the same stacks: a member changed and
    re-stacked through one program's call is seen by the other's."""
    model, sm = wrapped()
    warm(sm, model, batch=4)
    warm(sm, model, batch=9)
    programs = {id(p.program) for p in sm._ss.plans.values()}
    assert len(programs) == 2, "one program per signature"
    lin = model.critics[3].net[2]
    lin.weight.data = lin.weight.data * -1.0
    same(sm, model, batch=9, what="re-stacked through the batch-9 plan")
    same(sm, model, batch=4, what="the batch-4 plan after it")
    lin.weight = nn.Parameter(torch.randn_like(lin.weight))
    same(sm, model, batch=9, what="re-assigned, seen by the batch-9 plan")
    lin.weight.data = torch.randn_like(lin.weight)
    same(sm, model, batch=4, what="then new storage, seen by the batch-4 plan")
    same(sm, model, batch=9, what="and by the batch-9 plan")


def test_hooks_modes_and_observers_still_leave_the_direct_call():
    model, sm = wrapped()
    x = torch.randn(4, 6)
    with torch.no_grad():
        warm(sm, model)
        assert sm._ss.last.direct is not None, "the serial plan is not called directly"
        # A forward hook on a member: the call runs with hooks (not the plan).
        seen = []
        handle = model.critics[0].net[0].register_forward_hook(lambda m, i, o: seen.append(1))
        assert_close(sm(x), model(x))
        assert seen, "the hook did not fire"
        handle.remove()
        same(sm, model, what="after the hook was removed", planned=False)
        same(sm, model, what="after the hook was removed")
    # A mode switch: another plan key; the model's own result under train().
    sm.train()
    with torch.no_grad():
        warm(sm, model)
    sm.eval()

    class Counter:
        pushed = 0

        def push(self, task, stream):
            Counter.pushed += 1

        def pop(self, task, stream):
            pass

    with torch.no_grad(), sm.observing(Counter()):
        same(sm, model, what="observed")
    assert Counter.pushed > 0, "the observer saw no task: the direct call skipped it"


def test_a_running_profiler_still_gets_the_task_ranges(monkeypatch):
    """NVTX ranges are on by default and seen by a running torch profiler: while it
    records, the call leaves the direct path and brackets every task."""
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    model, sm = wrapped()
    with torch.no_grad():
        warm(sm, model)
        if not sm._ss.nvtx:
            pytest.skip("NVTX ranges are off here (no nvtx package)")
        assert sm._ss.last.direct is not None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            same(sm, model, what="profiled")
    names = {event.name for event in prof.events()}
    expected = {range_name(t.name, t.stream) for t in sm.plan.tasks}
    assert expected <= names, expected - names


@pytest.mark.parametrize("how", ["data", "parameter"])
@torch.no_grad()
def test_a_member_given_another_shape_re_plans(guard_mode, how):
    """One critic's hidden layer widened after planning (``p.data = ...`` of another
    shape, or a Parameter of another shape): the kernels' shapes are the plan's, and
    re-stacking the members raised torch.stack's size error. The model is planned again
    with the new shapes, as eager runs it."""
    model, sm = wrapped()
    warm(sm, model)
    first, second = model.critics[2].net[0], model.critics[2].net[2]
    if how == "data":
        first.weight.data = torch.randn(11, 6)
        first.bias.data = torch.randn(11)
        second.weight.data = torch.randn(7, 11)
    else:
        first.weight = nn.Parameter(torch.randn(11, 6))
        first.bias = nn.Parameter(torch.randn(11))
        second.weight = nn.Parameter(torch.randn(7, 11))
    x = torch.randn(4, 6)
    assert_close(sm(x), model(x), what="the call after the change")
    assert_path(sm, "recorded")
    for _ in range(2):
        same(sm, model, what="planned again")
