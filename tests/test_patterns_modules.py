"""Modules changed while wrapped, compared with eager PyTorch on fresh inputs after each
change: a tensor held as a plain attribute (not a parameter or buffer) re-assigned or
updated in place, on the model itself and on a submodule."""

from __future__ import annotations

import types
from collections import OrderedDict, defaultdict
from functools import partial

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import runner
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = torch.tensor(2.0)  # a plain attribute: not a parameter, not a buffer

    def forward(self, x):
        return self.lin(x) * self.scale


class HoldsTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = Scaled()
        self.right = nn.Linear(D, D)
        self.offset = torch.zeros(D)

    def forward(self, x):
        return self.left(x) + self.right(x) + self.offset


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_tensor_attributes_reassigned_or_updated_are_read_every_call(executor):
    model = HoldsTensors()
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for call in range(8):
        if call % 3 == 1:
            model.offset = torch.full((D,), float(call))  # the model's own attribute
            model.left.scale = torch.tensor(float(call))  # a submodule's
        elif call % 3 == 2:
            model.offset.add_(1)
            model.left.scale.mul_(-1)
        x = torch.randn(4, D)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan")
        assert_close(out, model(x), what=f"call {call} ({path})")


# --- the model itself cast or moved after wrapping ---------------------------------


class ReadsItsPlacement(nn.Module):
    """Reads its parameters' dtype and device as plain Python values, as transformers'
    ``self.dtype`` / ``self.device`` do: a trace bakes them in."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(8, 4) for _ in range(4))

    def forward(self, x):
        w = next(self.parameters())
        eps = torch.finfo(w.dtype).eps  # 1.2e-7 in float32, 2.2e-16 in float64
        pos = torch.arange(x.shape[0], device=w.device, dtype=w.dtype)[:, None]
        return torch.stack([h(x) for h in self.heads]).sum(0) + pos + eps * 1e6


def _calls(sm, model, make, n=4):
    for _ in range(n):
        x = make()
        assert_close(sm(x), model(x), atol=1e-6, rtol=1e-6)
    assert_path(sm, "recorded", "plan", "as-written")


def test_casting_the_model_itself_after_wrapping_re_traces():
    """``model.double()`` on the wrapped model (not the wrapper) moves no module
    generation; a trace made in float32 baked float32's epsilon in (off by 0.12)."""
    model = ReadsItsPlacement()
    sm = ss.StreamScheduledModule(model)
    _calls(sm, model, lambda: torch.randn(3, 8))
    model.double()
    _calls(sm, model, lambda: torch.randn(3, 8, dtype=torch.float64))
    model.float()
    _calls(sm, model, lambda: torch.randn(3, 8))


def test_moving_the_model_itself_after_wrapping_re_traces():
    """``model.cuda()`` on the wrapped model: a trace made on the CPU baked its device in,
    and every later call failed on mixed devices."""
    from streamsched.emulated_cuda import EmulatedCuda

    with EmulatedCuda():
        model = ReadsItsPlacement()
        sm = ss.StreamScheduledModule(model)
        _calls(sm, model, lambda: torch.randn(3, 8))
        model.cuda()
        _calls(sm, model, lambda: torch.randn(3, 8, device="cuda"))


# --- a forward that caches a value in a dict it holds --------------------------------


class CachesItsBias(nn.Module):
    """Caches a computed bias in a dict attribute in eval, per device (LeViT's attention
    biases, in timm and transformers)."""

    def __init__(self, cache: type = dict):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.biases = nn.Parameter(torch.randn(D))
        self.cache = cache()

    def bias(self, device):
        if self.training:
            return self.biases * 2
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self.biases * 2
        return self.cache[key]

    def forward(self, x, scale: bool = False):
        out = self.lin(x) + self.bias(x.device)
        return out * 3 if scale else out


class HoldsACachingModule(nn.Module):
    def __init__(self, cache: type = dict):
        super().__init__()
        self.inner = CachesItsBias(cache)
        self.out = nn.Linear(D, D)

    def forward(self, x, scale: bool = False):
        return self.out(self.inner(x, scale))


