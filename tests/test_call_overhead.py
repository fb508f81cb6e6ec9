"""What a call costs besides the model's own work: the binding shortcut gives exactly what
the full bind gives (leaves and spec) for keyword calls, defaults, None and scalars; modules
built inside a forward (``self.layers[:n]``) do not send the wrapper through its
re-wiring check on every call, while re-wiring the wrapped model still does."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import _generation
from streamsched.frontend.binder import CallBinder
from streamsched.frontend.binder import ShapeCachedBinder as _Binder
from streamsched.runner import Runner
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_dynamic_calls import Cache, WithCache


class Keywords(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x, mask=None, scale=1.0, use_cache=False, *, extra=None, **kwargs):
        h = self.lin(x) * scale
        if mask is not None:
            h = h * mask
        if use_cache:
            h = h + 1
        if extra is not None:
            h = h + self.other(extra)
        return {"h": h, "n": len(kwargs)}


def _calls(x, m, e):
    yield (x,), {}
    yield (x, m), {}
    yield (x,), {"mask": m}
    yield (), {"x": x, "mask": m}
    yield (), {"mask": m, "x": x}
    yield (x, None, 2.0), {}
    yield (x,), {"scale": 3}
    yield (x,), {"use_cache": True}
    yield (x,), {"use_cache": False, "extra": e}
    yield (x, m, 0.5, True), {"extra": e}
    yield (x,), {"flag": 1}  # into **kwargs
    yield (x,), {"mask": [m]}  # a list: the full bind every time


def test_the_shortcut_gives_exactly_the_full_binds_leaves_and_spec():
    model = Keywords()
    full = CallBinder(model)
    fast = _Binder(CallBinder(model))
    x, m, e = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(2):  # the first call of each shape learns, the second takes the shortcut
        for args, kwargs in _calls(x, m, e):
            leaves, spec = fast.bind(args, kwargs)
            want_leaves, want_spec = full.bind(args, kwargs)
            assert len(leaves) == len(want_leaves) and all(a is b for a, b in zip(leaves, want_leaves))
            assert spec.key == want_spec.key and spec.tensor_positions == want_spec.tensor_positions
    shortcuts = sum(1 for v in fast.shapes.values() if v is not False)
    assert shortcuts == 11  # every call above but the one with a list took the shortcut on its second bind


def test_scalars_and_none_are_part_of_the_shape():
    model = Keywords()
    fast = _Binder(CallBinder(model))
    x, m = torch.randn(2, 4), torch.randn(2, 4)
    keys = set()
    for mask, cache in itertools.product((None, m), (True, False)):
        for _ in range(2):
            _, spec = fast.bind((x,), {"mask": mask, "use_cache": cache})
        keys.add(spec.key)
    assert len(keys) == 4


def test_errors_are_still_the_full_binds():
    fast = _Binder(CallBinder(Keywords()))
    x = torch.randn(2, 4)
    with pytest.raises(TypeError):
        fast.bind((x, None, 1.0, False, 5), {})
    with pytest.raises(TypeError):
        fast.bind((), {"mask": x})


def test_the_wrapper_runs_keyword_calls_like_the_model():
    torch.manual_seed(0)
    model = Keywords()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x, m, e = torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4)
    for _ in range(3):
        for args, kwargs in _calls(x, m, e):
            if isinstance(kwargs.get("mask"), list):
                continue  # not a forward this model accepts
            out = sm(*args, **kwargs)
            want = model(*args, **kwargs)
            assert_close(out["h"], want["h"]) and out["n"] == want["n"]


class SlicesItsLayers(nn.Module):
    """Builds a new ModuleList on every call, as Hugging Face decoders do."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.n = 2

    def forward(self, x):
        for layer in self.layers[: self.n]:
            x = layer(x)
        return x


def test_containers_built_by_a_forward_do_not_move_the_generation(monkeypatch):
    model = SlicesItsLayers()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    sm(x)
    checks = []
    original = Runner.revalidate
    monkeypatch.setattr(Runner, "revalidate", lambda self: (checks.append(1), original(self))[1])
    before = _generation.current()
    for _ in range(5):
        assert_close(sm(x), model(x))  # the model's own forward builds its slice too
    nn.ModuleList([nn.Linear(2, 2)])  # any module built anywhere
    sm(x)
    assert _generation.current() == before and checks == []
    # Re-wiring the wrapped model (or a module registered into it later) still counts.
    model.layers[1] = nn.Linear(4, 4)
    assert_close(sm(x), model(x))
    assert checks == [1]
    extra = nn.Sequential(nn.Linear(4, 4))
    model.layers.append(extra)
    moved = _generation.current()
    extra[0] = nn.Linear(4, 4)  # inside a subtree registered after wrapping: tracked too
    assert _generation.current() > moved
    model.n = 4  # a flag the trace read
    assert_close(sm(x), model(x))


