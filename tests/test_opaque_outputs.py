"""What opaque calls return: a ``None`` (or a constant) where the trace saw a proxy.

A leaf call's value is a proxy while tracing, and ``if g is not None:`` is true of a
proxy: the trace took the branch eager never takes and fed ``None`` to a Linear (XLNet's
relative attention returns ``(h, None)``). The recording call finds such values, the
trace learns the call's structure and is made again, and the call goes on in the new
graph; later calls check the structure: another one runs the call as written (or, where
the plan wrote state before the check, is refused loudly)."""

from __future__ import annotations

import copy
from typing import Optional

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


class Flaky(nn.Module):
    """``(2x, x)`` for inputs of positive sum, ``(2x, None)`` else: its structure is the
    data's (transformers' mask builders return ``None`` for a batch without padding and a
    mask for one with padding, of the same shape)."""

    def forward(self, x):
        return x * 2, (x if x.sum() > 0 else None)


class FlakyModel(nn.Module):
    def __init__(self, before: Optional[nn.Module] = None):
        super().__init__()
        self.before = before if before is not None else nn.Identity()
        self.flaky = Flaky()
        self.lin = nn.Linear(8, 8)
        self.out = nn.Linear(8, 8)

    def forward(self, x):
        a, b = self.flaky(self.before(x))
        if b is not None:
            a = a + self.lin(b)
        return self.out(a)


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_a_structure_that_changes_between_calls_of_one_signature_runs_as_written(executor):
    """A plan made for ``(tensor, None)`` meets ``(tensor, tensor)``: its check stops it
    before the code that reads the value, and the call (and the signature's later ones)
    run the model as written, equal to eager, instead of raising."""
    model = FlakyModel()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=[Flaky])
    for call in range(10):
        x = -torch.rand(3, 8) if call < 4 or call == 8 else torch.rand(3, 8)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        out, expected = sm(x), ref(x)
        assert_close(out, expected, what=f"call {call}")
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"grad {name} (call {call})")
        if call == 0:
            assert_path(sm, "recorded")
        elif call < 6:  # the auto trial may run the model as written meanwhile
            assert_path(sm, "plan:serial", *(("as-written",) if executor == "auto" or call > 3 else ()))
        else:
            assert_path(sm, "as-written")
    assert sm.plan.executor == "eager" and "output structure changed" in sm.plan.reason, sm.plan.reason


def test_a_plan_writing_only_what_the_call_allocated_runs_as_written_when_stopped():
    """A write in place into a tensor the call made itself (a mixture of experts adds
    each expert's rows into a ``zeros`` of its own with ``index_add_``) leaves nothing
    behind when the plan is stopped: the call runs as written, as with no write."""

    class Scatter(nn.Module):
        def forward(self, x):
            out = torch.zeros_like(x)
            out.index_add_(0, torch.arange(x.shape[0]), x * 3)
            return out

    model = FlakyModel(Scatter())
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Flaky])
    for call in range(5):
        x = -torch.rand(3, 8) if call < 3 else torch.rand(3, 8)
        assert_close(sm(x), ref(x), what=f"call {call}")
    assert_path(sm, "as-written")


def test_the_random_numbers_a_stopped_plan_drew_are_put_back():
    """Dropout before the check draws its mask in the plan, which then stops: the call
    run as written draws the same mask eager does."""
    model = FlakyModel(nn.Dropout(0.5)).train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Flaky])
    for call in range(4):
        x = (-torch.rand(3, 8) - 1) if call < 2 else (torch.rand(3, 8) + 1)
        torch.manual_seed(call)
        out = sm(x)
        torch.manual_seed(call)
        expected = ref(x)
        assert_close(out, expected, what=f"call {call}")
    assert_path(sm, "as-written")


