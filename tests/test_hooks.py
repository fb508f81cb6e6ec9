"""Module hooks fire as in eager: on submodules the trace goes through, on fused members,
registered before or after the first calls, and on the wrapped model itself."""

from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss

from .helpers import assert_close, grads


class _Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        return self.out(torch.relu(self.inner(x)))


class _Towers(nn.Module):
    """Four alike towers (fused when nothing stops it) read one input."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(_Tower() for _ in range(4))

    def forward(self, x):
        return torch.stack([t(x) for t in self.towers]).sum(0)


def _pair(**config):
    torch.manual_seed(0)
    model = _Towers()
    return model, copy.deepcopy(model), config


def _register(model: nn.Module, path: str, log: list, kind: str = "forward"):
    module = model.get_submodule(path)
    if kind == "forward":
        return module.register_forward_hook(lambda m, args, out: log.append(out.detach().clone()))
    if kind == "scale":
        return module.register_forward_hook(lambda m, args, out: out * 3.0)
    if kind == "pre":
        return module.register_forward_pre_hook(lambda m, args: (args[0] * -1.0,))
    if kind == "backward":
        return module.register_full_backward_hook(lambda m, gin, gout: log.append(gout[0].detach().clone()))
    raise ValueError(kind)


def _step(sm, ref, train: bool):
    x = torch.randn(3, 8)
    if not train:
        with torch.no_grad():
            assert_close(sm(x), ref(x))
        return
    for m in (sm.module, ref):
        m.zero_grad(set_to_none=True)
    sm(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    g_a, g_e = grads(sm.module), grads(ref)
    assert g_a.keys() == g_e.keys()
    for name in g_e:
        assert_close(g_a[name], g_e[name], what=name)


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("executor", ["serial", "threads", "streams"])
@pytest.mark.parametrize("path", ["towers.1", "towers.2.inner"], ids=["traced-through", "leaf"])
@pytest.mark.parametrize("kind", ["forward", "scale", "pre", "backward"])
def test_hooks_registered_before_wrapping_fire_every_call(executor, path, kind):
    model, ref, config = _pair(executor=executor)
    seen, expected = [], []
    _register(model, path, seen, kind)
    _register(ref, path, expected, kind)
    sm = ss.StreamScheduledModule(model, **config)
    for _ in range(3):
        seen.clear()
        expected.clear()
        _step(sm, ref, train=kind == "backward")
        assert len(seen) == len(expected)
        for a, e in zip(seen, expected):
            assert type(a) is torch.Tensor
            assert_close(a, e)


@pytest.mark.parametrize("path", ["towers.1", "towers.2.inner"], ids=["traced-through", "fused-member"])
@pytest.mark.parametrize("kind", ["forward", "scale", "pre"])
def test_hooks_registered_after_planning_fire_and_removing_them_restores_eager(path, kind):
    model, ref, config = _pair(executor="serial")
    sm = ss.StreamScheduledModule(model, **config)
    for _ in range(2):
        _step(sm, ref, train=False)
    assert sm.plan.fused_groups, "the towers fuse before any hook"
    seen, expected = [], []
    handle = _register(model, path, seen, kind)
    ref_handle = _register(ref, path, expected, kind)
    for _ in range(2):
        seen.clear()
        expected.clear()
        _step(sm, ref, train=False)
        assert len(seen) == len(expected)
        for a, e in zip(seen, expected):
            assert_close(a, e)
    handle.remove()
    ref_handle.remove()
    _step(sm, ref, train=False)
    _step(sm, ref, train=True)


def test_hooks_on_the_wrapped_model_fire_and_say_so_once():
    model, ref, config = _pair(executor="serial")
    sm = ss.StreamScheduledModule(model, **config)
    _step(sm, ref, train=False)
    pre = model.register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))
    ref.register_forward_pre_hook(lambda m, args: (args[0] + 1.0,))
    with pytest.warns(ss.HooksWarning, match="_Towers has hooks"):
        _step(sm, ref, train=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _step(sm, ref, train=True)
    pre.remove()
    ref._forward_pre_hooks.clear()
    _step(sm, ref, train=False)
    _step(sm, ref, train=False)
    assert sm.plan.fused_groups, "scheduled again once the hook is gone"


def test_global_module_hooks_see_every_module_call():
    model, ref, config = _pair(executor="serial")
    sm = ss.StreamScheduledModule(model, **config)
    _step(sm, ref, train=False)
    calls: list[str] = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, args, out: calls.append(type(m).__name__))
    try:
        with pytest.warns(ss.HooksWarning, match="global module hooks"):
            with torch.no_grad():
                sm(torch.randn(3, 8))
        wrapped_calls = list(calls)
        calls.clear()
        with torch.no_grad():
            ref(torch.randn(3, 8))
        assert wrapped_calls == calls + ["StreamScheduledModule"], (wrapped_calls, calls)
    finally:
        handle.remove()
    _step(sm, ref, train=False)


def test_hooked_members_are_not_fused():
    model, ref, config = _pair(executor="serial")
    log: list = []
    _register(model, "towers.0.inner", log)
    sm = ss.StreamScheduledModule(model, **config)
    _step(sm, ref, train=False)
    _step(sm, ref, train=False)
    fused = [name for g in sm.plan.fused_groups for name in g.members]
    assert "towers.0.inner" not in fused and fused
    assert len(log) == 2


# --- output-capturing hooks on a leaf that returns a tuple ---------------------------
#
# transformers collects ``output_hidden_states`` / ``output_attentions`` through forward
# hooks (``transformers.utils.output_capturing``) that take item ``index`` of a layer's
# output when it is a tuple, and the whole output otherwise. The trace fires such hooks
# on a leaf's proxy; a bare proxy is no tuple, so the hook took the whole output.

_collected = None


def _capturing_hook(index):
    def output_capturing_hook(module, args, output):
        if _collected is None:
            return
        _collected.append(output if not isinstance(output, tuple) else output[index])

    # What the library recognises as a capture hook: transformers' module.
    output_capturing_hook.__module__ = "transformers.utils.output_capturing"
    return output_capturing_hook


class _TupleLayer(nn.Module):
    """Returns ``(hidden, gate)``, as the layers of an encoder-decoder MoE do."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        return h, self.gate(h)


