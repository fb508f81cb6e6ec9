"""Python state a trace cannot see as graph values: objects a module holds (a namespace of
options, an object with ``__slots__``, one held by another, a frozen dataclass replaced),
written during the forward or changed between calls, and module-level globals read by the
functions a forward calls. Every call equals eager, and the state ends as eager leaves it."""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import random
import types

import numpy as np
import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 6
PATHS = ("recorded", "plan", "as-written", "eager-dispatch")


class Towers(nn.Module):
    """Three independent towers summed: a model whose plan runs branches."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(3))

    def branches(self, x):
        return [t(x) for t in self.towers]


def run_against_eager(model, executor, calls=12, change=None, state=None, training=True):
    """Call ``model`` eagerly and wrapped (a deep copy) on fresh inputs; compare outputs,
    gradients and ``state(model)`` after every call; ``change(model, call)`` runs on both
    before each call. Returns the paths the wrapped calls ran."""
    reference = copy.deepcopy(model).train(training)
    sm = ss.StreamScheduledModule(model, executor=executor).train(training)
    paths = []
    for call in range(calls):
        if change is not None:
            change(reference, call)
            change(model, call)
        x = torch.randn(4, D)
        x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
        expected = reference(x_ref)
        actual = sm(x_new)
        paths.append(assert_path(sm, *PATHS))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        expected.square().sum().backward()
        actual.square().sum().backward()
        assert_close(x_new.grad, x_ref.grad, what=f"input grad, call {call} ({paths[-1]})")
        for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
            assert_close(p_new.grad, p_ref.grad, what=f"grad {name}, call {call}")
            p_ref.grad = p_new.grad = None
        if state is not None:
            assert state(model) == state(reference), f"call {call} ({paths[-1]})"
    return paths


# --- objects written during the forward --------------------------------------------------


class Slotted:
    __slots__ = ("count", "last")

    def __init__(self):
        self.count = 0
        self.last = 0.0


class Inner:
    def __init__(self):
        self.count = 0
        self.last = 0.0


class Outer:
    def __init__(self):
        self.inner = Inner()


def namespace_stats():
    return types.SimpleNamespace(count=0, last=0.0, history=[])


class WritesItsStats(Towers):
    """The root counts its calls and keeps the mean of a branch in an object it holds."""

    def __init__(self, make):
        super().__init__()
        self.holder = make()

    def stats(self):
        return getattr(self.holder, "inner", self.holder)

    def forward(self, x):
        ys = self.branches(x)
        stats = self.stats()
        stats.count += 1
        stats.last = ys[0].mean().item()
        if hasattr(stats, "history"):
            stats.history.append(stats.count)
        return torch.stack(ys).sum(0)


class CountingBranch(nn.Module):
    def __init__(self, stats):
        super().__init__()
        self.stats = stats
        self.body = nn.Sequential(nn.Linear(D, D), nn.Tanh())

    def forward(self, x):
        getattr(self.stats, "inner", self.stats).count += 1
        return self.body(x)


class ABranchWrites(Towers):
    """One branch (a child module) counts its calls in an object the root shares with it."""

    def __init__(self, make):
        super().__init__()
        self.shared = make()
        self.counting = CountingBranch(self.shared)

    def forward(self, x):
        return torch.stack(self.branches(x) + [self.counting(x)]).sum(0)


HOLDERS = {"namespace": namespace_stats, "slots": Slotted, "nested": Outer}


def _stats_of(model):
    stats = getattr(model.holder, "inner", model.holder)
    return (stats.count, round(stats.last, 4), list(getattr(stats, "history", ())))


@pytest.mark.parametrize("holder", sorted(HOLDERS))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_an_object_written_during_the_forward_is_written_on_every_call(executor, holder):
    # The trace ran the writes once, on its proxies: the count stopped at one (or two),
    # and the mean was left an fx Proxy (a namespace, an object with __slots__, one held
    # by another: none of them reported its assignments).
    model = WritesItsStats(HOLDERS[holder])
    run_against_eager(model, executor, state=_stats_of)
    assert _stats_of(model)[0] == 12


@pytest.mark.parametrize("holder", sorted(HOLDERS))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_branch_writing_an_object_it_shares_counts_every_call(executor, holder):
    # The branch's class runs as one call (its write refused while traced), the root
    # around it is traced.
    def count(model):
        return getattr(model.shared, "inner", model.shared).count

    model = ABranchWrites(HOLDERS[holder])
    paths = run_against_eager(model, executor, state=count)
    assert count(model) == 12
    assert paths[-1] == "plan:" + executor, paths  # the root is planned around the branch


# --- objects and globals read by traced code, changed between calls -------------------------


class SlottedOptions:
    __slots__ = ("scale", "negate")

    def __init__(self):
        self.scale = 1.0
        self.negate = False


class Options:
    def __init__(self):
        self.scale = 1.0
        self.negate = False


class Nested:
    def __init__(self):
        self.sub = Options()


@dataclasses.dataclass(frozen=True)
class FrozenOptions:
    scale: float = 1.0
    negate: bool = False


class Activation(enum.Enum):
    TANH = 1
    RELU = 2


def nested_namespace():
    return types.SimpleNamespace(sub=types.SimpleNamespace(scale=1.0, negate=False))


@dataclasses.dataclass(frozen=True)
class FrozenOptionsSetInPlace:
    """Changed with object.__setattr__, as frozen dataclasses' own __post_init__ and some
    libraries' configuration updates do: no __setattr__ of its class runs."""

    scale: float = 1.0
    negate: bool = False