def test_a_structure_that_changes_after_a_plan_wrote_state_puts_the_state_back():
    """A module counting its calls in a buffer updates it before the check: the plan saved
    the buffer before the call (written_state), puts it back when the check stops it, and
    the call runs as written, counting it once, as eager does."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x):
            self.calls.add_(1)
            return x

    model = FlakyModel(Counting())
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Flaky])
    negative = -torch.rand(3, 8)
    for x in (negative, negative):
        assert_close(sm(x), ref(x))
    assert_path(sm, "plan:serial")
    x = torch.rand(3, 8)
    assert_close(sm(x), ref(x))  # (tensor, tensor): the trace would skip eager's branch
    assert_path(sm, "as-written")
    assert float(model.before.calls) == float(ref.before.calls) == 3


COUNTED = torch.zeros(())


def test_a_structure_that_changes_after_a_plan_wrote_state_it_cannot_find_again_is_refused_loudly():
    """A leaf writing a tensor only a global holds: the plan cannot find it again to save
    it, and a stopped call raises instead of counting twice."""

    class CountsGlobally(nn.Module):
        def forward(self, x):
            COUNTED.add_(1)
            return x

    COUNTED.zero_()
    model = FlakyModel(CountsGlobally())
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Flaky, CountsGlobally])
    negative = -torch.rand(3, 8)
    sm(negative)
    sm(negative)
    assert_path(sm, "plan:serial")
    with pytest.raises(OpaqueOutputChanged, match="flaky"):
        sm(torch.rand(3, 8))
    assert float(COUNTED) == 3


def test_a_new_size_whose_structure_is_not_the_learned_one_is_learned_again():
    """The learned structure holds for the call structure, all sizes: a mask builder
    returning ``None`` up to a window length and a mask beyond it (a sliding-window
    decoder generating without a cache) meets the other structure on the recording call
    of a new size, which learns it and records the call (not raise)."""

    class Window(nn.Module):
        def forward(self, x):
            return x * 2, (x if x.shape[0] > 4 else None)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.window = Window()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            a, b = self.window(x)
            if b is not None:
                a = a + self.lin(b)
            return a

    model = Model()
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Window])
    seen = set()
    for rows in (3, 3, 6, 6, 3, 6, 2, 2):
        x = torch.randn(rows, 8)
        assert_close(sm(x), model(x), what=f"{rows} rows")
        # 2 rows: recorded with the structure learned at 6 rows, learned again.
        assert_path(sm, "plan:serial" if rows in seen else "recorded")
        seen.add(rows)


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

    # With strict=True the recording call raises; by default (test_recording_abandoned)
    # the call runs as written with an UntraceableWarning naming the same problem.
    model = Model()
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Boxed], strict=True)
    with pytest.raises(TraceError, match="'boxed' \\(an opaque call\\) returned a Box"):
        sm(torch.randn(3, 8))
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Boxed])
    x = torch.randn(3, 8)
    with pytest.warns(ss.UntraceableWarning, match="'boxed' \\(an opaque call\\) returned a Box"):
        out = sm(x)
    assert torch.equal(out, model(x))


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


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_a_tensor_on_the_recording_call_then_none_runs_as_written(executor):
    """The opposite change: the recording call's value is ``(tensor, tensor)``, which the
    proxy stood for, so the trace went on through ``if b is not None:``; a later call of
    the signature returns ``(tensor, None)``. The plan's check on what the leaf returned
    stops it before ``self.lin(None)``, and the call (and the signature's later ones) run
    the model as written, equal to eager, instead of raising a TypeError."""
    model = FlakyModel()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=[Flaky])
    for call in range(10):
        x = torch.rand(3, 8) if call < 4 or call == 8 else -torch.rand(3, 8)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        out, expected = sm(x), ref(x)
        assert_close(out, expected, what=f"call {call}")
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"grad {name} (call {call})")
        if call == 0:
            assert_path(sm, "recorded")
        elif call < 4:  # the auto trial may run the model as written meanwhile
            assert_path(sm, "plan:serial", *(("as-written",) if executor == "auto" else ()))
        else:
            assert_path(sm, "as-written")
    assert sm.plan.executor == "eager" and "output structure changed" in sm.plan.reason, sm.plan.reason


def test_a_tensor_then_none_before_a_call_the_recording_learned():
    """The same, where a later leaf call's ``None`` made the recording call trace again:
    what it noted of the calls before that one holds in the new trace."""

    class HalfNone(nn.Module):
        def forward(self, x):
            return x + 1, None

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.flaky, self.pair = Flaky(), HalfNone()
            self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            a, b = self.flaky(x)
            if b is not None:
                a = a + self.lin(b)
            h, g = self.pair(a)
            if g is not None:
                h = h + self.lin(g)
            return self.out(h)

    model = Model()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Flaky, HalfNone])
    for call in range(5):
        x = torch.rand(3, 8) if call < 3 else -torch.rand(3, 8)
        assert_close(sm(x), ref(x), what=f"call {call}")
        assert_path(sm, "recorded" if call == 0 else "plan:serial" if call < 3 else "as-written")
    assert len(_checks(sm)) == 2


class _Settings:
    weights = False


class _MaybeWeights(nn.Module):
    """Returns ``(h, weights)``, ``weights`` ``None`` unless the shared settings ask for
    them (transformers' attention modules under ``attn_implementation="sdpa"`` and
    ``"eager"``, read from the config every layer holds)."""

    def __init__(self, settings):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.settings = settings

    def forward(self, x):
        h = self.q(x)
        return h, (h.softmax(-1) if self.settings.weights else None)


class _ReadsTheFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.settings = _Settings()
        self.attn = _MaybeWeights(self.settings)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h, _ = self.attn(x)
        return self.a(h) + self.b(h)


@pytest.mark.parametrize("executor", ["serial", "auto"])
def test_a_learned_none_becoming_a_tensor_nothing_reads_is_learned_again(executor):
    # Learned (h, None) while eval and train signatures were planned; then the settings
    # make it return (h, weights). Traced again for the new structure, the program is the
    # same (nothing reads the second item): only its check's structure differs, and the
    # new trace must be taken (it raised TraceError: "did not change the trace").
    torch.manual_seed(0)
    model = _ReadsTheFirst()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=[_MaybeWeights])
    x = torch.randn(2, 8)
    calls = [("eval", False)] * 4 + [("train", False)] * 3 + [("eval", True)] * 3
    calls += [("train", True)] * 2 + [("eval", False)] * 2 + [("eval", True)] * 2
    for mode, weights in calls:
        for m in (model, ref):
            m.train(mode == "train")
            m.settings.weights = weights
        with torch.set_grad_enabled(mode == "train"):
            assert_close(sm(x), ref(x), atol=1e-6)


def test_a_new_call_structure_starts_from_what_the_others_learned(monkeypatch):
    """Each leaf's ``(h, None)`` is learned by the first call structure's recording call;
    another structure (inputs of another rank) starts its trace from it, with no trace
    and recording call again per leaf; a guess that is wrong (``g`` given: ``(h, g)``) is
    learned again as it would be with no guess, and every output equals eager's."""
    from streamsched.frontend.trace import Traced

    relearned = []
    relearn = Traced.relearn

    def counted(self, node, value):
        relearned.append(node)
        return relearn(self, node, value)

    monkeypatch.setattr(Traced, "relearn", counted)
    model = TwoStream().eval()
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[Attention])
    calls = (
        (lambda: (torch.randn(5, 8),), 3),  # one per layer's attention
        (lambda: (torch.randn(2, 5, 8),), 0),  # guessed right
        (lambda: (torch.randn(5, 8), torch.randn(5, 8)), 3),  # guessed wrong: learned
    )
    with torch.no_grad():
        for make, expected in calls:
            relearned.clear()
            for call in range(2):
                args = make()
                assert_close(sm(*args), model(*args))
                assert_path(sm, "recorded" if call == 0 else "plan:serial")
            assert len(relearned) == expected, [n.name for n in relearned]