class _Capturing(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.layers = nn.ModuleList(_TupleLayer() for _ in range(3))
        for layer in self.layers:
            layer.register_forward_hook(_capturing_hook(index))

    def forward(self, x, collect: bool = False):
        global _collected
        _collected = [] if collect else None
        try:
            for layer in self.layers:
                x, _ = layer(x)
            return x, tuple(_collected) if collect else None
        finally:
            _collected = None


@pytest.mark.parametrize("index", [0, -1])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_capture_hooks_of_a_leaf_see_its_tuple(executor, index):
    torch.manual_seed(0)
    model = _Capturing(index)
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=(_TupleLayer,))
    for call in range(4):
        x = torch.randn(4, 8)
        out = sm(x, collect=True)
        path = ss.testing.last_path(sm)
        expected = model(x, collect=True)
        captured, want = out[1], expected[1]
        assert len(captured) == len(want) == 3
        for i, (c, w) in enumerate(zip(captured, want)):
            assert isinstance(c, torch.Tensor), f"call {call} ({path}): captured item {i} is a {type(c).__name__}"
            assert_close(c, w, what=f"call {call} ({path}): captured item {i}")
        assert_close(out[0], expected[0], what=f"call {call} ({path})")
    assert path.startswith("plan"), path


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh())

    def forward(self, x):
        return torch.stack([t(x) for t in self.towers]).sum(0) + self.head(x)


@pytest.mark.parametrize("with_kwargs", [False, True])
def test_a_hook_held_for_one_call_leaves_the_plans_without_it_in_place(monkeypatch, with_kwargs):
    # A hook registered for one call and removed (activations logged every N steps) used
    # to drop every trace and plan twice: at the registration and at the removal, each
    # re-traced, recorded and planned again (the branchy model below ran at 0.12x eager
    # with a hook held for one call in twenty). Plans are keyed by the hooks the modules
    # hold (handles are never reused): the plans without the hook stay in place.
    import streamsched.new_signatures as new_signatures
    from streamsched.testing import assert_path

    model = Towers()
    sm = ss.StreamScheduledModule(model, executor="serial")
    traced = []
    original = new_signatures.trace_model
    monkeypatch.setattr(new_signatures, "trace_model", lambda *a, **k: (traced.append(1), original(*a, **k))[1])
    for _ in range(2):  # planned without the hook first
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x))
    fired = []
    for cycle in range(4):
        kind = {"with_kwargs": True, "always_call": True} if with_kwargs else {}
        hook = (lambda m, a, k, o: (fired.append(1), o * 2)[1]) if with_kwargs else (lambda m, a, o: fired.append(1))
        handle = model.towers[1].register_forward_hook(hook, **kind)
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=f"cycle {cycle}, hooked")
        assert_path(sm, "recorded", "plan")
        assert len(fired) == 2 * cycle + 2  # once for the wrapper's call, once for eager's
        handle.remove()
        before = len(traced)
        for _ in range(2):
            x = torch.randn(4, 8)
            assert_close(sm(x), model(x), what=f"cycle {cycle}, unhooked")
            assert_path(sm, "plan")
        assert len(traced) == before, f"cycle {cycle}: removing the hook re-traced the model"
    assert len(fired) == 8