OPTIONS = {
    "slots": SlottedOptions,
    "nested": Nested,
    "nested-namespace": nested_namespace,
    "frozen-dataclass": FrozenOptions,
    "frozen-dataclass-set-in-place": FrozenOptionsSetInPlace,
}


class ReadsItsOptions(Towers):
    def __init__(self, make):
        super().__init__()
        self.options = make()

    def forward(self, x):
        options = getattr(self.options, "sub", self.options)
        y = torch.stack(self.branches(x)).sum(0) * options.scale
        return -y if options.negate else y


def change_options(model, call):
    holder = getattr(model.options, "sub", model.options)
    if call % 4 == 1:
        new = {"negate": not holder.negate}
    elif call % 4 == 3:
        new = {"scale": float(call)}
    else:
        return
    if isinstance(holder, FrozenOptions):
        model.options = dataclasses.replace(holder, **new)  # replaced, not assigned
    elif isinstance(holder, FrozenOptionsSetInPlace):
        for k, v in new.items():
            object.__setattr__(holder, k, v)
    else:
        for k, v in new.items():
            setattr(holder, k, v)


@pytest.mark.parametrize("options", sorted(OPTIONS))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_options_read_by_traced_code_and_changed_between_calls_are_seen(executor, options):
    # The plan went on with the values the trace read: attributes of an object with
    # __slots__ (never compared), of an object held by an object the model holds (not
    # watched), of a frozen dataclass the model replaced (a module attribute holding an
    # object is no flag).
    paths = run_against_eager(ReadsItsOptions(OPTIONS[options]), executor, change=change_options, training=False)
    assert "plan:" + executor in paths, paths


SWITCH = False
SCALE = 1.0
ACTIVATION = Activation.TANH


def finish(y):
    """A helper the forwards call: the globals it reads are read by traced code."""
    y = torch.tanh(y) if ACTIVATION is Activation.TANH else torch.relu(y)
    return -y * SCALE if SWITCH else y * SCALE


class CallsAHelper(Towers):
    def forward(self, x):
        return finish(torch.stack(self.branches(x)).sum(0))


class BranchCallsAHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3))
        self.finishers = nn.ModuleList(Finisher() for _ in range(3))

    def forward(self, x):
        return torch.stack([f(b(x)) for b, f in zip(self.branches, self.finishers)]).sum(0)


class Finisher(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x):
        return finish(self.linear(x))


@pytest.mark.parametrize("model", [CallsAHelper, BranchCallsAHelper])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_globals_read_by_a_helper_the_forward_calls_are_seen(executor, model):
    # Only the forwards' own code was searched for the globals it reads: a flag, a
    # number and an enum member read by a function they call were baked in.
    global SWITCH, SCALE, ACTIVATION
    changes = []

    def change(_model, call):
        global SWITCH, SCALE, ACTIVATION
        if changes[-1:] == [call]:  # once per call (the change runs for both models)
            return
        changes.append(call)
        if call % 5 == 1:
            SWITCH = not SWITCH
        elif call % 5 == 3:
            SCALE = float(call)
        elif call % 5 == 4:
            ACTIVATION = Activation.RELU if ACTIVATION is Activation.TANH else Activation.TANH

    try:
        paths = run_against_eager(model(), executor, calls=15, change=change, training=False)
    finally:
        SWITCH, SCALE, ACTIVATION = False, 1.0, Activation.TANH
    assert "plan:" + executor in paths, paths


