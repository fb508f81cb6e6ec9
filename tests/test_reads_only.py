"""A recording call whose every op only reads runs without the effect recorder
(``frontend.effects.reads_only``): plain tensors through ``torch.nn`` modules that write
nothing (``Linear``, non-inplace activations, eval ``Dropout``...), basic slices,
``torch.cat`` / ``torch.stack``. Its effects are then none, as the recorder would have
found them: the plan, its graph, schedule and effects, and the call's output are those
of a call recorded op by op. Any call that may write (an inplace activation, an in-place
op, a hook, training dropout, a tensor subclass, a dispatch mode, a parameter read as an
attribute) is recorded op by op, and its writes are ordered.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamsched as ss
import streamsched.new_signatures as new_signatures
from benchmarks.zoo import CriticEnsemble, ParallelFCN
from streamsched.frontend import node_meta
from streamsched.planning import signatures
from streamsched.testing import last_path

D = 12


class Reading(nn.Module):
    """Every module class and function the rule knows, none of them writing."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(D, 2 * D)
        self.norm = nn.LayerNorm(2 * D)
        self.acts = nn.ModuleList(
            [nn.GELU(), nn.Tanh(), nn.ReLU(), nn.SiLU(), nn.Hardtanh(), nn.LeakyReLU(), nn.Identity(), nn.Sigmoid()]
        )
        self.heads = nn.ModuleList(nn.Linear(D // 4, 3) for _ in range(8))
        self.conv = nn.Conv1d(1, 2, 3, padding=1)
        self.drop = nn.Dropout(0.5)
        self.soft = nn.Softmax(dim=-1)

    def forward(self, x):
        h = self.norm(self.stem(x))
        parts = [a(h[:, 3 * i : 3 * i + 3]) for i, a in enumerate(self.acts)]
        heads = [m(self.drop(h[:, 3 * i : 3 * i + 3])) for i, m in enumerate(self.heads)]
        c = self.conv(h[:, None, :6])
        return torch.cat([*parts, *heads], dim=1), self.soft(torch.stack(heads, 0)), c[0]


def _flat(v):
    return [v] if isinstance(v, torch.Tensor) else [t for x in v for t in _flat(x)]


def _record(make, x, monkeypatch, force=None, grad=False, **config):
    """Wrap a fresh model (seeded) and call it until a call records; returns the
    wrapper, the recorded call's output, eager's, and the rule's verdicts (``force``:
    the verdict the rule is made to give)."""
    verdicts = []
    real = new_signatures.reads_only

    def spy(graph, resolve, inputs):
        verdict = real(graph, resolve, inputs) if force is None else force
        verdicts.append(verdict)
        return verdict

    monkeypatch.setattr(new_signatures, "reads_only", spy)
    # (A chain in inference is decided as written with nothing recorded: recorded here.)
    monkeypatch.setattr(signatures, "CHAIN_AS_WRITTEN", False)
    torch.manual_seed(0)
    model = make()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, **config)
    with torch.enable_grad() if grad else torch.no_grad():
        for _ in range(3):
            out = sm(x)
            if last_path(sm) == "recorded":
                break
        assert last_path(sm) == "recorded"
        ref = eager(x)
    monkeypatch.setattr(new_signatures, "reads_only", real)
    return sm, out, ref, verdicts


def _leaf_calls(sm):
    traced = next(iter(sm._ss.traces.values()))
    return [(n.name, node_meta.leaf_calls(n)) for n in traced.graph.nodes]


def _planned(sm):
    compiled = sm._ss.last
    schedule = compiled.schedule
    effects = schedule.effects
    return (
        str(sm.plan),
        repr(sm.plan.model_dump()),
        str(compiled.graph),
        repr([(t.name, [n.name for n in t.nodes], t.stream, t.waits, t.records) for t in schedule.tasks]),
        repr((effects.after, effects.reads, effects.writes, effects.writes_inputs, effects.writes_state)),
    )


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return self.fc(x)


class PastALeaf(nn.Module):
    """Calls a module inside a leaf module (``leaf_modules=[Block]``) directly: the
    leaf-call counter puts no hook in it, and its call counts no leaf call."""

    def __init__(self):
        super().__init__()
        self.block, self.out = Block(), nn.Linear(D, D)

    def forward(self, x):
        return self.out(self.block.fc(x))


READING = [
    ("pfcn", lambda: ParallelFCN(16).eval(), lambda: torch.randn(2, 16 * 20), False),
    ("past_a_leaf", lambda: PastALeaf().eval(), lambda: torch.randn(3, D), False),
    ("pfcn_train_grad", lambda: ParallelFCN(8), lambda: torch.randn(3, 8 * 20), True),
    ("critics", lambda: CriticEnsemble(4).eval(), lambda: torch.randn(5, 23), False),
    ("reading", lambda: Reading().eval(), lambda: torch.randn(4, D), False),
    ("reading_grad", lambda: Reading().eval(), lambda: torch.randn(4, D), True),
]


@pytest.mark.parametrize("name,make,inputs,grad", READING, ids=[c[0] for c in READING])
def test_a_reading_call_plans_as_one_recorded_op_by_op(name, make, inputs, grad, monkeypatch):
    torch.manual_seed(1)
    x = inputs()
    config = {"leaf_modules": [Block]} if name == "past_a_leaf" else {}
    sm, out, ref, verdicts = _record(make, x, monkeypatch, grad=grad, **config)
    assert verdicts == [True], "the call should have run without the recorder"
    for a, b in zip(_flat(out), _flat(ref)):
        assert torch.equal(a, b)
    by_ops, out_ops, _, forced = _record(make, x, monkeypatch, force=False, grad=grad, **config)
    assert forced == [False]
    assert _planned(sm) == _planned(by_ops)
    # The leaf calls each node made, as the counter counts them op by op.
    assert _leaf_calls(sm) == _leaf_calls(by_ops)
    if name == "past_a_leaf":
        assert [count for _, count in _leaf_calls(sm)] == [0, 0, 1, 0]  # x, block.fc, out, output
    for a, b in zip(_flat(out), _flat(out_ops)):
        assert torch.equal(a, b)
    # Later calls run the plan, as eager computes.
    with torch.enable_grad() if grad else torch.no_grad():
        x2 = inputs()
        for a, b in zip(_flat(sm(x2)), _flat(copy.deepcopy(by_ops.module)(x2))):
            torch.testing.assert_close(a, b)


class InplaceRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h)  # reads h before the write
        return y, self.relu(h)


class MethodWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.a(x)
        y = self.b(h)
        h.mul_(2)
        return y, h


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
        self.b.register_forward_hook(lambda m, args, out: args[0].mul_(3))  # writes a's output

    def forward(self, x):
        h = self.a(x)
        return self.b(h), h


class TrainingDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.drop = nn.Linear(D, D), nn.Dropout(0.0, inplace=True)

    def forward(self, x):
        return self.drop(self.a(x))


class AttributeRead(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.w = nn.Parameter(torch.randn(D, D))

    def forward(self, x):
        return self.a(x) @ self.w


class OneLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)

    def forward(self, x):
        return self.a(x)


class _Tensor(torch.Tensor):
    pass


class _Passing(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


# (whether the recorded call writes in place: its effects name the writes)
WRITING = [
    ("inplace_relu", lambda: InplaceRelu().eval(), True),
    ("method_write", lambda: MethodWrite().eval(), True),
    ("forward_hook", lambda: Hooked().eval(), True),
    ("training_dropout", lambda: TrainingDropout(), False),
    ("attribute_read", lambda: AttributeRead().eval(), False),
]


@pytest.mark.parametrize("name,make,writes", WRITING, ids=[c[0] for c in WRITING])
def test_a_call_that_may_write_is_recorded_op_by_op(name, make, writes, monkeypatch):
    x = torch.randn(4, D)
    sm, out, ref, verdicts = _record(make, x, monkeypatch)
    assert verdicts == [False]
    for a, b in zip(_flat(out), _flat(ref)):
        torch.testing.assert_close(a, b)
    if writes:
        assert sm._ss.last.schedule.effects.writes
    with torch.no_grad():
        x2 = torch.randn(4, D)
        for a, b in zip(_flat(sm(x2)), _flat(copy.deepcopy(sm.module)(x2))):
            torch.testing.assert_close(a, b)


def test_a_global_hook_a_mode_or_a_subclass_input_makes_the_call_recorded_op_by_op():
    from streamsched.frontend.effects import reads_only
    from streamsched.frontend.nodes import submodule_resolver

    model = OneLinear().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        sm(torch.randn(4, D))
        sm(torch.randn(4, D))  # (the first call ran as written; this one traced)
    traced = next(t for t in sm._ss.traces.values())
    resolve = submodule_resolver(traced.root)
    plain = [torch.randn(4, D)]
    assert reads_only(traced.graph, resolve, plain)
    assert not reads_only(traced.graph, resolve, [torch.randn(4, D).as_subclass(_Tensor)])
    with _Passing():
        assert not reads_only(traced.graph, resolve, plain)
    handle = nn.modules.module.register_module_forward_hook(lambda m, a, o: None)
    try:
        assert not reads_only(traced.graph, resolve, plain)
    finally:
        handle.remove()
    model.a.forward = lambda x: x.mul_(2)  # an instance's own forward
    assert not reads_only(traced.graph, resolve, plain)
    del model.a.forward
    model.a.register_forward_pre_hook(lambda m, a: None)
    assert not reads_only(traced.graph, resolve, plain)
