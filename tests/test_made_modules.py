"""Modules a forward makes as it runs (transformers' ``loss_fct = CrossEntropyLoss()``
in every head that takes labels): one without parameters or buffers is traced through
and the model is planned; one holding tensors is refused, and the model runs as written.
Every call is compared with eager on fresh inputs, its path asserted."""

from __future__ import annotations

import copy
import functools
import threading
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.frontend import made_modules
from streamsched.testing import assert_path
from tests.helpers import assert_close, grads


class LossHeads(nn.Module):
    """Two classifier heads whose losses are computed by loss modules built in the
    forward, as transformers' heads do (ignore_index from the call's labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))
        self.b = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
        la, lb = self.a(x), self.b(x)
        loss_fct = nn.CrossEntropyLoss(ignore_index=-100)
        loss = loss_fct(la, labels) + nn.MSELoss(reduction="sum")(lb, la.detach())
        return loss, nn.Dropout(0.0)(la), nn.Flatten()(lb[:, None])


class WeightedLoss(nn.Module):
    """A loss module given a tensor it holds as a buffer: built from an attribute the
    caller changes between calls, it must not be baked into a trace."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)
        self.class_weight = torch.ones(5)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
        logits = self.lin(x)
        return nn.CrossEntropyLoss(weight=self.class_weight)(logits, labels), logits


def _labels(n: int) -> torch.Tensor:
    labels = torch.randint(0, 5, (n,))
    labels[torch.randint(0, n, (2,))] = -100
    return labels


def _call(sm, model, reference, train: bool, make_labels=_labels) -> None:
    model.train(train)
    reference.train(train)
    x, labels = torch.randn(7, 6), make_labels(7)
    for p in [*model.parameters(), *reference.parameters()]:
        p.grad = None
    with torch.set_grad_enabled(train):
        expected = reference(x, labels)
        actual = sm(x, labels)
    assert_close(actual, expected)
    if train:
        actual[0].backward()
        expected[0].backward()
        got, want = grads(model), grads(reference)
        assert got.keys() == want.keys() and want
        for name in want:
            assert_close(got[name], want[name], what=f"grad {name}")


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_loss_modules_built_in_the_forward_are_traced_through(executor):
    torch.manual_seed(0)
    model = LossHeads()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for train in (False, False, True, True, True, False, False):
        with warnings.catch_warnings():
            warnings.simplefilter("error", ss.UntraceableWarning)
            _call(sm, model, reference, train)
    assert_path(sm, "plan")
    # The heads were fused, and the loss modules' operations are the plan's.
    nodes = [n for task in sm.plan.tasks for n in task.nodes]
    assert any(task.fused_group is not None for task in sm.plan.tasks), sm.plan.tasks
    assert "cross_entropy" in nodes and "mse_loss" in nodes, nodes


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_loss_module_holding_a_tensor_is_refused(executor):
    torch.manual_seed(0)
    model = WeightedLoss()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.UntraceableWarning)
        for call in range(6):
            weight = torch.rand(5) + 0.5
            model.class_weight, reference.class_weight = weight, weight.clone()
            _call(sm, model, reference, train=call >= 3, make_labels=lambda n: torch.randint(0, 5, (n,)))
            assert_path(sm, "eager-dispatch")