# --- containers, class attributes, closures and module-level objects read by traced code --

GLOBAL_OPTIONS = {"negate": False, "scale": 1.0}
GLOBAL_NAMESPACE = types.SimpleNamespace(negate=False, scale=1.0)


def _closure_model():
    options = {"negate": False, "scale": 1.0}

    class ReadsAClosure(Towers):
        def forward(self, x):
            y = torch.stack(self.branches(x)).sum(0) * options["scale"]
            return -y if options["negate"] else y

    return ReadsAClosure, options


ReadsAClosure, CLOSURE_OPTIONS = _closure_model()


class ReadsAGlobalDict(Towers):
    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0) * GLOBAL_OPTIONS["scale"]
        return -y if GLOBAL_OPTIONS["negate"] else y


class ReadsAGlobalNamespace(Towers):
    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0) * GLOBAL_NAMESPACE.scale
        return -y if GLOBAL_NAMESPACE.negate else y


class ReadsClassAttributes(Towers):
    SCALE = 1.0
    NEGATE = False

    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0) * self.SCALE
        return -y if type(self).NEGATE else y


class InheritsClassAttributes(ReadsClassAttributes):
    """Reads the constants its base defines; the test sets them on this class, which
    shadows the base's for its instances."""


class ReadsItsDict(Towers):
    def __init__(self):
        super().__init__()
        self.options = {"negate": False, "scale": 1.0}

    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0) * self.options["scale"]
        return -y if self.options["negate"] else y


class ReadsItsList(Towers):
    def __init__(self):
        super().__init__()
        self.scales = [1.0, 1.0, 1.0]

    def forward(self, x):
        return torch.stack([y * s for y, s in zip(self.branches(x), self.scales)]).sum(0)


class ReadsADictInANamespace(Towers):
    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(options={"negate": False, "scale": 1.0})

    def forward(self, x):
        y = torch.stack(self.branches(x)).sum(0) * self.config.options["scale"]
        return -y if self.config.options["negate"] else y


def _get(target, key):
    if isinstance(target, dict):
        return target[key]
    return getattr(target, key.upper() if isinstance(target, type) else key)


def _set(target, key, value):
    if isinstance(target, dict):
        target[key] = value
    else:
        setattr(target, key.upper() if isinstance(target, type) else key, value)


READ_STATE = {
    # model, where its state lives (per model, or shared by both), shared
    "global-dict": (ReadsAGlobalDict, lambda m: GLOBAL_OPTIONS, True),
    "global-namespace": (ReadsAGlobalNamespace, lambda m: GLOBAL_NAMESPACE, True),
    "closure": (ReadsAClosure, lambda m: CLOSURE_OPTIONS, True),
    "class-attributes": (ReadsClassAttributes, lambda m: ReadsClassAttributes, True),
    "inherited-class-attributes": (InheritsClassAttributes, lambda m: InheritsClassAttributes, True),
    "module-dict": (ReadsItsDict, lambda m: m.options, False),
    "module-list": (ReadsItsList, lambda m: m.scales, False),
    "namespace-dict": (ReadsADictInANamespace, lambda m: m.config.options, False),
}


@pytest.mark.parametrize("case", sorted(READ_STATE))
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_state_read_through_containers_classes_and_closures_is_seen(executor, case):
    # Neither a module's flag nor an object it holds: a dict or list changed in place, a
    # class attribute, a closure's dict, a module-level dict or namespace. The plan went
    # on computing with what the trace read.
    make, where, shared = READ_STATE[case]
    done = []

    def change(model, call):
        if shared and done[-1:] == [call]:
            return
        done.append(call)
        target = where(model)
        if call % 4 == 1:
            if isinstance(target, list):
                target[1] = -target[1]
            else:
                _set(target, "negate", not _get(target, "negate"))
        elif call % 4 == 3:
            if isinstance(target, list):
                target[1] = float(call)
            else:
                _set(target, "scale", float(call))

    saved = {k: dict(v) for k, v in (("g", GLOBAL_OPTIONS), ("c", CLOSURE_OPTIONS))}
    saved_ns = dict(vars(GLOBAL_NAMESPACE))
    try:
        paths = run_against_eager(make(), executor, change=change, training=False)
    finally:
        GLOBAL_OPTIONS.update(saved["g"])
        CLOSURE_OPTIONS.update(saved["c"])
        vars(GLOBAL_NAMESPACE).update(saved_ns)
        ReadsClassAttributes.SCALE, ReadsClassAttributes.NEGATE = 1.0, False
        for name in ("SCALE", "NEGATE"):
            if name in vars(InheritsClassAttributes):
                delattr(InheritsClassAttributes, name)
    assert "plan:" + executor in paths, paths