@pytest.mark.parametrize(
    "cache", [dict, OrderedDict, partial(defaultdict, int)], ids=["dict", "OrderedDict", "defaultdict"]
)
@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_a_value_cached_in_a_dict_while_tracing_does_not_stay_there(executor, cache):
    """A trace runs the forward once on proxies: the proxy cached in the module's dict
    stayed there, the next trace (another signature) took that proxy of the old graph
    (its recording failed with a KeyError), and the model itself, called as written,
    found a proxy in its cache. The module that writes into a container it holds runs
    as written, and its container holds what eager would: a dict, or a subclass of one
    (an ``OrderedDict``, a ``defaultdict``)."""
    torch.manual_seed(0)
    model = HoldsACachingModule(cache).eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    with torch.no_grad():
        for call, scale in enumerate([False, False, True, True, False]):
            x = torch.randn(4, D)
            out = sm(x, scale=scale)
            path = assert_path(sm, "recorded", "plan", "as-written")
            assert all(isinstance(v, torch.Tensor) for v in model.inner.cache.values()), model.inner.cache
            assert_close(out, model(x, scale=scale), what=f"call {call} ({path})")
    assert list(model.inner.cache) == ["cpu"]


# --- configuration read by traced code: a tuple attribute, a config object ----------


class Settings:
    """A configuration object modules hold (as Hugging Face models hold ``config``)."""

    def __init__(self):
        self.negate = False
        self.scale = 1.0


class Head(nn.Module):
    def __init__(self, settings):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.settings = settings
        self.window = (1, 2)  # a tuple of plain values, read by traced code

    def forward(self, x):
        y = self.lin(x) * self.window[0]
        return -y if self.settings.negate else y


class ReadsItsSettings(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Settings()
        self.heads = nn.ModuleList(Head(self.config) for _ in range(3))
        self.other = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, x):
        y = torch.stack([h(x) for h in self.heads] + [self.other(x)]).sum(0)
        return y * self.config.scale


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
def test_tuple_attributes_and_config_objects_changed_between_calls_are_seen(executor):
    # The trace baked in what it read: a tuple attribute (not one of the flag types that
    # assigning re-traces) and attributes of an object the modules hold (assigning those
    # goes through no module's __setattr__). Either changed, the plan computed the old value.
    model = ReadsItsSettings()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(24):
        step = call // 3
        if step % 4 == 1:
            model.config.negate = not model.config.negate  # the object the root and heads share
        elif step % 4 == 2:
            model.config.scale = float(step)
        elif step % 4 == 3:
            model.heads[1].window = (step, 2)
        x = torch.randn(4, D)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan", "as-written")
        assert_close(out, model(x), what=f"call {call} ({path})")


# --- a module-level global read by traced code ----------------------------------------

NEGATE_HEADS = False  # a module-level switch a forward reads (debugging, ablations)
HEAD_SCALE = (1.0, 2.0)


class ReadsAGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.other = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, x):
        ys = [h(x) * HEAD_SCALE[0] for h in self.heads]  # read inside a comprehension
        y = torch.stack(ys + [self.other(x)]).sum(0)
        return -y if NEGATE_HEADS else y


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
def test_module_level_globals_changed_between_calls_are_seen(executor):
    # The trace baked in the values the forward read from its module's globals; the plan
    # went on computing with them after they changed.
    global NEGATE_HEADS, HEAD_SCALE
    model = ReadsAGlobal()
    sm = ss.StreamScheduledModule(model, executor=executor)
    try:
        for call in range(18):
            if call % 3 == 2:
                NEGATE_HEADS = not NEGATE_HEADS
            if call % 6 == 4:  # alone: no other change re-checks the trace then
                HEAD_SCALE = (HEAD_SCALE[0] + 1.0, 2.0)
            x = torch.randn(4, D)
            out = sm(x)
            path = assert_path(sm, "recorded", "plan", "as-written")
            assert_close(out, model(x), what=f"call {call} ({path})")
    finally:
        NEGATE_HEADS, HEAD_SCALE = False, (1.0, 2.0)


