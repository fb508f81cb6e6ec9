"""What opaque calls return: a ``None`` (or a constant) where the trace saw a proxy.

A leaf call's value is a proxy while tracing, and ``if g is not None:`` is true of a
proxy: the trace took the branch eager never takes and fed ``None`` to a Linear (XLNet's
relative attention returns ``(h, None)``). The recording call finds such values, the
trace learns the call's structure and is made again, and the call goes on in the new
graph; later calls check the structure and refuse another one loudly."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.errors import TraceError
from streamsched.frontend.opaque_outputs import OpaqueOutputChanged, OutputCheck
from streamsched.testing import assert_path

from .helpers import assert_close


class Attention(nn.Module):
    """Returns ``(h, g)``, ``g`` ``None`` when not given (XLNet's two streams)."""

    def __init__(self, traceable: bool = True):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.traceable = traceable

    def forward(self, h, g=None):
        if not self.traceable and h.sum() > 1e9:  # data-dependent: fx cannot trace it
            h = h * 2
        out_g = None if g is None else self.q(g)
        return self.q(h), out_g


class Layer(nn.Module):
    def __init__(self, traceable: bool = True):
        super().__init__()
        self.attn = Attention(traceable)
        self.ff = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, h, g=None):
        h, g = self.attn(h, g)
        h = h + self.ff(h)
        if g is not None:
            g = g + self.ff(g)
        return h, g


class TwoStream(nn.Module):
    def __init__(self, layers: int = 3, traceable: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(Layer(traceable) for _ in range(layers))
        self.head = nn.Linear(8, 4)

    def forward(self, x, g=None):
        h = x
        for layer in self.layers:
            h, g = layer(h, g)
        out = self.head(h)
        return (out, g) if g is not None else out


def _check(model, make_input, calls=3, train=True, **config):
    """Wrapped vs eager, in lockstep, forward and backward, on fresh inputs; the calls
    after the first run the compiled plan."""
    model.train(train)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", **config)
    for call in range(calls):
        x = make_input()
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        out, expected = sm(x), ref(x)
        assert_path(sm, "recorded" if call == 0 else "plan:serial")
        assert type(out) is type(expected)
        assert_close(out, expected, what=f"call {call}")
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"grad {name} (call {call})")
    return sm


def _checks(sm):
    return [n.target for n in sm._ss.last.graph.nodes if isinstance(n.target, OutputCheck)]


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_a_leaf_module_returning_none_in_a_tuple_takes_eager_branch(train):
    sm = _check(TwoStream(), lambda: torch.randn(5, 8), train=train, leaf_modules=[Attention])
    assert len(_checks(sm)) == 3  # one per layer's attention, each checked every call


def test_a_class_made_opaque_returning_none_takes_eager_branch():
    sm = _check(TwoStream(traceable=False), lambda: torch.randn(5, 8))
    assert {o.path for o in sm.plan.opaque} == {f"layers.{i}.attn" for i in range(3)}
    assert len(_checks(sm)) == 3


def test_multihead_attention_without_weights():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            out, weights = self.mha(x, x, x, need_weights=False)
            if weights is not None:
                out = out + self.proj(weights.sum(-1, keepdim=True).expand_as(out))
            return out

    _check(Block(), lambda: torch.randn(2, 5, 8))


def test_a_whole_none_output_used_as_a_value():
    class MaybeNone(nn.Module):
        def forward(self, x):
            return None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.extra = MaybeNone()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            e = self.extra(x)
            y = self.lin(x)
            if e is not None:
                y = y + self.lin(e)
            return y

    sm = _check(Model(), lambda: torch.randn(3, 8), leaf_modules=[MaybeNone])
    assert len(_checks(sm)) == 1


def test_a_branch_on_none_that_reads_nothing_of_it():
    """Nothing in the graph reads the None: only its None-ness decided the branch."""

    class Pair(nn.Module):
        def forward(self, x):
            return x + 1, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h, extra = self.pair(x)
            if extra is not None:
                h = h * 2
            return self.lin(h)

    sm = _check(Model(), lambda: torch.randn(3, 8), leaf_modules=[Pair])
    assert len(_checks(sm)) == 1


