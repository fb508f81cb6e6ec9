"""``Plan.coverage``: the share of a forward's leaf-module calls that run as tasks of the plan.

Every expected count is worked out from the model's structure in the test (how many
leaf modules each part calls, how often), never read off a plan.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.errors import UntraceableWarning
from streamsched.planning.plan import Plan
from streamsched.testing import assert_path

from .helpers import assert_close
from .test_opaque_outputs import TwoStream


class Scale(nn.Module):
    """A leaf module (no children) whose forward the trace goes through."""

    def __init__(self, width: int):
        super().__init__()
        self.s = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        return x * self.s


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.scale = Scale(width)

    def forward(self, x):
        return self.scale(self.act(self.fc(x)))


BLOCK_LEAVES = 3  # fc, act, scale


class Traced(nn.Module):
    """Everything traceable; ``head`` is called twice."""

    def __init__(self, width: int = 8, blocks: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x) + self.head(torch.tanh(x))


class Untraceable(nn.Module):
    """fx cannot trace this class (control flow on a size): it runs as one opaque task."""

    def __init__(self, width: int):
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, x):
        if x.shape[0] > 0:
            x = self.gate(x)
        return self.body(x)


UNTRACEABLE_LEAVES = 1 + 3  # gate, then body's three


class WithOpaque(nn.Module):
    """A traced root around an opaque submodule called twice."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.pre = nn.Linear(width, width)
        self.inner = Untraceable(width)
        self.post = nn.GELU()
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.inner(self.inner(self.pre(x)))
        return self.head(self.post(x))


class Gate(nn.Module):
    """Untraceable root (control flow on values) with two ``@streamsched.branch`` calls."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)
        self.post = nn.Sequential(nn.Linear(width, width), nn.ReLU())

    @ss.branch
    def tower(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > 0:
            x = self.tower(self.a, x) + self.tower(self.b, x)
        return self.post(x)


class NoBranches(nn.Module):
    """Untraceable root and nothing to dispatch: under ``auto`` it ends up run as written."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.act = nn.Tanh()

    def forward(self, x):
        if x.sum() > 0:
            x = self.fc(x)
        return self.act(self.fc(x))


def _hooks_left(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if m._forward_pre_hooks]


def _run(sm: ss.StreamScheduledModule, model: nn.Module, x: torch.Tensor, *paths: str) -> Plan:
    with torch.no_grad():
        out, expected = sm(x), model(x)
    assert_path(sm, *paths)
    assert_close(out, expected)
    assert sm.plan is not None
    return sm.plan


def test_all_leaves_traced():
    model = Traced(blocks=3)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    plan = _run(sm, model, torch.randn(4, 8), "recorded")
    # Per call, not per module: the head is one module called twice; each Scale is a leaf
    # module the trace went through (its multiply is a task), counted all the same.
    total = 3 * BLOCK_LEAVES + 2
    assert plan.coverage_calls == (total, total)
    assert plan.coverage == 1.0
    assert "coverage 1.00 (11 of 11 leaf-module calls scheduled)" in str(plan)
    # The counting hooks lived for the recording call only.
    assert _hooks_left(sm.module) == []
    plan = _run(sm, model, torch.randn(4, 8), "plan:serial")
    assert plan.coverage_calls == (total, total)


class NormAct(nn.BatchNorm1d):
    """A norm holding its activation, as timm's ``BatchNormAct2d``: a subclass of a
    ``torch.nn`` leaf that the trace keeps as one call, its child called inside it."""

    def __init__(self, width: int):
        super().__init__(width)
        self.act = nn.ReLU()

    def forward(self, x):
        return self.act(super().forward(x))


class NormActStack(nn.Module):
    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.fcs = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norms = nn.ModuleList(NormAct(width) for _ in range(depth))

    def forward(self, x):
        for fc, norm in zip(self.fcs, self.norms):
            x = norm(fc(x))
        return x


def test_a_subclass_of_a_torch_leaf_is_one_scheduled_leaf_call():
    model = NormActStack(depth=3).eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    plan = _run(sm, model, torch.randn(4, 8), "recorded")
    # Each NormAct is one task (its activation runs inside it): 3 Linears + 3 NormActs.
    assert plan.coverage_calls == (6, 6)
    plan = _run(sm, model, torch.randn(4, 8), "plan:serial")
    assert plan.coverage == 1.0