class ReassignsItsOwn(nn.Module):
    """Assigns its buffer, parameter and submodule to themselves on every call, as
    CTRL's ``self.pos_encoding = self.pos_encoding.to(device, dtype)`` does (``to`` of a
    tensor already there returns the tensor itself)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.randn(4))
        self.register_buffer("pos", torch.randn(4))

    def forward(self, x):
        self.pos = self.pos.to(device=x.device, dtype=x.dtype)
        self.scale = self.scale
        self.lin = self.lin
        return self.lin(x) * self.scale + self.pos


@pytest.mark.filterwarnings("ignore::streamsched.errors.UntraceableWarning")
def test_a_forward_assigning_its_own_tensors_and_modules_to_themselves_moves_no_generation(monkeypatch):
    """Nothing changed: the calls do not re-check the wrapped model's modules and traces
    (which costs a transformers model half a millisecond a call). Assigning another
    tensor still counts, and is seen."""
    model = ReassignsItsOwn()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    for _ in range(3):
        sm(x)
    checks = []
    original = Runner.revalidate
    monkeypatch.setattr(Runner, "revalidate", lambda self: (checks.append(1), original(self))[1])
    before = _generation.current()
    for _ in range(5):
        assert_close(sm(x), model(x))
    assert _generation.current() == before and checks == []
    for name in ("pos", "scale"):
        moved = _generation.current()
        with torch.no_grad():
            setattr(model, name, type(getattr(model, name))(torch.randn(4)))
        assert _generation.current() > moved, name
        assert_close(sm(x), model(x))
    moved = _generation.current()
    model.lin = nn.Linear(4, 4)
    assert _generation.current() > moved
    assert_close(sm(x), model(x))


def test_assigning_a_parameter_or_buffer_to_itself_moves_no_generation_when_its_name_is_watched(monkeypatch):
    """A flag another model's trace read may share a name with a parameter or buffer here
    (``scale``, ``pos``): the names watched are one process-wide set. Such an assignment
    of the tensor already there was taken for a changed flag (its value is in the
    module's tables, not its ``__dict__``), and every call re-checked the model."""
    monkeypatch.setattr(_generation, "_watched", _generation._watched | {"scale", "pos", "lin"})
    test_a_forward_assigning_its_own_tensors_and_modules_to_themselves_moves_no_generation(monkeypatch)


class RecordsItsDtype(nn.Module):
    """Assigns a flag on every call, always the same value (NLLB-MoE's router runs
    ``self.input_dtype = hidden_states.dtype``); run as written (a leaf)."""

    def __init__(self):
        super().__init__()
        self.flag = True
        self.input_dtype = torch.float32

    def forward(self, x):
        self.input_dtype = x.dtype
        self.flag = True
        return x * 2


class ReadsAFlag(nn.Module):
    def __init__(self):
        super().__init__()
        self.flag = True
        self.router = RecordsItsDtype()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.router(x)
        return self.lin(y) if self.flag else y


def test_a_watched_flag_assigned_the_value_it_has_moves_no_generation(monkeypatch):
    """``flag`` is watched (the trace read it); assigning it the value it holds changes
    nothing and re-checks nothing. Another value still counts, and is seen."""
    model = ReadsAFlag()
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[RecordsItsDtype])
    x = torch.randn(2, 4)
    for _ in range(3):
        sm(x)
    checks = []
    original = Runner.revalidate
    monkeypatch.setattr(Runner, "revalidate", lambda self: (checks.append(1), original(self))[1])
    before = _generation.current()
    for _ in range(5):
        assert_close(sm(x), model(x))
    assert _generation.current() == before and checks == []
    model.flag = False
    assert _generation.current() > before
    assert_close(sm(x), model(x))
    assert checks == [1]


# --- the wrapper's own call: shortcuts past nn.Module.__call__, the bind and the key ---


