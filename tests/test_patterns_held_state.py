"""Python state reached in ways a guard on a module's public lists and dicts does not see:
containers nested in containers (``self.cfg["bias"][0]``), tuples holding tensors
(``self.pairs = [(w, b)]``), sets of tensors, ``OrderedDict``s and named tuples,
``_``-prefixed attributes and class attributes, and
attributes read by ``getattr`` with a name the code computes. Each is changed between
calls without assigning anything a module sees; every call equals eager."""

from __future__ import annotations

import collections
import functools
import types

import pytest
import torch

from streamsched import runner

from .test_patterns_state import D, Towers, run_against_eager


def _stacked(model, x):
    return torch.stack(model.branches(x)).sum(0)


class Holder:
    """A plain object a module holds (its assignments are watched; its lists' are not)."""


class NestedTensor(Towers):
    def __init__(self):
        super().__init__()
        self.cfg = {"bias": [torch.zeros(D)], "scale": 1.0}

    def forward(self, x):
        return _stacked(self, x) * self.cfg["scale"] + self.cfg["bias"][0]

    def change(self, call):
        self.cfg["bias"][0] = torch.full((D,), float(call))


class PairsOfTensors(Towers):
    def __init__(self):
        super().__init__()
        self.pairs = [(torch.ones(D), torch.zeros(D))]

    def forward(self, x):
        w, b = self.pairs[0]
        return _stacked(self, x) * w + b

    def change(self, call):
        self.pairs[0] = (torch.full((D,), 0.5), torch.full((D,), float(call)))


class TupleOfTensors(Towers):
    def __init__(self):
        super().__init__()
        self.pair = (torch.ones(D), torch.zeros(D))

    def forward(self, x):
        return _stacked(self, x) * self.pair[0] + self.pair[1]

    def change(self, call):
        self.pair = (torch.full((D,), 0.5), torch.full((D,), float(call)))


class NestedNumbers(Towers):
    def __init__(self):
        super().__init__()
        self.grid = [[1.0, 1.0], [3.0]]
        self.cfg = {"head": {"scale": 1.0}}

    def forward(self, x):
        return _stacked(self, x) * self.grid[0][1] + self.cfg["head"]["scale"]

    def change(self, call):
        if call % 2:
            self.grid[0][1] = float(call) / 4
        else:
            self.cfg["head"]["scale"] = float(call)


class PrivateContainers(Towers):
    def __init__(self):
        super().__init__()
        self._biases = [torch.zeros(D)]
        self._scales = {"all": 1.0}

    def forward(self, x):
        return _stacked(self, x) * self._scales["all"] + self._biases[0]

    def change(self, call):
        if call % 2:
            self._biases[0] = torch.full((D,), float(call))
        else:
            self._scales["all"] = float(call) / 4


class PrivateClassAttribute(Towers):
    _SCALE = 1.0

    def forward(self, x):
        return _stacked(self, x) * self._SCALE

    def change(self, call):
        type(self)._SCALE = float(call) / 4


class ComputedNames(Towers):
    def __init__(self):
        super().__init__()
        self.kind = "a"
        self.scale_a = [1.0]
        self.opts = types.SimpleNamespace(bias_a=torch.zeros(D))

    def forward(self, x):
        scale = getattr(self, "scale_" + self.kind)[0]
        return _stacked(self, x) * scale + getattr(self.opts, f"bias_{self.kind}")

    def change(self, call):
        if call % 2:
            self.scale_a[0] = float(call) / 4
        else:
            self.opts.bias_a = torch.full((D,), float(call))


class HeldPairs(Towers):
    def __init__(self):
        super().__init__()
        self.state = Holder()
        self.state.pairs = [(torch.zeros(D),)]

    def forward(self, x):
        return _stacked(self, x) + self.state.pairs[0][0]

    def change(self, call):
        self.state.pairs[0] = (torch.full((D,), float(call)),)


Pair = collections.namedtuple("Pair", "weight bias")


