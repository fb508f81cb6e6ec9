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
from streamsched.frontend.binder import ShapeCachedBinder as _Binder
from streamsched.frontend.trace import CallBinder
from streamsched.module import StreamScheduledModule

from .helpers import assert_close


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
    original = StreamScheduledModule._revalidate
    monkeypatch.setattr(StreamScheduledModule, "_revalidate", lambda self: (checks.append(1), original(self))[1])
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
