"""Views of stacked parameters kept between calls (``StackedTensors.view_of``): the fused
Linear kernels keep their transposed weight and unsqueezed bias while no gradient is routed
through the stack. Each test compares the compiled plan (asserted) with the model as written
on fresh inputs after something that changes the parameters: an in-place update must show
through the kept views, a re-stack must replace them, and frozen members' weights (the
views kept under ``no_grad``) must still give eager's gradients."""

from __future__ import annotations

import copy

import torch

import streamsched as ss
from benchmarks.zoo import CriticEnsemble
from streamsched.testing import assert_path

from .helpers import assert_close


def _wrapped(n: int = 6) -> tuple[CriticEnsemble, ss.StreamScheduledModule]:
    torch.manual_seed(0)
    model = CriticEnsemble(n, obs=7, hidden=8).eval()
    return model, ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")


def _check(model: torch.nn.Module, sm: ss.StreamScheduledModule, dtype: torch.dtype = torch.float32) -> None:
    x = torch.randn(5, 7, dtype=dtype)
    out = sm(x)
    assert_path(sm, "plan:serial")
    assert_close(out, model(x))


def _fused_stacks(sm: ss.StreamScheduledModule) -> list:
    return list(sm._ss.last.program.stacks)


def test_in_place_updates_show_through_kept_views():
    model, sm = _wrapped()
    with torch.no_grad():
        for _ in range(3):
            sm(torch.randn(5, 7))
        assert any(s._views for s in _fused_stacks(sm)), "no view was kept: the test would prove nothing"
        state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
        model.load_state_dict(state)
        sm.module.load_state_dict(state)
        _check(model, sm)
        for p, q in zip(model.parameters(), sm.module.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
        _check(model, sm)


def test_restacked_members_replace_kept_views():
    model, sm = _wrapped()
    with torch.no_grad():
        for _ in range(3):
            sm(torch.randn(5, 7))
        old = [s.stack for s in _fused_stacks(sm)]
        # New storage for every member (as .to() gives): the stacks are rebuilt.
        model.double()
        sm.module.double()
        sm(torch.randn(5, 7, dtype=torch.float64))  # a new signature: recorded and planned
        _check(model, sm, torch.float64)
        assert all(s.stack is not o for s, o in zip(_fused_stacks(sm), old))
        # A member given a new tensor by assignment: its group is re-stacked. (The first
        # member: without the native runtime the check looks at the first and last only.)
        w = torch.randn_like(model.critics[0].net[2].weight)
        model.critics[0].net[2].weight.data = w.clone()
        sm.module.critics[0].net[2].weight.data = w.clone()
        _check(model, sm, torch.float64)


def test_frozen_members_views_kept_under_no_grad_give_eager_gradients():
    model, sm = _wrapped()
    for m in (model, sm.module):
        m.requires_grad_(False)
    with torch.inference_mode():
        for _ in range(3):
            sm(torch.randn(5, 7))  # views first taken under inference mode
    # The stack written in place outside inference mode (a view made under inference
    # mode would refuse to be used by autograd after this).
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    sm.module.load_state_dict(state)
    x = torch.randn(5, 7)
    for _ in range(2):
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        out = sm(xa)
        assert_path(sm, "plan:serial", "recorded")
        ref = model(xb)
        assert_close(out, ref)
        out.square().sum().backward()
        ref.square().sum().backward()
        assert_close(xa.grad, xb.grad)
    assert_path(sm, "plan:serial")
