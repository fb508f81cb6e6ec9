"""A module given a ``forward`` of its own instance (``model.forward = f``: accelerate's
hooks, test doubles, a patched method): eager's ``model(x)`` calls it, where a trace of
the model reads its class's ``forward``. The wrapper must compute what eager computes
on every call, whether the attribute was set before wrapping, after a plan formed, after
the calls settled to run as written, or while state churns; and plan again once it is
deleted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


class Branches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Block(), Block()
        self.c = nn.Linear(8, 8)
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.tau + self.b(x) + self.c(x)


def _patch(module: nn.Module) -> None:
    original = module.forward
    module.forward = lambda x: original(x) * 0.5 + 3.0


def _check(sm: ss.StreamScheduledModule, model: nn.Module, x: torch.Tensor) -> str:
    out = sm(x)
    torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    return last_path(sm)


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_root_forward_of_its_own_set_before_wrapping(executor):
    torch.manual_seed(0)
    model = Branches().eval()
    _patch(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    x = torch.randn(4, 8)
    with torch.no_grad():
        paths = {_check(sm, model, x) for _ in range(6)}
        assert paths == {"as-written"}
        assert "instance attribute 'forward'" in sm.plan.reason
        del model.forward  # the class's forward again: planned
        paths = [_check(sm, model, x) for _ in range(8)]
    assert paths[-1].startswith("plan") or executor == "auto"


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_root_forward_of_its_own_set_after_a_plan(executor):
    torch.manual_seed(1)
    model = Branches().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(8):
            _check(sm, model, x)
        # (auto may decide this small model runs faster as written)
        assert last_path(sm).startswith("plan") or executor == "auto"
        _patch(model)
        assert [_check(sm, model, x) for _ in range(3)] == ["as-written"] * 3


def test_root_forward_of_its_own_set_after_the_calls_settled():
    # A new size every call in inference: the calls settle to run as written, through
    # the wrapper's shortest path.
    torch.manual_seed(2)
    model = Branches().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        for n in range(1, 40):
            _check(sm, model, torch.randn(n, 8))
        _patch(model)
        for n in range(40, 44):
            assert _check(sm, model, torch.randn(n, 8)) == "as-written"


def test_root_forward_of_its_own_set_while_state_churns():
    # tau assigned on every call: the calls run as written for a window (Runner.retrace).
    torch.manual_seed(3)
    model = Branches()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, 8)
    for step in range(30):
        model.tau = 1.0 + step
        _check(sm, model, x)
    assert "call after call" in sm.plan.reason
    _patch(model)
    for step in range(30, 34):
        model.tau = 1.0 + step
        assert _check(sm, model, x) == "as-written"


@pytest.mark.parametrize("executor", ["auto", "serial"])
@pytest.mark.parametrize("where", ["a", "a.lin", "c"])
def test_a_submodule_given_a_forward_of_its_own_after_a_plan(executor, where):
    torch.manual_seed(4)
    model = Branches().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(8):
            _check(sm, model, x)
        assert last_path(sm).startswith("plan") or executor == "auto"
        _patch(model.get_submodule(where))
        paths = [_check(sm, model, x) for _ in range(8)]
        del model.get_submodule(where).forward
        paths += [_check(sm, model, x) for _ in range(8)]
    assert paths[-1].startswith("plan") or executor == "auto"
