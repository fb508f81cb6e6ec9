"""A forward that registers a buffer, a parameter or a submodule on a module of the model
(``register_buffer``, ``register_parameter``, ``add_module``: they store into the module's
tables without its ``__setattr__``). Traced, the registration happened once, storing a
graph value (an fx Proxy) into the module; the module doing it runs as written instead,
and every call leaves what eager leaves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_patterns_state import D, Towers


class Keeps(nn.Module):
    """Registers what it computed, as a statistic, the way ``how`` says."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.linear = nn.Linear(D, D)

    def forward(self, x):
        y = self.linear(x)
        if self.how == "buffer":
            self.register_buffer("last", y.detach().clone(), persistent=False)
        elif self.how == "parameter":
            self.register_parameter("last", nn.Parameter(y.detach().mean(0)))
        else:
            self.add_module("last", nn.Identity())
        return y


class RootKeeps(Towers):
    def __init__(self, how):
        super().__init__()
        self.keeps = Keeps(how)

    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0)
        self.register_buffer("total", y.detach().sum(0).clone(), persistent=False)
        return y + self.keeps(x)


class BranchKeeps(Towers):
    def __init__(self, how):
        super().__init__()
        self.keeps = Keeps(how)

    def forward(self, x):
        return torch.stack(self.branches(x) + [self.keeps(x)]).sum(0)


def _registered(model):
    out = {}
    for path, m in model.named_modules():
        for name in ("last", "total"):
            value = m._buffers.get(name, m._parameters.get(name, m._modules.get(name)))
            if value is not None:
                out[f"{path}.{name}"] = value
    return out


@pytest.mark.parametrize("how", ["buffer", "parameter", "module"])
@pytest.mark.parametrize("where", ["root", "branch"])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_forward_registering_on_a_module_registers_on_every_call(executor, where, how):
    torch.manual_seed(0)
    model = (RootKeeps if where == "root" else BranchKeeps)(how)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(12):
        x = torch.randn(4, D)
        expected = reference(x)
        actual = sm(x)
        paths.append(assert_path(sm, "recorded", "plan", "as-written", "eager-dispatch"))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        got, want = _registered(model), _registered(reference)
        assert sorted(got) == sorted(want), (call, paths[-1], sorted(got), sorted(want))
        for name, value in want.items():
            assert type(got[name]) is type(value), f"call {call} ({paths[-1]}): {name} is a {type(got[name]).__name__}"
            if isinstance(value, torch.Tensor):
                assert_close(got[name], value, what=f"{name}, call {call} ({paths[-1]})")
    if where == "root":
        assert paths[1:] == ["eager-dispatch"] * 11, paths  # its own forward, registering as eager
