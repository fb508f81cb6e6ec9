"""``frontend.member_replay``: a member made from the first alike member's recording gets
exactly the trace a normal trace gives it.

Each model is traced with replay on and off (``member_replay.ENABLED``) and everything
compared: every node (name, op, target, arguments, users, type, ``meta``, label), the
generated code, the rank tracker's facts, fx's call counts and scopes, the leaf-call
counts, the traced-through modules and the graph's name counters. Each condition replay
rests on has a model built to break it (a global read, a hook, an instance ``forward``, a
plain attribute, a child that is a leaf in one member only...): the trace must be the
normal one, and the count of replayed members says which members were replayed.
"""

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import ParallelFCN
from streamsched.frontend import member_replay, trace
from streamsched.frontend.binder import CallBinder
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_fx_fast import _cases, _describe


def _trace(model, args, enabled, monkeypatch, leaf_types=()):
    """(traced, tracer) with replay on or off."""
    monkeypatch.setattr(member_replay, "ENABLED", enabled)
    seen = {}
    original = trace._LeafTracer.trace

    def capturing(self, root, concrete_args=None):
        seen["tracer"] = self
        return original(self, root, concrete_args)

    monkeypatch.setattr(trace._LeafTracer, "trace", capturing)
    binder = CallBinder(model)
    _, spec = binder.bind(args, {})
    ranks = tuple(a.dim() for a in args)
    traced = trace.trace_model(model, binder, spec, leaf_types=leaf_types, ranks=ranks)
    monkeypatch.setattr(trace._LeafTracer, "trace", original)
    return traced, seen["tracer"]


def _state(traced, tracer):
    graph = traced.graph
    ranks = tracer.ranks
    names = graph._graph_namespace
    return (
        _describe(graph),
        graph.python_code("self").src,
        traced.module_ids,
        traced.inlined_leaf_calls,
        [(type(m).__name__, values) for m, values in traced.flags if isinstance(m, nn.Module)],
        sorted((n.name, r) for n, r in ranks.rank.items()),
        sorted((n.name, str(d)) for n, d in ranks.dtypes.items()),
        sorted((n.name, sorted(map(repr, s))) for n, s in ranks.sources.items()),
        sorted(map(repr, ranks.assumed)),
        dict(tracer.num_calls),
        dict(tracer.node_name_to_scope),
        dict(tracer.leaf_calls),
        sorted(tracer.traced_through),
        dict(names._base_count),
        sorted(names._used_names),
    )


def _same_trace(model, args, monkeypatch, leaf_types=()):
    """Trace both ways, assert everything equal; the number of members replayed."""
    normal, normal_tracer = _trace(model, args, False, monkeypatch, leaf_types)
    replayed, tracer = _trace(model, args, True, monkeypatch, leaf_types)
    assert normal_tracer.members.replayed == 0
    assert _state(replayed, tracer) == _state(normal, normal_tracer)
    return tracer.members.replayed


# (Zoo cases called with keywords are left out: a member called with keywords is never
# replayed, so such a case would compare two normal traces.)
_POSITIONAL_CASES = [c for c in _cases() if not c[3]]


@pytest.mark.parametrize("name,make,args,kwargs", _POSITIONAL_CASES, ids=[c[0] for c in _POSITIONAL_CASES])
def test_the_zoo_traces_as_without_replay(name, make, args, kwargs, monkeypatch):
    torch.manual_seed(0)
    replayed = _same_trace(make().eval(), args, monkeypatch)
    assert replayed == {"pfcn": 11, "nasnet": 9, "randwire": 31}.get(name, 0)


class Member(nn.Module):
    def __init__(self, d=4, hidden=6, act=nn.ReLU):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.act = act()
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class Members(nn.Module):
    def __init__(self, members, d=4):
        super().__init__()
        self.d = d
        self.members = nn.ModuleList(members)

    def forward(self, x):
        return torch.cat([m(x[:, self.d * i : self.d * (i + 1)]) for i, m in enumerate(self.members)], dim=1)


def _x(n, d=4):
    return torch.randn(3, n * d)


def _runs_as_eager(model, n, monkeypatch) -> None:
    """With replay on, ``model`` (of ``n`` members) wrapped under serial runs its plan
    and equals eager on fresh inputs."""
    monkeypatch.setattr(member_replay, "ENABLED", True)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(3):
            x = _x(n)
            assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_alike_members_are_replayed_and_run_as_eager(monkeypatch):
    torch.manual_seed(0)
    model = Members([Member() for _ in range(6)]).eval()
    assert _same_trace(model, (_x(6),), monkeypatch) == 5
    _runs_as_eager(model, 6, monkeypatch)


def test_members_of_other_widths_and_classes_of_child(monkeypatch):
    # The replay does not read parameters (the ranks are noted for real); a child of
    # another class makes another kind, recorded on its own.
    torch.manual_seed(0)
    kinds = [(6, nn.ReLU), (9, nn.ReLU), (6, nn.GELU), (3, nn.GELU), (2, nn.ReLU)]
    members = [Member(hidden=h, act=a) for h, a in kinds]
    assert _same_trace(Members(members).eval(), (_x(5),), monkeypatch) == 3


