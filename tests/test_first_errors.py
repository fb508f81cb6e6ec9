"""The mistakes a new user makes first get an error that names the problem and says what
to do, and the right call right after works.

Wrapping something that is not a module instance (the class itself, a function, a
string), a TorchScript module (``torch.jit.script``/``torch.jit.trace``; compiled
modules are in ``test_wrap_compiled.py``), a misspelt choice of an option (other option
mistakes: ``test_config_errors.py``), and a ``forward`` written as a generator.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import Towers, assert_close


def _fn(x):
    return x


@pytest.mark.parametrize(
    "thing, expected",
    [
        (Towers, "got the class Towers itself: create the model first, StreamScheduledModule(Towers(...))"),
        (_fn, "got the function _fn: put the code in the forward of an nn.Module"),
        ("resnet18", "got str 'resnet18': pass the model itself (an nn.Module instance)"),
    ],
    ids=["class", "function", "string"],
)
def test_something_other_than_a_module_instance_is_refused_saying_what_to_pass(thing, expected):
    with pytest.raises(TypeError) as info:
        ss.StreamScheduledModule(thing)
    assert expected in str(info.value), str(info.value)
    model = Towers()
    sm = ss.StreamScheduledModule(model, executor="serial")  # what the message says to pass
    x = torch.randn(4, 64)
    sm(x)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


class _Pair(nn.Module):
    """Two branches TorchScript can script."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 8)
        self.b = nn.Linear(64, 8)

    def forward(self, x):
        return self.a(x) + self.b(x)


@pytest.mark.parametrize("how", ["script", "trace"])
def test_a_torchscript_module_is_refused_and_its_python_model_wraps(how):
    model = _Pair()
    x = torch.randn(4, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's own deprecation notice
        scripted = torch.jit.script(model) if how == "script" else torch.jit.trace(model, x)
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(scripted)
    text = str(info.value)
    assert "cannot wrap a TorchScript module (_Pair" in text, text
    assert "Wrap the Python model itself" in text and "torch.jit.script(tower)" in text, text
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(x)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_scripted_branches_run_as_tasks_of_the_plan():
    """What the TorchScript refusal advises: script the branches, wrap the model."""
    model = Towers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for i, tower in enumerate(model.towers):
            model.towers[i] = torch.jit.script(tower)
    sm = ss.StreamScheduledModule(model, executor="serial", fuse=False)
    for _ in range(2):
        x = torch.randn(4, 64)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    names = [t.name for t in sm.plan.tasks]
    assert any(name.startswith("towers.0") for name in names), names


@pytest.mark.parametrize(
    "option, value, hint",
    [
        ("executor", "thread", "(did you mean 'threads'?)"),
        ("executor", "Serial", "(did you mean 'serial'?)"),
        ("fuse_params", "alais", "(did you mean 'alias'?)"),
        ("executor", "gpu", None),
    ],
)
def test_a_misspelt_choice_names_the_closest_one(option, value, hint):
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(Towers(), **{option: value})
    text = str(info.value)
    assert f"invalid streamsched configuration for Towers: {option}={value!r}: should be " in text, text
    if hint is None:
        assert "did you mean" not in text, text
    else:
        assert text.endswith(hint), text


class _Yields(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):  # the generator function the message must point at
        for _ in range(2):
            yield self.a(x)


def test_a_generator_forward_is_named_as_one():
    model = _Yields()
    x = torch.randn(2, 4)
    line = _Yields.forward.__code__.co_firstlineno
    with pytest.raises(ss.TraceError) as info:
        ss.StreamScheduledModule(model, strict=True)(x)
    text = str(info.value)
    assert "cannot trace _Yields.forward (the root module)" in text, text
    assert f"its forward is a generator function, at {__file__}:{line}" in text, text
    assert "return a list or tuple instead" in text, text
    # By default the forward runs as written, once warned, and returns what eager returns.
    sm = ss.StreamScheduledModule(model)
    with pytest.warns(ss.UntraceableWarning, match="generator function"):
        out = sm(x)
    assert_close(list(out), list(model(x)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_close(list(sm(x)), list(model(x)))


@pytest.mark.parametrize(
    "config, expected",
    [
        (4, "pass options as keywords, StreamScheduledModule(model, num_streams=4)"),
        ({"executor": "serial"}, "StreamScheduledModule(model, SchedulerConfig(executor='serial'))"),
    ],
    ids=["a-number", "a-dict"],
)
def test_options_passed_where_the_config_goes_say_how_to_pass_them(config, expected):
    model = Towers()
    with pytest.raises(ss.ConfigError) as info:
        ss.StreamScheduledModule(model, config)
    assert "config must be a streamsched.SchedulerConfig" in str(info.value) and expected in str(info.value)
    sm = ss.StreamScheduledModule(model, executor="serial")  # as the message says
    x = torch.randn(4, 64)
    sm(x)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


class _ScriptedChild(nn.Module):
    """A forward fx cannot trace (a check on the values) around a TorchScript child and a
    Python one."""

    def __init__(self):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.scripted = torch.jit.script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.python = nn.Sequential(nn.Linear(4, 4), nn.ReLU())

    def forward(self, x):
        if x.abs().max() > 1e9:
            raise ValueError("input out of range")
        return self.scripted(x) + self.python(x)


def test_a_torchscript_child_of_a_forward_run_as_written_runs_as_written():
    model = _ScriptedChild()
    sm = ss.StreamScheduledModule(model, executor="serial", strict=False)
    for _ in range(4):
        x = torch.randn(2, 4)
        assert_close(sm(x), model(x))
    assert sm.plan.mode == "eager-dispatch"
    assert list(sm.nested_plans) == ["python"]  # the Python child is planned; the scripted one is not touched


class _ValueBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:  # control flow on a value, in the model's own forward
            return self.a(x)
        return self.b(x)


class _ValueBranchFixed(_ValueBranch):
    """The same model, the check moved into a @streamsched.branch method, as the message says."""

    @ss.branch
    def pick(self, x, a, b):
        return a if x.sum() > 0 else b

    def forward(self, x):
        return self.pick(x, self.a(x), self.b(x))


def test_the_fix_for_the_models_own_forward_is_to_move_the_code_into_a_branch():
    model = _ValueBranch()
    with pytest.raises(ss.TraceError) as info:
        ss.StreamScheduledModule(model, strict=True)(torch.randn(2, 4))
    text = str(info.value)
    assert "cannot trace _ValueBranch.forward (the root module)" in text, text
    assert "How to fix: move the code that does this into a function or method decorated with" in text, text
    assert "leaf_modules" not in text, text  # the root as a leaf would leave nothing to schedule
    fixed = _ValueBranchFixed()
    fixed.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(fixed, strict=True, executor="serial")
    for x in (torch.randn(2, 4).abs(), -torch.randn(2, 4).abs(), torch.randn(2, 4)):
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")  # traced: the rest of the forward is scheduled