class Pair(nn.Module):
    """Two alike towers over ``x``, plus ``y`` (a tensor, or a number baked into the trace)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        self.b = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))

    def forward(self, x, y):
        return self.a(x) * self.b(x) + y


class _Marked(torch.Tensor):
    """A tensor subclass: not a plain tensor, so no positional-tensor shortcut."""


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_hooks_on_the_wrapper_itself_fire_on_every_call(executor):
    torch.manual_seed(0)
    model = Pair()
    sm = ss.StreamScheduledModule(model, executor=executor)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(6):  # past the first call and the trial: the settled path
        sm(x, y)
    seen = []
    pre = sm.register_forward_pre_hook(lambda m, args: (-args[0], args[1]))
    post = sm.register_forward_hook(lambda m, args, out: (seen.append(m), out * 3.0)[1])
    for _ in range(3):
        x = torch.randn(3, 4)
        assert_close(sm(x, y), model(-x, y) * 3.0)
    assert seen == [sm] * 3
    pre.remove()
    post.remove()
    back = sm.register_full_backward_hook(lambda m, gin, gout: seen.append("backward"))
    xg = torch.randn(3, 4, requires_grad=True)
    sm(xg, y).sum().backward()
    assert seen[-1] == "backward"
    back.remove()
    x = torch.randn(3, 4)
    assert_close(sm(x, y), model(x, y))
    assert len(seen) == 4


def test_global_module_hooks_see_the_wrapper_call():
    model = Pair()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):
        sm(x, y)
    called = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: called.append(m))
    try:
        with pytest.warns(ss.HooksWarning):
            assert_close(sm(x, y), model(x, y))
    finally:
        handle.remove()
    # The wrapper's own call fired it once, and the model's call (as written) once.
    assert called.count(sm) == 1 and called.count(model) == 2


def test_a_forward_replaced_on_the_wrapper_or_by_a_subclass_is_the_one_called():
    torch.manual_seed(0)
    model = Pair()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):
        sm(x, y)
    # Libraries (accelerate's hooks) set an instance attribute ``forward`` around the old one.
    old = sm.forward
    sm.forward = lambda *args, **kwargs: old(*args, **kwargs) + 1.0
    assert_close(sm(x, y), model(x, y) + 1.0)
    del sm.forward
    assert_close(sm(x, y), model(x, y))

    class Doubled(ss.StreamScheduledModule):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs) * 2.0

    doubled = Doubled(Pair())
    for _ in range(3):
        x = torch.randn(3, 4)
        assert_close(doubled(x, y), doubled.module(x, y) * 2.0)


def test_positional_tensor_calls_skip_the_bind_and_other_values_do_not():
    torch.manual_seed(0)
    model = Pair()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for _ in range(3):
        x = torch.randn(3, 4)
        assert_close(sm(x, y), model(x, y))
        assert_path(sm, "recorded", "plan")
    assert sm._ss.tensors_spec is not None
    # A number where a tensor was: a static value of its own trace, keyed by value.
    for value in (2.0, 3.0, 2.0):
        x = torch.randn(3, 4)
        assert_close(sm(x, value), model(x, value))
    # A tensor subclass: the full bind.
    marked = torch.randn(3, 4).as_subclass(_Marked)
    assert_close(sm(marked, y), model(marked, y))
    # Too few or too many arguments: Python's error, naming the forward.
    with pytest.raises(TypeError, match=r"Pair\.forward\(\)"):
        sm(x)
    with pytest.raises(TypeError, match=r"Pair\.forward\(\)"):
        sm(x, y, y)
    x = torch.randn(3, 4)
    assert_close(sm(x, y), model(x, y))
    assert_path(sm, "plan")


def test_a_call_settled_as_written_reports_its_own_plan_and_path():
    torch.manual_seed(0)
    model = WithCache()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x, cache = torch.randn(3, 16), Cache()
        assert_close(sm(x, past=cache), model(x, past=cache))
        assert_path(sm, "as-written")
        assert sm.plan.executor == "eager"
        x = torch.randn(3, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "recorded", "plan")
        assert sm.plan.executor == "serial"
    # The same signature as the previous call (the shortcut), after a call that planned
    # a new signature in between.
    x, cache = torch.randn(3, 16), Cache()
    sm(x, past=cache)
    sm(torch.randn(5, 16))  # a new size: recorded and planned
    assert_path(sm, "recorded")
    assert_close(sm(x, past=cache), model(x, past=cache))
    assert_path(sm, "as-written")
    assert sm.plan.executor == "eager"
    # A planned signature called twice in a row still runs its plan.
    x = torch.randn(3, 16)
    sm(x)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan")
    # Grad mode is part of the signature: a call with gradients gets them.
    with torch.no_grad():
        sm(x, past=cache)
    xg = torch.randn(3, 16, requires_grad=True)
    out = sm(xg, past=cache)
    assert out.requires_grad
    out.sum().backward()
    assert xg.grad is not None


class NormedTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)) for _ in range(3))
        self.norm = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.0)
        self.scale = 1.0

    def forward(self, x):
        return self.drop(self.norm(torch.stack([t(x) for t in self.towers]).sum(0))) * self.scale


def test_switching_train_and_eval_every_call_only_re_keys_the_mode(monkeypatch):
    # train()/eval() before every call (a rollout in eval, an update in train) moves the
    # generation; plans are keyed by every module's mode, so nothing else needs checking.
    # Each switch used to walk every trace's modules and flags (and re-read every fused
    # module's configuration): the calls ran at less than half the model's own speed.
    from streamsched.frontend.trace import Traced

    model = NormedTowers()
    sm = ss.StreamScheduledModule(model, executor="serial")
    walks = []
    for name in ("modules_unchanged", "flags_unchanged"):
        original = getattr(Traced, name)
        monkeypatch.setattr(Traced, name, lambda self, original=original: (walks.append(1), original(self))[1])
    for call in range(12):
        sm.train(call % 2 == 0)
        x = torch.randn(5, 4)
        sm(x)
        assert_path(sm, "recorded", "plan")
        if call >= 2:
            assert walks == [], f"call {call}: a mode switch walked the traces' modules or flags"
    # Anything else still does: a flag of a traced-through module set.
    model.scale = 2.0
    sm(torch.randn(5, 4))
    assert walks, "a watched flag set no longer re-checks the traces"
    model.eval()
    x = torch.randn(5, 4)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded", "plan")