class Shared(nn.Module):
    """Every member calls one shared Linear: fx names its later calls ``fc@1``..."""

    def __init__(self, n=4):
        super().__init__()
        fc = nn.Linear(4, 4)
        self.members = nn.ModuleList(Member() for _ in range(n))
        for m in self.members:
            m.fc2 = fc

    def forward(self, x):
        return torch.cat([m(x[:, 4 * i : 4 * (i + 1)]) for i, m in enumerate(self.members)], dim=1)


def test_a_child_shared_by_the_members(monkeypatch):
    assert _same_trace(Shared().eval(), (_x(4),), monkeypatch) == 3


# --- each condition, broken by one member --------------------------------------------


def _pick(x):
    # Plain code a member's forward calls by a global name: what it does here depends on
    # the traced value (as code reading an id, a counter or a global's state may).
    return x * 2 if x.node.name == "getitem_1" else x


class ReadsGlobal(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(_pick(x))


def test_a_forward_that_reads_a_global_is_traced(monkeypatch):
    # Member 0's trace is one Linear; member 1's also doubles its input: a recording of
    # member 0 would be wrong for it.
    torch.manual_seed(0)
    model = Members([ReadsGlobal() for _ in range(3)]).eval()
    assert _same_trace(model, (_x(3),), monkeypatch) == 0


def _doubling_capture_hook(module, args, out):
    return out * 2


# A capture hook (frontend.hooks) is no hook to the leaf rule: the member is traced through.
_doubling_capture_hook.__module__ = "transformers.utils.output_capturing"


def test_a_member_with_a_hook_is_traced(monkeypatch):
    torch.manual_seed(0)
    model = Members([Member() for _ in range(4)]).eval()
    model.members[2].register_forward_hook(_doubling_capture_hook)
    model.members[3].register_forward_hook(lambda m, a, o: o + 1)  # a hooked member: a leaf
    assert _same_trace(model, (_x(4),), monkeypatch) == 1


def test_a_replayed_members_child_with_a_backward_hook(monkeypatch):
    # A backward hook is no forward hook: the member is replayed. Its child's rank note
    # (given the child the replay holds, not looked up by path) must know nothing of the
    # hooked child's value, as a normal trace's does: the hook may hand back another one.
    torch.manual_seed(0)
    model = Members([Member() for _ in range(4)]).eval()
    model.members[2].fc1.register_full_backward_hook(lambda m, gi, go: None)
    assert _same_trace(model, (_x(4),), monkeypatch) == 3
    _runs_as_eager(model, 4, monkeypatch)


def test_a_global_module_hook_turns_replay_off(monkeypatch):
    torch.manual_seed(0)
    model = Members([Member() for _ in range(4)]).eval()
    # It changes the argument of member 2 only: member 0's trace is a plain one.
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: (args[0] * 2,) if m is model.members[2] else None
    )
    try:
        assert _same_trace(model, (_x(4),), monkeypatch) == 0
    finally:
        handle.remove()


def test_a_member_with_its_own_forward_is_traced(monkeypatch):
    torch.manual_seed(0)
    model = Members([Member() for _ in range(4)]).eval()
    odd = model.members[2]
    odd.forward = lambda x: odd.fc2(odd.fc1(x))  # no activation
    assert _same_trace(model, (_x(4),), monkeypatch) == 2


class Scale(nn.Module):
    def forward(self, x, factor):
        return x * factor


class ReadsAttribute(nn.Module):
    def __init__(self, factor):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = Scale()
        self.factor = factor

    def forward(self, x):
        return self.scale(self.fc(x), self.factor)


def test_a_member_differing_in_a_plain_attribute_is_traced(monkeypatch):
    torch.manual_seed(0)
    model = Members([ReadsAttribute(f) for f in (1.0, 2.0, 3.0)]).eval()
    assert _same_trace(model, (_x(3),), monkeypatch, leaf_types=(Scale,)) == 0


class Block(nn.Module):
    """Not a torch.nn module: traced through, unless a hook makes it a leaf."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class HoldsBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = Block()

    def forward(self, x):
        return self.block(x)


def test_a_child_that_is_a_leaf_in_one_member_only(monkeypatch):
    torch.manual_seed(0)
    model = Members([HoldsBlock() for _ in range(3)]).eval()
    model.members[0].block.register_full_backward_hook(lambda m, gi, go: None)  # a leaf there
    assert _same_trace(model, (_x(3),), monkeypatch) == 0


def test_code_plan_refuses_what_may_do_more_than_call_children():
    def calls(self, x):
        y = self.a(x)
        return self.b(y, 2)

    def pair(self, x):
        return self.a(x), self.b(x)

    def operator(self, x):
        return self.a(x) + 1

    def branch(self, x, flag):
        return self.a(x) if flag else self.b(x)

    def passes_self(self, x):
        return self.a(self)

    def reads_global(self, x):
        return self.a(torch)

    def method_call(self, x):
        return self.a(x).relu()

    def star(self, *xs):
        return self.a(xs)

    assert member_replay.code_plan(calls.__code__) == ("a", "b")
    assert member_replay.code_plan(pair.__code__) == ("a", "b")
    for refused in (operator, branch, passes_self, reads_global, method_call, star):
        assert member_replay.code_plan(refused.__code__) is None, refused.__name__


def test_parallel_fcn_members_are_replayed(monkeypatch):
    torch.manual_seed(0)
    assert _same_trace(ParallelFCN(20).eval(), (torch.randn(2, 400),), monkeypatch) == 19