# --- globals written during the forward -----------------------------------------------------

CALLS = 0
SEEN_ROWS: list = list(range(100))  # longer than a list compared every call


def count_call(y):
    global CALLS
    CALLS += 1
    SEEN_ROWS.append(y.shape[0])
    return y


class CountsInAGlobal(Towers):
    def forward(self, x):
        return count_call(torch.stack(self.branches(x)).sum(0))


class CountingFinisher(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x):
        return count_call(self.linear(x))


class ABranchCountsInAGlobal(Towers):
    def __init__(self):
        super().__init__()
        self.counting = CountingFinisher()

    def forward(self, x):
        return torch.stack(self.branches(x) + [self.counting(x)]).sum(0)


@pytest.mark.parametrize("model", [CountsInAGlobal, ABranchCountsInAGlobal])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_global_written_during_the_forward_is_written_on_every_call(executor, model):
    # A helper assigning a global and appending to a global list: the trace ran it once
    # (where nothing re-traced on the change, the count stopped), or once more than eager.
    global CALLS
    CALLS, before = 0, len(SEEN_ROWS)
    try:
        paths = run_against_eager(model(), executor, training=False)
        assert CALLS == 24 and len(SEEN_ROWS) == before + 24, (CALLS, len(SEEN_ROWS) - before)
    finally:
        CALLS = 0
        del SEEN_ROWS[before:]
    if model is ABranchCountsInAGlobal:
        assert paths[-1] == "plan:" + executor, paths  # the counting branch runs as written


# --- tensors held outside the modules, and library objects with hidden state ----------------

GLOBAL_BIAS = torch.zeros(D)


class AddsABias(Towers):
    def __init__(self, holder):
        super().__init__()
        self.holder = holder  # "namespace", "object" or "global"
        self.state = types.SimpleNamespace(bias=torch.zeros(D)) if holder == "namespace" else Inner()
        if holder == "object":
            self.state.bias = torch.zeros(D)

    def forward(self, x):
        bias = GLOBAL_BIAS if self.holder == "global" else self.state.bias
        return torch.stack(self.branches(x)).sum(0) + bias


@pytest.mark.parametrize("holder", ["namespace", "object", "global"])
def test_a_tensor_held_outside_the_modules_and_replaced_is_read_anew(holder):
    # The graph held the tensor the trace read as a constant: replaced by another one
    # (a namespace's, a plain object's or a global), the plan went on adding the old one.
    global GLOBAL_BIAS
    done = []

    def change(model, call):
        global GLOBAL_BIAS
        if call % 3 != 2:
            return
        if holder == "global":
            if done[-1:] != [call]:
                done.append(call)
                GLOBAL_BIAS = torch.full((D,), float(call))
        else:
            model.state.bias = torch.full((D,), float(call))

    try:
        paths = run_against_eager(AddsABias(holder), "serial", change=change, training=False)
    finally:
        GLOBAL_BIAS = torch.zeros(D)
    assert "plan:serial" in paths, paths


GLOBAL_BIASES = [torch.zeros(D), 1.0]


class AddsABiasFromAContainer(Towers):
    """Reads a tensor out of a list or dict (beside a plain value) a module, a held object
    or a global holds: the graph holds the tensor as a constant, and replacing the item
    assigns nothing the module could see."""

    def __init__(self, holder):
        super().__init__()
        self.holder = holder
        if holder == "module-list":
            self.biases = [torch.zeros(D), 1.0]
        elif holder == "module-dict":
            self.biases = {"bias": torch.zeros(D), "scale": 1.0}
        elif holder == "object-list":
            self.state = Inner()
            self.state.biases = [torch.zeros(D), 1.0]

    def forward(self, x):
        out = torch.stack(self.branches(x)).sum(0)
        if self.holder == "module-list":
            return out * self.biases[1] + self.biases[0]
        if self.holder == "module-dict":
            return out * self.biases["scale"] + self.biases["bias"]
        if self.holder == "object-list":
            return out * self.state.biases[1] + self.state.biases[0]
        return out * GLOBAL_BIASES[1] + GLOBAL_BIASES[0]