def test_opaque_submodule_leaves_are_not_covered():
    model = WithOpaque()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    plan = _run(sm, model, torch.randn(4, 8), "recorded")
    assert [o.path for o in plan.opaque] == ["inner"]
    scheduled = 3  # pre, post, head
    hidden = 2 * UNTRACEABLE_LEAVES  # inner is called twice; its leaves run inside one task each time
    assert plan.coverage_calls == (scheduled, scheduled + hidden)
    assert plan.coverage == pytest.approx(3 / 11)
    assert "coverage 0.27 (3 of 11 leaf-module calls scheduled)" in plan.summary()
    assert _hooks_left(sm.module) == []
    again = Plan.from_json(plan.to_json())
    assert again.coverage_calls == plan.coverage_calls


def test_recording_that_retraces_counts_on_the_new_graph():
    # Each layer's opaque attention returns (h, None): the recording call re-traces
    # (frontend.opaque_outputs) and goes on in the new graph.
    layers = 3
    model = TwoStream(layers=layers, traceable=False)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    plan = _run(sm, model, torch.randn(2, 8), "recorded")
    assert len(plan.opaque) == layers
    ff_leaves, attn_leaves = 3, 1  # ff: Linear, GELU, Linear; attention calls q once (g is None)
    scheduled = layers * ff_leaves + 1  # and the head
    assert plan.coverage_calls == (scheduled, scheduled + layers * attn_leaves)
    assert _hooks_left(sm.module) == []


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_eager_dispatch_counts_branch_bodies(executor):
    model = Gate()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), strict=False, executor=executor)
    x = torch.randn(4, 8).abs() + 0.1  # positive: both towers run
    plan = _run(sm, model, x, "eager-dispatch")
    assert plan.mode == "eager-dispatch" and len(plan.tasks) == 2
    if executor == "threads":  # the bodies ran on worker lanes, not the calling thread
        assert plan.executor == "threads" and {t.stream for t in plan.tasks} - {0}
    # Inside the two branch bodies (on worker lanes under "threads"): a and b; around
    # them, in the forward: post's Linear and ReLU, called through post's nested plan
    # (streamsched.nesting), which schedules both.
    assert plan.nested_leaf_calls == {"post": 2}
    assert plan.coverage_calls == (4, 4)
    assert plan.nested_in_tasks == 2 and "2 of them by nested plans" in plan.summary()
    assert _hooks_left(sm.module) == []
    # Counted once per call structure; later calls report the same figure.
    plan = _run(sm, model, x, "eager-dispatch")
    assert plan.coverage_calls == (4, 4)
    # Without the nested plan (post runs as written), only the branch bodies count.
    sm._ss.nested.sites()[0].active = False
    plan = _run(sm, model, x, "eager-dispatch")
    assert plan.coverage_calls == (2, 4) and plan.coverage == 0.5


@ss.branch
class ScaleBranch(Scale):
    """A module class decorated as a branch: one task of a traced plan."""


class GateWithBranchModule(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.scale = ScaleBranch(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        if x.sum() > 0:
            x = self.scale(x)
        return self.fc(x)


def test_branch_module_classes_count_where_they_are_tasks():
    model = GateWithBranchModule()
    x = torch.randn(4, 8).abs() + 0.1
    # Untraceable root: eager dispatch launches branch functions and methods only, and
    # runs the decorated module inline, as written: nothing is scheduled.
    sm = ss.StreamScheduledModule(copy.deepcopy(model), strict=False, executor="serial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntraceableWarning)
        plan = _run(sm, model, x, "eager-dispatch")
    assert plan.tasks == [] and plan.coverage_calls == (0, 2)
    # Inside a traced parent the same module is a task of its own.
    parent = nn.Sequential(copy.deepcopy(model.scale), nn.ReLU())
    sm = ss.StreamScheduledModule(copy.deepcopy(parent), executor="serial")
    plan = _run(sm, parent, x, "recorded")
    assert plan.coverage_calls == (2, 2)


def test_untraceable_root_without_branches_runs_as_written():
    model = NoBranches()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), strict=False)
    x = torch.randn(4, 8).abs() + 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UntraceableWarning)
        plan = _run(sm, model, x, "eager-dispatch")
        assert plan.coverage_calls == (0, 3)  # fc twice, act: none in a branch
        assert plan.coverage == 0.0
        for _ in range(4):
            plan = _run(sm, model, x, "eager-dispatch", "as-written")
    assert_path(sm, "as-written")
    assert plan.executor == "eager"
    assert plan.coverage == 0.0 and plan.coverage_calls == (0, 3)
    assert "the model runs as written" in plan.summary()