class Tally:
    """An object a model holds and updates in its forward (running counts for logging)."""

    def __init__(self):
        self.calls = 0
        self.rows = 0


class KeepsATally(ReadsItsSettings):
    def __init__(self):
        super().__init__()
        self.tally = Tally()

    def forward(self, x):
        self.tally.calls += 1
        self.tally.rows = self.tally.rows + x.shape[0]
        return super().forward(x)


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
def test_an_object_the_forward_updates_is_updated_on_every_call(executor):
    # The trace ran the updates once, on proxies: the object was left holding an fx
    # Proxy (``rows``), which the next read outside the trace raised on, and the count
    # stopped. Assigning an attribute of an object a module holds is a side effect the
    # trace refuses, as assigning a module's own attribute is.
    model = KeepsATally()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(12):
        x = torch.randn(3 + call % 2, D)
        expected = model(x)
        assert_close(sm(x), expected, what=f"call {call}")
        assert type(model.tally.rows) is int and type(model.tally.calls) is int
        assert model.tally.calls == 2 * (call + 1)
    assert model.tally.rows == sum(2 * (3 + c % 2) for c in range(12))


class ReadsANamespace(ReadsItsSettings):
    def __init__(self):
        super().__init__()
        self.options = types.SimpleNamespace(negate=False)  # a built-in class: assignments unseen

    def forward(self, x):
        y = super().forward(x)
        return -y if self.options.negate else y


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_simple_namespace_the_model_holds_is_compared_every_call(executor, monkeypatch):
    # Changes this frequent are churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    # Its class is built in, so assigning its attributes cannot move the generation:
    # its plain attributes are compared on every call instead, as globals are.
    model = ReadsANamespace()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(10):
        if call % 3 == 2:
            model.options.negate = not model.options.negate
        x = torch.randn(4, D)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan")
        assert_close(out, model(x), what=f"call {call} ({path})")


class Containers(nn.Module):
    """Heads in a ModuleDict, a ModuleList and a Sequential, every one of them called."""

    def __init__(self):
        super().__init__()
        self.named = nn.ModuleDict({k: nn.Linear(D, 4) for k in "abc"})
        self.listed = nn.ModuleList(nn.Linear(D, 4) for _ in range(3))
        self.chain = nn.Sequential(nn.Linear(D, D), nn.Tanh())

    def forward(self, x):
        return {k: h(x) for k, h in self.named.items()}, [h(x) for h in self.listed], self.chain(x)


def _edit_containers(model: Containers, edit: str) -> None:
    torch.manual_seed(9)
    if edit == "del ModuleDict[k]":
        del model.named["b"]
    elif edit == "ModuleDict.pop":
        model.named.pop("a")
    elif edit == "ModuleDict.clear":
        model.named.clear()
    elif edit == "ModuleList.insert":
        model.listed.insert(1, nn.Linear(D, 4))
    elif edit == "Sequential.insert":
        model.chain.insert(1, nn.Linear(D, D))


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize(
    "edit", ["del ModuleDict[k]", "ModuleDict.pop", "ModuleDict.clear", "ModuleList.insert", "Sequential.insert"]
)
def test_containers_edited_without_setattr_after_planning_re_trace(edit, executor):
    """These edits write the container's module table directly (no ``__setattr__`` or
    ``__delattr__``): the kept plan went on calling the modules as they were (a deleted
    head's output still returned, an inserted layer never run)."""
    torch.manual_seed(0)
    model = Containers()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for _ in range(2):
        sm(torch.randn(5, D))
    assert_path(sm, "plan")
    _edit_containers(model, edit)
    for call in range(3):
        x = torch.randn(5, D)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan")
        expected = model(x)
        assert list(out[0]) == list(expected[0]), f"{edit}, call {call} ({path}): the ModuleDict's keys"
        assert_close(out, expected, what=f"{edit}, call {call} ({path})")