@pytest.mark.parametrize("holder", ["module-list", "module-dict", "object-list", "global-list"])
def test_a_tensor_in_a_held_container_replaced_is_read_anew(holder):
    done = []

    def change(model, call):
        if call % 3 != 2:
            return
        bias = torch.full((D,), float(call))
        if holder == "module-list":
            model.biases[0] = bias
        elif holder == "module-dict":
            model.biases["bias"] = bias
        elif holder == "object-list":
            model.state.biases[0] = bias
        elif done[-1:] != [call]:  # one global for both models: replaced once per call
            done.append(call)
            GLOBAL_BIASES[0] = bias

    try:
        paths = run_against_eager(AddsABiasFromAContainer(holder), "serial", change=change, training=False)
    finally:
        GLOBAL_BIASES[:] = [torch.zeros(D), 1.0]
    assert "plan:serial" in paths, paths


class DrawsFromAHeldGenerator(Towers):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "random.Random":
            self.rng = random.Random(0)
        elif kind == "numpy-generator":
            self.rng = np.random.default_rng(0)
        elif kind == "deque":
            self.recent = collections.deque(maxlen=3)

    def forward(self, x):
        if self.kind == "random.Random":
            scale = self.rng.random()
        elif self.kind == "numpy-generator":
            scale = float(self.rng.random())
        elif self.kind == "numpy-global":
            scale = float(np.random.rand())
        else:
            self.recent.append(x.shape[0])
            scale = float(sum(self.recent))
        return torch.stack(self.branches(x)).sum(0) * scale


@pytest.mark.parametrize("kind", ["random.Random", "numpy-generator", "numpy-global", "deque"])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_state_a_library_object_keeps_to_itself_advances_as_in_eager(executor, kind):
    # Drawing from a random.Random or numpy generator the model holds, from numpy's global
    # generator, or appending to a deque: no attribute is assigned, and the trace drew
    # once, baking the number into the plan (and left the generator a draw ahead).
    model = DrawsFromAHeldGenerator(kind)
    reference = copy.deepcopy(model).eval()
    sm = ss.StreamScheduledModule(model, executor=executor).eval()
    for call in range(8):
        x = torch.randn(2 + call % 2, D)
        np.random.seed(call)
        expected = reference(x)
        after_eager = np.random.rand()
        np.random.seed(call)
        actual = sm(x)
        path = assert_path(sm, *PATHS)
        assert np.random.rand() == after_eager, f"call {call} ({path}): numpy's generator is not where eager left it"
        assert_close(actual, expected, what=f"call {call} ({path})")


class HoldsAnArray(Towers):
    """Towers holding a numpy array (a lookup table, anchors) the forward never draws from."""

    def __init__(self, n):
        super().__init__()
        self.table = np.zeros(n, dtype=np.float32)
        self.window = self.table[: n // 2]  # a view: owns no data, pickles what it sees

    def forward(self, x):
        return torch.stack(self.branches(x)).sum(0)


def test_a_large_array_a_module_holds_is_not_pickled_while_tracing(monkeypatch):
    # A library object's state is compared by its pickled bytes where they are short:
    # pickling a module's 200 MB table to find that out cost each trace 200 MB and 0.3 s.
    import pickle

    pickled = []
    dumps = pickle.dumps

    def counting(obj, *args, **kwargs):
        pickled.append(type(obj))
        return dumps(obj, *args, **kwargs)

    monkeypatch.setattr(pickle, "dumps", counting)
    model = HoldsAnArray(1 << 18)
    sm = ss.StreamScheduledModule(model, executor="serial").eval()
    for _ in range(3):
        x = torch.randn(2, D)
        assert_close(sm(x), model(x))
        assert_path(sm, *PATHS)
    assert np.ndarray not in pickled, pickled


def test_a_global_missing_when_noted_is_not_watched_as_a_library_object():
    # The marker of a name not yet assigned is no state of the model's: comparing it
    # pickled it as each traced forward returned.
    from streamsched.frontend.trace_guard import HeldState

    held = HeldState(nn.Linear(2, 2))
    held.note_globals({"__name__": "helpers"}, ["NOT_ASSIGNED_YET"])
    assert [type(obj) for obj, _ in held.hidden_globals.values() if type(obj) is object] == []
    assert held.changed(root=True) is None