def test_a_structure_that_changes_between_calls_is_refused_loudly():
    class Flaky(nn.Module):
        def forward(self, x):
            return x * 2, (x if x.sum() > 0 else None)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.flaky = Flaky()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            a, b = self.flaky(x)
            if b is not None:
                a = a + self.lin(b)
            return a

    sm = ss.StreamScheduledModule(Model(), executor="serial", leaf_modules=[Flaky])
    negative = -torch.rand(3, 8)
    assert_close(sm(negative), sm.module(negative))  # learns (tensor, None)
    assert_close(sm(negative), sm.module(negative))
    assert_path(sm, "plan:serial")
    with pytest.raises(OpaqueOutputChanged, match="flaky"):
        sm(torch.rand(3, 8))  # (tensor, tensor): the trace would skip eager's branch


def test_a_none_inside_an_object_the_trace_cannot_rebuild_is_refused():
    class Box:
        def __init__(self, h, g):
            self.h, self.g = h, g

    class Boxed(nn.Module):
        def forward(self, x):
            return Box(x * 2, None)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.boxed = Boxed()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            box = self.boxed(x)
            y = box.h
            if box.g is not None:
                y = y + self.lin(box.g)
            return y

    sm = ss.StreamScheduledModule(Model(), executor="serial", leaf_modules=[Boxed])
    with pytest.raises(TraceError, match="'boxed' \\(an opaque call\\) returned a Box"):
        sm(torch.randn(3, 8))


def test_what_was_learned_holds_per_mode():
    """A trace for another train/eval state learns again: a leaf may return another
    structure there."""

    class ModeGate(nn.Module):
        def forward(self, x):
            return x + 1, (x if self.training else None)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = ModeGate()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            a, b = self.gate(x)
            if b is not None:
                a = a + self.lin(b)
            return a

    model = Model()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[ModeGate])
    for train in (False, True, False, True):
        sm.train(train)
        ref.train(train)
        for _ in range(2):
            x = torch.randn(3, 8)
            assert_close(sm(x), ref(x))
        assert_path(sm, "plan:serial")


def test_a_branch_function_returning_none():
    @ss.branch
    def split(h):
        return h * 2, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h, extra = split(x)
            if extra is not None:
                h = h + self.lin(extra)
            return self.lin(h)

    sm = _check(Model(), lambda: torch.randn(3, 8))
    assert len(_checks(sm)) == 1


def test_numbers_beside_a_none_stay_values():
    """A leaf returning ``(h, None, count)``: the None is learned, the count (which changes
    from call to call) stays a value the graph computes with."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x + 1, None, self.calls

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.counting = Counting()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            h, extra, n = self.counting(x)
            if extra is not None:
                h = h + self.lin(extra)
            return self.lin(h) * n

    model = Model()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Counting])
    for _ in range(3):
        x = torch.randn(3, 8)
        assert_close(sm(x), ref(x))
    assert_path(sm, "plan:serial")
    assert model.counting.calls == ref.counting.calls == 3


def test_the_output_tree_names_the_container_of_each_leaf():
    """What decides whether a ``None`` field of an opaque call's ``ModelOutput`` may reach
    the output as a proxy stood for it: a ``ModelOutput`` (or dict) is rebuilt from its
    fields each call, a tuple or list the traced code built keeps the length it had."""
    from streamsched.frontend.output_tree import OutputTree

    class Pair(tuple):
        pass

    tree = OutputTree.of({"a": 1, "b": (2, [3, 4]), "c": Pair((5, 6))})
    assert tree.leaves == [1, 2, 3, 4, 5, 6]
    assert tree.leaf_parents() == [dict, tuple, list, list, Pair, Pair]
    assert OutputTree.of((1, None)).leaf_parents() == [tuple, tuple]
    assert OutputTree.of(7).leaf_parents() == [None]