def test_a_hook_held_for_one_call_runs_as_written_under_auto_and_a_kept_one_is_planned(monkeypatch):
    # Under executor="auto", a call whose modules hold hooks its structure has not met
    # runs the model as written (the hooks fire as in eager) instead of tracing,
    # recording and planning for hooks that are gone on the next call; hooks that stay
    # are planned when the structure comes back with them.
    import streamsched.new_signatures as new_signatures
    from streamsched.testing import assert_path

    model = Towers()
    sm = ss.StreamScheduledModule(model)
    for _ in range(3):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x))
    traced = []
    original = new_signatures.trace_model
    monkeypatch.setattr(new_signatures, "trace_model", lambda *a, **k: (traced.append(1), original(*a, **k))[1])
    fired = []
    for cycle in range(3):
        handle = model.towers[0].register_forward_hook(lambda m, a, o: fired.append(1))
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=f"cycle {cycle}")
        assert_path(sm, "as-written")
        handle.remove()
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=f"cycle {cycle}, after")
    assert traced == [] and len(fired) == 6
    handle = model.towers[0].register_forward_hook(lambda m, a, o: o * 3)
    for call in range(3):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=f"kept hook, call {call}")
        assert_path(sm, "as-written" if call == 0 else "recorded" if call == 1 else "plan", "as-written")
    assert traced == [1]
    handle.remove()


class UnpacksWhatAHookReturns(Towers):
    def forward(self, x):
        first = self.towers[0](x)
        if isinstance(first, tuple):  # a hook on towers[0] returns (output, extra)
            first = first[0] + first[1]
        return torch.stack([first] + [t(x) for t in self.towers[1:]]).sum(0) + self.head(x)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_hook_that_returns_a_tuple_reaches_the_traced_code_as_one(executor):
    # The hooked module is one call, whose value the trace sees as a proxy:
    # ``isinstance(first, tuple)`` was false while tracing, and the graph handed the
    # tuple to torch.stack, which raised on every call while the hook was on.
    from streamsched.testing import assert_path

    model = UnpacksWhatAHookReturns()
    sm = ss.StreamScheduledModule(model, executor=executor)
    handle = model.towers[0].register_forward_hook(lambda m, a, o: (o, o * 2))
    for call in range(4):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=f"call {call}")
        assert_path(sm, "recorded", "plan")
    handle.remove()
    x = torch.randn(4, 8)
    assert_close(sm(x), model(x), what="hook removed")


# --- output-capturing hooks inside a module run as one call ---------------------------


class _Collector:
    """Stands for transformers' ``_active_collector``: what the decorated forward sets
    while it collects outputs."""

    def __init__(self):
        self.value = None

    def get(self):
        return self.value


def _attention_capture_hook(collector):
    def output_capturing_hook(module, args, output):
        collected = collector.get()
        if collected is not None:
            collected.append(output)

    output_capturing_hook.__module__ = "transformers.utils.output_capturing"
    return output_capturing_hook


class _Block(nn.Module):
    """A block whose inner ``attn`` holds the capture hook (transformers records
    attentions on attention modules inside each layer)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        return x + self.mlp(torch.relu(self.attn(x)))


# Module-level, as transformers' context variable is (not held by the model).
_COLLECTOR = _Collector()


class _CollectsInsideBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        for block in self.blocks:
            block.attn.register_forward_hook(_attention_capture_hook(_COLLECTOR))

    def forward(self, x, collect: bool = False):
        previous = _COLLECTOR.value
        _COLLECTOR.value = [] if collect else None
        try:
            for block in self.blocks:
                x = block(x)
            return x, tuple(_COLLECTOR.value) if collect else ()
        finally:
            _COLLECTOR.value = previous


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_outputs_collected_inside_a_module_run_as_one_call_reach_the_output(monkeypatch, executor):
    """A block run as one call (a leaf here; an opaque class in transformers' models) would
    run its inner capture hooks where nothing collects: the outputs its attention layers
    hand over were silently missing (SwitchTransformers' output_attentions after an
    output_hidden_states call). While outputs are collected, such a block's caller runs
    as written."""
    import types

    stub = types.ModuleType("transformers.utils.output_capturing")
    stub._active_collector = _COLLECTOR
    monkeypatch.setitem(sys.modules, "transformers.utils.output_capturing", stub)
    torch.manual_seed(0)
    model = _CollectsInsideBlocks()
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=(_Block,))
    for call in range(4):
        x = torch.randn(4, 8)
        collect = call % 2 == 1
        out, expected = sm(x, collect=collect), model(x, collect=collect)
        path = ss.testing.last_path(sm)
        assert len(out[1]) == len(expected[1]) == (3 if collect else 0), f"call {call} ({path})"
        for got, want in zip(out[1], expected[1]):
            assert_close(got, want, what=f"call {call} ({path})")
        assert_close(out[0], expected[0], what=f"call {call} ({path})")
    sm(torch.randn(4, 8), collect=False)
    assert ss.testing.last_path(sm).startswith("plan"), "calls collecting nothing are still planned"