class LinearThenAct(nn.Module):
    """A Linear, then an activation that is no submodule of the model, found where each
    subclass's ``activation`` says."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 5)

    def activation(self) -> nn.Module:
        raise NotImplementedError

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> tuple:
        y = self.activation()(self.lin(x))
        return y.square().sum(), y


class HeldInAList(LinearThenAct):
    """Activations held in a plain list (not submodules): the same objects every call,
    whose attributes the caller changes."""

    def __init__(self) -> None:
        super().__init__()
        self.acts = [nn.LeakyReLU(0.01)]

    def activation(self) -> nn.Module:
        return self.acts[0]


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_module_held_in_a_plain_list_is_refused(executor):
    torch.manual_seed(0)
    model = HeldInAList()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.UntraceableWarning)
        for call in range(6):
            slope = 0.01 + 0.2 * call
            model.acts[0].negative_slope = reference.acts[0].negative_slope = slope
            _call(sm, model, reference, train=call >= 3)
            assert_path(sm, "eager-dispatch")


# Modules the forward reaches outside the model's submodules, other than in a traced
# module's attributes: the same object every call. Each is refused by where it was made
# (not during the trace), whatever holds it.
ACT = nn.LeakyReLU(0.01)


class GlobalAct(LinearThenAct):
    def activation(self) -> nn.Module:
        return ACT


def _closure_model() -> tuple[nn.Module, nn.LeakyReLU]:
    act = nn.LeakyReLU(0.01)

    class ClosureAct(LinearThenAct):
        def activation(self) -> nn.Module:
            return act

    return ClosureAct(), act


class ClassAct(LinearThenAct):
    act = nn.LeakyReLU(0.01)

    def activation(self) -> nn.Module:
        return self.act


class _Config:
    def __init__(self) -> None:
        self.act = nn.LeakyReLU(0.01)


class HeldObjectAct(LinearThenAct):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = _Config()

    def activation(self) -> nn.Module:
        return self.cfg.act


def _reached_outside() -> dict:
    """Each model with the one activation object it and its reference share (a global,
    a closure cell and a class attribute are shared by a deep copy)."""
    closure, act = _closure_model()
    held = HeldObjectAct()
    return {
        "global": (GlobalAct(), lambda reference: (ACT, ACT)),
        "closure": (closure, lambda reference: (act, act)),
        "class attribute": (ClassAct(), lambda reference: (ClassAct.act, ClassAct.act)),
        "held object": (held, lambda reference: (held.cfg.act, reference.cfg.act)),
    }


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("where", ["global", "closure", "class attribute", "held object"])
def test_a_module_reached_outside_the_model_is_refused(executor, where):
    torch.manual_seed(0)
    model, acts = _reached_outside()[where]
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ss.UntraceableWarning)
            for call in range(6):
                for act in acts(reference):
                    act.negative_slope = 0.01 + 0.2 * call
                _call(sm, model, reference, train=call >= 3)
                assert_path(sm, "eager-dispatch", "as-written")
        messages = [str(w.message) for w in caught if issubclass(w.category, ss.UntraceableWarning)]
        assert any("outside the model's submodules" in m for m in messages), messages
    finally:
        ACT.negative_slope = ClassAct.act.negative_slope = 0.01


@functools.cache
def _cached_act() -> nn.LeakyReLU:
    return nn.LeakyReLU(0.01)


class CachedAct(LinearThenAct):
    """An activation from a cached factory: constructed on the first call, the same
    object on every later one."""

    def activation(self) -> nn.Module:
        return _cached_act()


_FILLED: dict = {}


class FilledGlobalAct(LinearThenAct):
    """An activation put in a global on the first call."""

    def activation(self) -> nn.Module:
        act = _FILLED.get("act")
        if act is None:
            act = _FILLED["act"] = nn.LeakyReLU(0.01)
        return act


class StoredOnTheModel(LinearThenAct):
    """An activation the first call builds and keeps in a plain list of the model."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list = []

    def activation(self) -> nn.Module:
        if not self.kept:
            self.kept.append(nn.LeakyReLU(0.01))
        return self.kept[0]


# Each model kind with the activations its wrapped model and its reference use (one
# shared object where a global holds it), and why the trace is refused.
_KEPT = {
    CachedAct: (lambda model, reference: [_cached_act()], "kept after the call"),
    # (A global dict filled by the forward is also a write the trace refuses.)
    FilledGlobalAct: (lambda model, reference: [_FILLED["act"]], "ObjectWrittenDuringTrace"),
    StoredOnTheModel: (lambda model, reference: [*model.kept, *reference.kept], "kept after the call"),
}


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("kind", list(_KEPT))
def test_a_module_constructed_while_traced_but_kept_is_refused(executor, kind):
    """The trace is the first call to construct the activation, which is then kept: a
    trace through it would bake its slope, which the calls after change."""
    _cached_act.cache_clear()
    _FILLED.clear()
    torch.manual_seed(0)
    model = kind()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ss.UntraceableWarning)
        for call in range(6):
            if call:
                for act in _KEPT[kind][0](model, reference):
                    act.negative_slope = 0.01 + 0.2 * call
            train = call >= 3
            model.train(train)
            reference.train(train)
            x, labels = torch.randn(7, 6), _labels(7)
            with torch.set_grad_enabled(train):
                actual = sm(x, labels)  # first: the wrapper's trace constructs the activation
                expected = reference(x, labels)
            assert_close(actual, expected)
            assert_path(sm, "eager-dispatch", "as-written")
    messages = [str(w.message) for w in caught if issubclass(w.category, ss.UntraceableWarning)]
    assert any(_KEPT[kind][1] in m for m in messages), messages


def test_recording_counts_only_the_recording_threads_constructions():
    """Modules constructed on another thread while a trace records are not the trace's."""
    original = nn.Module.__init__
    other: list = []
    with made_modules.recording() as made:
        mine = nn.ReLU()
        with made_modules.recording() as inner:
            nested = nn.Tanh()
        t = threading.Thread(target=lambda: other.append(nn.ReLU()))
        t.start()
        t.join()
    assert made.get(id(mine)) is mine and made.get(id(nested)) is nested
    assert list(inner.values()) == [nested]
    assert id(other[0]) not in made
    assert nn.Module.__init__ is original
