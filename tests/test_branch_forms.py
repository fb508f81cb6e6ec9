"""The forms ``@streamsched.branch`` is written in: a staticmethod (the decorator above or
below ``@staticmethod``) and a ``functools.partial`` are traced as branch tasks and
compute as eager; a classmethod and a module *instance* are refused with a message
that says what to write instead (a wrapper function stored on a model is no submodule:
its parameters would leave ``model.parameters()``)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import streamsched as ss

from .helpers import assert_close, called_on


def _scale(x, k):
    return x * k


class StaticInner(nn.Module):
    """``@ss.branch`` above ``@staticmethod``: the branch must stay a staticmethod."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    @ss.branch
    @staticmethod
    def twice(x):
        return x * 2 if x.sum() > -1e9 else x  # control flow: fine in a branch

    def forward(self, x):
        return self.twice(self.a(x)) + self.b(x)


class StaticOuter(StaticInner):
    @staticmethod
    @ss.branch
    def twice(x):
        return x * 2 if x.sum() > -1e9 else x


class Partial(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.scaled = ss.branch(functools.partial(_scale, k=3.0))

    def forward(self, x):
        return self.scaled(self.a(x)) + self.b(x)


@pytest.mark.parametrize("model_type", [StaticInner, StaticOuter, Partial])
def test_staticmethod_and_partial_branches_are_traced_tasks_equal_to_eager(model_type):
    torch.manual_seed(0)
    model = model_type()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for path in ("recorded", "plan:serial", "plan:serial"):
        x = torch.randn(3, 4)
        assert_close(called_on(sm, path, x), model(x))
    name = "_scale" if model_type is Partial else "twice"
    assert any(name in task.name for task in sm.plan.tasks), [t.name for t in sm.plan.tasks]
    assert not sm.plan.opaque  # a branch, not a failed trace run as one opaque call


def test_a_classmethod_is_refused_saying_what_to_write():
    def build(cls, x):
        return x

    with pytest.raises(TypeError, match=r"classmethod .*build.*make it a method or a @staticmethod"):
        ss.branch(classmethod(build))


def test_a_module_instance_is_refused_naming_the_class_and_leaf_modules():
    with pytest.raises(TypeError, match=r"not an instance \(got a Linear\).*leaf_modules=\(Linear,\)"):
        ss.branch(nn.Linear(2, 2))