def test_as_written_plans_schedule_nothing():
    # A new size of a planned call structure runs as written (planning.signatures).
    model = Traced(blocks=2)
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    plan = _run(sm, model, torch.randn(4, 8), "recorded")
    total = 2 * BLOCK_LEAVES + 2
    assert plan.coverage_calls == (total, total)
    plan = _run(sm, model, torch.randn(5, 8), "as-written")
    assert plan.executor == "eager"
    assert plan.coverage == 0.0
    assert plan.coverage_calls == (0, total)
    # Nothing counted at all: a plan made without any trace.
    bare = Plan.as_written("M", "because")
    assert bare.coverage == 0.0 and bare.coverage_calls == (0, 0)


def test_declared_units_count_as_scheduled_and_hooked_containers_do_not():
    @ss.branch
    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x):
            return self.net(x)

    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

        def forward(self, x):
            return self.net(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.tower = Tower()
            self.hooked = Hooked()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x):
            h = self.tower(x) + self.hooked(x)
            return self.attn(h, h, h, need_weights=False)[0]

    model = Net().eval()
    wrapped = copy.deepcopy(model)
    calls = []
    wrapped.hooked.register_forward_hook(lambda m, i, o: calls.append(1))
    sm = ss.StreamScheduledModule(wrapped, executor="serial")
    plan = _run(sm, model, torch.randn(2, 3, 8), "recorded")
    # The branch's two leaves are scheduled (the user made it one task); the hooked
    # module's three run inside one task nobody declared; MultiheadAttention calls no
    # submodule of its own (it reads out_proj's weights) and counts as one leaf call.
    assert plan.coverage_calls == (2 + 1, 2 + 3 + 1)
    assert calls == [1]
    # The user's hook is still there, and only it.
    assert list(wrapped.hooked._forward_hooks) and _hooks_left(wrapped) == []


def test_counting_hooks_are_invisible_to_has_hooks():
    # A trace or a plan made while the recording call runs (a nested wrapper's first
    # call) must see the modules as they are: has_hooks() overlooks the counter's hooks.
    from streamsched.frontend.hooks import has_hooks

    seen = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            if x.shape[0] > 0:  # untraceable: runs opaque, inside the recording call
                seen.append((len(self.fc._forward_pre_hooks), has_hooks(self.fc)))
            return self.fc(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.probe = Probe()

        def forward(self, x):
            return self.probe(x)

    model = Net()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    plan = _run(sm, model, torch.randn(2, 8), "recorded")  # the wrapper's call, then eager's
    assert seen == [(1, False), (0, False)]  # the counter's hook was there; has_hooks() overlooked it
    assert plan.coverage_calls == (0, 1)
    _run(sm, model, torch.randn(2, 8), "plan:serial")
    assert seen[2] == (0, False)  # the plan's calls carry no hook


def test_a_call_whose_only_hook_is_the_counters_counts_as_through_call():
    # The recording call runs a leaf module whose only hook is the counter's without
    # nn.Module.__call__'s hook path (LeafCallCounter.call): the count and the value are
    # those of a call through __call__, and any other hook sends it through __call__.
    from streamsched.frontend.leafcalls import LeafCallCounter

    torch.manual_seed(0)
    fc, x = nn.Linear(4, 3), torch.randn(2, 4)
    counter = LeafCallCounter([fc], lambda m: counter.where)
    with counter:
        counter.where = "first"
        y = counter.call(fc, (x,), {})
    assert counter.hits == ["first"]
    assert torch.equal(y, fc(x))
    fired = []
    fc.register_forward_hook(lambda m, args, out: fired.append(out))
    with counter:
        counter.where = "second"
        y = counter.call(fc, (x,), {})
    assert counter.hits == ["first", "second"]
    assert len(fired) == 1 and fired[0] is y


def test_recording_call_counts_each_leaf_node_once():
    from streamsched.frontend.leafcalls import LEAF_CALLS_META

    torch.manual_seed(0)
    model = Traced().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert_close(sm(x), model(x))
    assert_path(sm, "recorded")
    (traced,) = list(sm._ss.traces.values())
    counts = sorted((n.target, n.meta[LEAF_CALLS_META]) for n in traced.graph.nodes if n.op == "call_module")
    # Every block's fc and act, and the head twice, are nodes (Scale is traced through):
    # each counted its own call.
    expected = [(f"blocks.{i}.{leaf}", 1) for i in range(3) for leaf in ("act", "fc")] + [("head", 1)] * 2
    assert counts == sorted(expected)
