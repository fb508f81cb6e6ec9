"""A model wrapped a second time (a notebook cell run again, a training function that
wraps the model it is given): the first wrapper moved each fused group's members into
slices of one stacked tensor. The second one re-stacks them where the first was dropped,
and reads the first's stack where it is alive and groups the same members in the same
order; either way it aliases (no stack built per call), and outputs, gradients (``None``
where eager has none), optimizer steps and ``load_state_dict`` through either wrapper
equal eager PyTorch.
"""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.optim import member_parameters
from streamsched.passes.fusion.params import StackedTensors
from streamsched.passes.fusion.stacked import StackedParameter
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_fused_grads import (
    USED,
    D,
    Heads,
    WideHeads,
    assert_grads_as_eager,
    assert_params_as_eager,
    fused_members,
    loss_of,
)

MODELS = {"heads": Heads, "wide_heads": WideHeads}


def stacks(sm: ss.StreamScheduledModule) -> list[StackedTensors]:
    return list(sm.__dict__["_ss"].fusion._stacks.values())


def assert_aliased(sm: ss.StreamScheduledModule) -> None:
    """Every fused group reads one stack its members are slices of (alias mode)."""
    found = stacks(sm)
    assert found and fused_members(sm)
    for s in found:
        assert s.alias and s.live, f"{s.owners[0][1]}: stacked per call (copy mode)"
        storage = s.stack.untyped_storage().data_ptr()
        assert all(t.untyped_storage().data_ptr() == storage for t in s.tensors)