def _recorded_then_planned_at_each_rank(model: nn.Module, leaf: type) -> ss.StreamScheduledModule:
    """Two calls with rank-2 inputs, then two with rank-3 (another call structure, whose
    trace starts from what the first learned): each structure's first call is its
    recording call, its second runs the plan, both equal to eager."""
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=[leaf])
    for shape in ((4, 8), (2, 4, 8)):
        for call in range(2):
            x = torch.randn(*shape)
            assert_close(sm(x), model(x))
            assert_path(sm, "recorded" if call == 0 else "plan:serial")
    return sm


def test_a_wrong_guess_that_only_changes_the_check_is_learned():
    """A leaf returns ``(y, None)`` under one call structure and ``(y, tensor)`` under
    another, whose second item nothing reads: the second structure's trace guessed the
    first's, the recording call finds a tensor, and the trace learned again is the same
    program with another check: progress, not a failure (the guess was what it took)."""

    class Gate(nn.Module):
        def forward(self, x):
            return x + 1, (x if x.dim() == 3 else None)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            a, _b = self.gate(x)
            return self.lin(a)

    _recorded_then_planned_at_each_rank(Model(), Gate)


def test_a_guess_the_traced_code_cannot_read_is_traced_without():
    """A leaf returns ``(y, None)`` under one call structure and a bare tensor under
    another, whose code computes with it: the guess (a tuple) would fail that trace, so
    the structure is traced as with no guess, and planned as before."""

    class Gate(nn.Module):
        def forward(self, x):
            return (x + 1, None) if x.dim() == 2 else x * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = Gate()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            y = self.gate(x)[0] if x.dim() == 2 else self.gate(x)
            y = y * 1.5  # a tuple here fails the trace
            return self.a(y) + self.b(y)

    sm = _recorded_then_planned_at_each_rank(Model(), Gate)
    assert all(not traced.opaque for traced in sm._ss.traces.values())  # nothing made opaque for it