class OtherContainers(Towers):
    """A set of tensors, an ``OrderedDict`` and a named tuple in a list."""

    def __init__(self):
        super().__init__()
        self.masks = {torch.ones(D)}
        self.table = collections.OrderedDict(bias=torch.zeros(D))
        self.pairs = [Pair(torch.ones(D), torch.zeros(D))]

    def forward(self, x):
        (mask,) = self.masks
        return _stacked(self, x) * mask * self.pairs[0].weight + self.table["bias"] + self.pairs[0].bias

    def change(self, call):
        which = (call // 3) % 3
        if which == 0:
            self.masks.clear()
            self.masks.add(torch.full((D,), 0.5))
        elif which == 1:
            self.table["bias"] = torch.full((D,), float(call))
        else:
            self.pairs[0] = Pair(torch.ones(D), torch.full((D,), float(call)))


GLOBAL_TABLE = {"bias": [torch.zeros(D)], "scale": [1.0]}


class NestedGlobal(Towers):
    def forward(self, x):
        return _stacked(self, x) * GLOBAL_TABLE["scale"][0] + GLOBAL_TABLE["bias"][0]

    changes_shared_state = True

    def change(self, call):
        if call % 2:
            GLOBAL_TABLE["bias"][0] = torch.full((D,), float(call))
        else:
            GLOBAL_TABLE["scale"][0] = float(call) / 4


CASES = {
    "dict-holding-a-list-of-tensors": NestedTensor,
    "list-of-tuples-of-tensors": PairsOfTensors,
    "tuple-of-tensors-reassigned": TupleOfTensors,
    "lists-and-dicts-of-numbers-nested": NestedNumbers,
    "private-containers": PrivateContainers,
    "private-class-attribute": PrivateClassAttribute,
    "getattr-with-a-computed-name": ComputedNames,
    "held-object-list-of-tuples": HeldPairs,
    "set-ordered-dict-named-tuple": OtherContainers,
    "global-dict-of-lists": NestedGlobal,
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_state_nested_private_or_named_at_run_time_changed_between_calls_is_seen(executor, case, monkeypatch):
    # A change every third call is churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    # The plan went on computing with what the trace read: a nested container's copy
    # shared the inner lists it compared with (or held tensors and was not compared), a
    # tuple of tensors was neither a flag nor a guarded container, ``_`` names were left
    # out, and a name built at run time was not among the names the code reads.
    make = CASES[case]
    done = []

    def change(model, call):
        if call % 3 != 2:
            return
        if getattr(model, "changes_shared_state", False):
            if done[-1:] == [call]:
                return
            done.append(call)
        model.change(call)

    try:
        paths = run_against_eager(make(), executor, calls=16, change=change, training=False)
    finally:
        PrivateClassAttribute._SCALE = 1.0
        GLOBAL_TABLE.update(bias=[torch.zeros(D)], scale=[1.0])
    assert "plan:" + executor in paths, paths
    assert paths[-1] == "plan:" + executor, paths


# --- functions a forward calls by name, replaced between calls ---------------------------


def activation(y):
    return torch.tanh(y)


def _relu_activation(y):
    return torch.relu(y)


ACTIVATION = torch.tanh


class CallsAGlobalHelper(Towers):
    def forward(self, x):
        return activation(_stacked(self, x))


class CallsAGlobalAlias(Towers):
    def forward(self, x):
        return ACTIVATION(_stacked(self, x))


class CallsAStaticMethod(Towers):
    ACT = staticmethod(torch.tanh)

    def forward(self, x):
        return self.ACT(_stacked(self, x))


class CallsAMethod(Towers):
    def finish(self, y):
        return torch.tanh(y)

    def forward(self, x):
        return self.finish(_stacked(self, x))


class CallsANamespaceFunction(Towers):
    def __init__(self):
        super().__init__()
        self.cfg = types.SimpleNamespace(act=torch.tanh)

    def forward(self, x):
        return self.cfg.act(_stacked(self, x))


class CallsAPartial(Towers):
    def __init__(self):
        super().__init__()
        self.act = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.1)

    def forward(self, x):
        return self.act(_stacked(self, x))


class Scaler:
    def __init__(self, scale):
        self.scale = scale

    def apply(self, y):
        return y * self.scale


class CallsABoundMethod(Towers):
    def __init__(self):
        super().__init__()
        self.fn = Scaler(1.0).apply

    def forward(self, x):
        return self.fn(_stacked(self, x))


def _closure_model():
    act = torch.tanh

    class CallsAClosureVariable(Towers):
        def forward(self, x):
            return act(_stacked(self, x))

    def replace(fn):
        nonlocal act
        act = fn

    return CallsAClosureVariable, replace


CallsAClosureVariable, _replace_closure_function = _closure_model()


class CallsFunctionsInContainers(Towers):
    def __init__(self):
        super().__init__()
        self.acts = [torch.tanh]
        self.named = {"finish": torch.tanh}

    def forward(self, x):
        return self.named["finish"](self.acts[0](_stacked(self, x)))


def _replace_function(case, model, relu):
    global activation, ACTIVATION
    if case == "global-helper":
        activation = _relu_activation if relu else _ORIGINAL_ACTIVATION
    elif case == "global-alias":
        ACTIVATION = torch.relu if relu else torch.tanh
    elif case == "static-method":
        CallsAStaticMethod.ACT = staticmethod(torch.relu if relu else torch.tanh)
    elif case == "method":
        if relu:
            CallsAMethod.finish = lambda self, y: torch.relu(y)
        else:
            CallsAMethod.finish = _ORIGINAL_FINISH
    elif case == "closure-variable":
        _replace_closure_function(torch.relu if relu else torch.tanh)
    elif case == "partial":
        model.act = functools.partial(torch.nn.functional.leaky_relu, negative_slope=0.5 if relu else 0.1)
    elif case == "bound-method":
        model.fn = Scaler(2.0 if relu else 1.0).apply
    elif case == "functions-in-containers":
        model.acts[0] = torch.relu if relu else torch.tanh
        model.named["finish"] = torch.sigmoid if relu else torch.tanh
    else:
        model.cfg.act = torch.relu if relu else torch.tanh


# Cases whose function each model holds itself (the others are shared: replaced once a call).
OWN_FUNCTIONS = ("namespace-attribute", "partial", "bound-method", "functions-in-containers")


_ORIGINAL_ACTIVATION = activation
_ORIGINAL_FINISH = CallsAMethod.finish
FUNCTION_CASES = {
    "global-helper": CallsAGlobalHelper,
    "global-alias": CallsAGlobalAlias,
    "static-method": CallsAStaticMethod,
    "method": CallsAMethod,
    "namespace-attribute": CallsANamespaceFunction,
    "closure-variable": CallsAClosureVariable,
    "partial": CallsAPartial,
    "bound-method": CallsABoundMethod,
    "functions-in-containers": CallsFunctionsInContainers,
}


@pytest.mark.parametrize("case", sorted(FUNCTION_CASES))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_function_the_forward_calls_by_name_replaced_between_calls_is_seen(executor, case, monkeypatch):
    # A change every third call is churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    # Traced code went through the function it found (or baked it into a node): another
    # one put there (mock.patch of a helper, an activation switched in a config) left
    # the plan computing with the old one.
    done = []

    def change(model, call):
        if call % 3 != 2:
            return
        if case not in OWN_FUNCTIONS:  # shared by both models: once per call
            if done[-1:] == [call]:
                return
            done.append(call)
        _replace_function(case, model, relu=(call // 3) % 2 == 0)

    try:
        paths = run_against_eager(FUNCTION_CASES[case](), executor, calls=16, change=change, training=False)
    finally:
        if case not in OWN_FUNCTIONS:
            _replace_function(case, None, relu=False)
    assert "plan:" + executor in paths, paths
    assert paths[-1] == "plan:" + executor, paths