class CountStacks:
    """How many times torch.stack / torch.cat ran (a group in copy mode runs one per call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls = 0
        for name in ("stack", "cat"):
            real = getattr(torch, name)

            def counted(*args, _real=real, **kwargs):
                self.calls += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(torch, name, counted)


def steady_stacks(sm: ss.StreamScheduledModule, x: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> int:
    sm(x)
    with monkeypatch.context() as mp:
        counter = CountStacks(mp)
        sm(x)
        with torch.no_grad():
            sm(x)
    return counter.calls


def train(pairs, model: nn.Module, ref: nn.Module, opt, opt_ref, what: str, steps=USED, first_step: int = 0) -> None:
    """One step per entry of ``steps``, each through the next wrapper of ``pairs`` in turn."""
    for step, used in enumerate(steps):
        sm = pairs[step % len(pairs)]
        opt.zero_grad()
        opt_ref.zero_grad()
        x = torch.randn(5, D)
        out, expected = sm(x), ref(x)
        assert_close(out, expected, what=f"{what} step {step}: outputs")
        if step >= first_step:
            assert_path(sm, "plan")
        loss, loss_ref = loss_of(out, used), loss_of(expected, used)
        if loss_ref is not None:
            loss_ref.backward()
            loss.backward()
        assert_grads_as_eager(model, ref, f"{what} step {step} (outputs {used})")
        opt.step()
        opt_ref.step()
        assert_params_as_eager(model, ref, f"{what} step {step}")


def sgd(m: nn.Module):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrapped_again_after_the_first_was_dropped_aliases(name, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    first = ss.StreamScheduledModule(model, executor="serial")
    first(torch.randn(5, D))
    assert_aliased(first)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(5, D))
    assert_path(sm, "recorded")
    assert_aliased(sm)
    assert steady_stacks(sm, torch.randn(5, D), monkeypatch) == 0
    train([sm], model, ref, sgd(model), sgd(ref), f"{name}, wrapped again, the first dropped")
    assert_aliased(sm)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_wrapped_again_with_the_first_kept_shares_its_stacks(name, monkeypatch):
    torch.manual_seed(0)
    model = MODELS[name]()
    ref = copy.deepcopy(model)
    first = ss.StreamScheduledModule(model, executor="serial")
    first(torch.randn(5, D))
    second = ss.StreamScheduledModule(model, executor="serial")
    second(torch.randn(5, D))
    for sm in (first, second):
        assert_aliased(sm)
        assert steady_stacks(sm, torch.randn(5, D), monkeypatch) == 0
    shared = {id(s.stack) for s in stacks(first)}
    assert {id(s.stack) for s in stacks(second)} == shared  # one storage, read by both

    # Training through both in turn, one optimizer over the model's parameters.
    opt, opt_ref = sgd(model), sgd(ref)
    train([first, second], model, ref, opt, opt_ref, f"{name}, both wrappers in turn")
    rebuilds = [s.rebuilds for s in stacks(first) + stacks(second)]

    # load_state_dict through either one writes into the shared stack.
    for sm in (second, first):
        state = {k: 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
        sm.load_state_dict(state)
        ref.load_state_dict(state)
        x = torch.randn(5, D)
        for other in (first, second):
            assert_close(other(x), ref(x), what=f"{name}: after load_state_dict through one wrapper")
    assert [s.rebuilds for s in stacks(first) + stacks(second)] == rebuilds  # nothing re-stacked

    # A member given new storage: whichever wrapper runs first re-stacks, the other reads
    # that stack (no re-stacking in turn on every call).
    member = stacks(first)[0].tensors[1]
    member.data = member.data.clone()
    x = torch.randn(5, D)
    assert_close(second(x), ref(x), what="after p.data = ...")
    assert_close(first(x), ref(x), what="after p.data = ...")
    for sm in (first, second):
        assert_aliased(sm)
    assert {id(s.stack) for s in stacks(first)} == {id(s.stack) for s in stacks(second)}
    rebuilds = [s.rebuilds for s in stacks(first) + stacks(second)]
    for sm in (first, second, first, second):
        sm(torch.randn(5, D))
    assert [s.rebuilds for s in stacks(first) + stacks(second)] == rebuilds
    train([second, first], model, ref, opt, opt_ref, f"{name}, after a member was re-stacked")


def test_wrapped_again_with_the_first_kept_fused_parameters():
    """fused_parameters() through both wrappers of one model hands out one stacked
    parameter per shared stack (two would each claim the members' .grad), and training
    through either with an optimizer over it equals eager's over the members; leaving
    fused_parameters() in one wrapper keeps it for the other."""
    torch.manual_seed(0)
    model = Heads()
    ref = copy.deepcopy(model)
    first = ss.StreamScheduledModule(model, executor="serial")
    first(torch.randn(5, D))
    second = ss.StreamScheduledModule(model, executor="serial")
    second(torch.randn(5, D))
    params = first.fused_parameters()
    assert {id(p) for p in second.fused_parameters()} == {id(p) for p in params}
    opt = torch.optim.SGD(params, lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    stacked = [p for p in params if isinstance(p, StackedParameter)]
    assert stacked
    for step in range(6):
        sm = (first, second)[step % 2]
        if step == 3:
            # Per-member gradients again in the first: the second still reads the stacked
            # parameter, which stays active for the optimizer holding it.
            member_parameters(first)
            assert all(p.active for p in stacked)
        if step == 4:
            # A member given new storage: re-stacked by the wrapper called next, read by both.
            member = stacked[0].members[1]
            member.data = member.data.clone()
        opt.zero_grad()
        opt_ref.zero_grad()
        x = torch.randn(5, D)
        out, expected = sm(x), ref(x)
        assert_path(sm, "plan")
        assert_close(out, expected, what=f"step {step}: outputs")
        loss_of(out, (0, 1, 2, 3)).backward()
        loss_of(expected, (0, 1, 2, 3)).backward()
        for (n, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"step {step}: {n}.grad")
        opt.step()
        opt_ref.step()
        assert_params_as_eager(model, ref, f"step {step}")
    assert {id(s.stack) for s in stacks(first)} == {id(s.stack) for s in stacks(second)}
    assert all(p.data_ptr() == p.members[0].data_ptr() for p in stacked)
    member_parameters(second)
    assert not any(p.active for p in stacked)


def test_wrapped_again_one_wrapper_under_functional_call_while_the_other_restacks():
    """The second wrapper's stack is set aside while torch.func.functional_call has tensors
    swapped into the members; the first re-stacks meanwhile (a member given new storage).
    Back in place, the second reads the first's new stack rather than stacking anew (after
    which the first would re-stack again, and each in turn on every call)."""
    torch.manual_seed(0)
    model = Heads()
    ref = copy.deepcopy(model)
    first = ss.StreamScheduledModule(model, executor="serial")
    first(torch.randn(5, D))
    second = ss.StreamScheduledModule(model, executor="serial")
    second(torch.randn(5, D))
    x = torch.randn(5, D)
    given = {k: v.detach() * 0.5 for k, v in model.named_parameters()}
    assert_close(torch.func.functional_call(second, given, (x,)), torch.func.functional_call(ref, given, (x,)))
    assert not all(s.live for s in stacks(second))
    member = stacks(first)[0].tensors[1]
    member.data = member.data.clone()
    assert_close(first(x), ref(x), what="the first, re-stacked")
    assert_close(second(x), ref(x), what="the second, its members back")
    for sm in (first, second):
        assert_aliased(sm)
    assert {id(s.stack) for s in stacks(first)} == {id(s.stack) for s in stacks(second)}
    rebuilds = [s.rebuilds for s in stacks(first) + stacks(second)]
    for sm in (first, second, first, second):
        sm(torch.randn(5, D))
    assert [s.rebuilds for s in stacks(first) + stacks(second)] == rebuilds
    train([first, second], model, ref, sgd(model), sgd(ref), "after functional_call")
