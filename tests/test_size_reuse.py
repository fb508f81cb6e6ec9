"""A plan at a new input size reuses what the trace's earlier plans decided that does not
depend on sizes: the size-independent halves of the fusion signatures (the groups are
formed again from them and this size's metas and effects) and, where the graph, tasks,
streams and effects compile to the same code, the generated program. Each reused plan
must equal a plan made from scratch at its size, and its outputs eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")


class SlicedMLPs(nn.Module):
    """``n`` MLPs, member ``i`` on columns ``[w*i, w*(i+1))`` (ParallelFCN in small)."""

    def __init__(self, n: int = 6, w: int = 4):
        super().__init__()
        self.w = w
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(w, 8), nn.ReLU(), nn.Linear(8, 2)) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x[:, self.w * i : self.w * (i + 1)]) for i, m in enumerate(self.mlps)], dim=1)


class TwoHalves(nn.Module):
    """Two Linears on ``x[:, :4]`` and ``x[:, 4:]``: alike only where the input is 8 wide."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 3)
        self.act_a = nn.LeakyReLU(0.1)
        self.act_b = nn.LeakyReLU(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.act_a(x[:, :4]), self.act_b(x[:, 4:])], dim=1)


class Gain(nn.Module):
    """A leaf module with a plain attribute its forward reads (and a buffer, so that it
    is fused with ``vmap``)."""

    def __init__(self, size_reuse_gain: float):
        super().__init__()
        self.size_reuse_gain = size_reuse_gain
        self.register_buffer("offset", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.size_reuse_gain + self.offset


class TwoGains(nn.Module):
    """Two :class:`Gain` on ``x[:, :4]`` and ``x[:, 4:]``."""

    def __init__(self):
        super().__init__()
        self.a = Gain(2.0)
        self.b = Gain(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x[:, :4]), self.b(x[:, 4:])], dim=1)


class Towers(nn.Module):
    """Branches of different widths: nothing to fuse, several tasks."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.GELU(), nn.Linear(w, d)) for w in (8, 12, 16, 20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([t(x) * (i + 1) for i, t in enumerate(self.towers)]).sum(0)


def _schedule(sm: ss.StreamScheduledModule):
    return sm._ss.last.schedule


def _planned(sm: ss.StreamScheduledModule) -> tuple[str, str]:
    """The plan of ``sm``'s latest signature as text, and the graph its program runs."""
    return sm._ss.last.plan.to_json(), str(_schedule(sm).graph)


def _fresh(model: nn.Module, x: torch.Tensor, **options) -> tuple[str, str]:
    """:func:`_planned` of a new wrapper of a copy of ``model`` at ``x``'s sizes: a plan
    made from scratch."""
    fresh = ss.StreamScheduledModule(copy.deepcopy(model), **options)
    with torch.no_grad():
        fresh(x)
    assert_path(fresh, "recorded")
    reuse = _schedule(fresh).fusion_reuse
    assert reuse is None or not reuse.signatures
    return _planned(fresh)


def _plan_at(sm: ss.StreamScheduledModule, model: nn.Module, x: torch.Tensor) -> ss.Plan:
    with torch.no_grad():
        out = sm(x)
        assert_path(sm, "recorded")
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-6)
        again = sm(x)  # the plan itself, not the recording call
        assert_path(sm, "plan:serial")
        torch.testing.assert_close(again, model(x), rtol=1e-5, atol=1e-6)
    return sm.plan


@pytest.mark.parametrize("sizes", [[(4, 24), (7, 24), (16, 24)], [(3, 24), (3, 28)]])
def test_new_size_reuses_fusion_signatures_and_equals_a_fresh_plan(sizes):
    torch.manual_seed(0)
    model = SlicedMLPs().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for k, size in enumerate(sizes):
        x = torch.randn(*size)
        plan = _plan_at(sm, model, x)
        reuse = _schedule(sm).fusion_reuse
        assert reuse.signatures == (k > 0)
        assert plan.fused_groups, "the members are fused at every size"
        assert _planned(sm) == _fresh(model, x, executor="serial")


def test_fold_layout_is_decided_again_at_each_size():
    """Slices ``x[:, 4i:4(i+1)]`` that cover a 24-wide input are a fold of it; at 28 wide
    they do not cover it, and a kernel that viewed the input as 6 x 4 would be wrong: the
    groups are the same, the layout of the new size's plan is its own."""
    torch.manual_seed(0)
    model = SlicedMLPs().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    wide = _plan_at(sm, model, torch.randn(5, 24))
    wide_graph = _planned(sm)[1]
    x = torch.randn(5, 28)
    other = _plan_at(sm, model, x)
    assert _schedule(sm).fusion_reuse.groups  # same groups, same members
    assert [g.members for g in other.fused_groups] == [g.members for g in wide.fused_groups]
    assert "torch.narrow" not in wide_graph and "torch.narrow" in _planned(sm)[1]
    assert _planned(sm) == _fresh(model, x, executor="serial")


def test_groups_that_sizes_split_are_formed_again():
    """At 8 wide both halves are 4 wide and fuse; at 10 wide they differ: the reused
    signatures must not keep the group (the size-dependent half is re-read)."""
    torch.manual_seed(0)
    model = TwoHalves().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    assert _plan_at(sm, model, torch.randn(3, 8)).fused_groups
    x = torch.randn(3, 10)
    plan = _plan_at(sm, model, x)
    assert _planned(sm) == _fresh(model, x, executor="serial")
    assert not plan.fused_groups
    reuse = _schedule(sm).fusion_reuse
    assert reuse.signatures and not reuse.groups


def test_a_module_reconfigured_before_it_is_first_grouped_is_read_again():
    """At 10 wide the two modules are not grouped, so nothing watches their attributes;
    one is reconfigured; at 8 wide they would group by their cached signatures, which no
    longer describe them: the proposal reads them again and keeps them apart (a kernel
    running one member's code for both would scale by the other's gain)."""
    torch.manual_seed(0)
    model = TwoGains().eval()
    options = {"executor": "serial", "leaf_modules": (Gain,)}
    sm = ss.StreamScheduledModule(model, **options)
    assert not _plan_at(sm, model, torch.randn(3, 10)).fused_groups
    model.b.size_reuse_gain = 3.0
    x = torch.randn(3, 8)
    plan = _plan_at(sm, model, x)
    assert not plan.fused_groups
    assert _planned(sm) == _fresh(model, x, **options)
    # Alike again: fused, and its attributes watched from now on.
    model.b.size_reuse_gain = 2.0
    x = torch.randn(5, 8)
    assert _plan_at(sm, model, x).fused_groups
    assert _planned(sm) == _fresh(model, x, **options)


def test_program_reused_where_it_compiles_the_same():
    """An unfused graph names no size: a new size gets the same generated functions in a
    new Program (executors keep state per program), and eager's results."""
    torch.manual_seed(0)
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model, executor="serial", fuse=False)
    first = _plan_at(sm, model, torch.randn(4, 8))
    program = sm._ss.last.program
    x = torch.randn(9, 8)
    second = _plan_at(sm, model, x)
    reused = sm._ss.last.program
    assert reused is not program
    assert [t.fn for t in reused.tasks] == [t.fn for t in program.tasks]
    assert reused.call is program.call
    assert _planned(sm) == _fresh(model, x, executor="serial", fuse=False)
    assert [t.nodes for t in first.tasks] == [t.nodes for t in second.tasks]


class MixedSlices(nn.Module):
    """Linears on the first ``4n`` columns, their outputs combined: at 20 and 24 wide
    the rewritten graph is the same (a ``narrow`` to 16 columns, one ``unstack``)."""

    def __init__(self, n: int = 4, w: int = 4):
        super().__init__()
        self.w = w
        self.m = nn.ModuleList(nn.Linear(w, 3) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hs = [m(x[:, self.w * i : self.w * (i + 1)]) for i, m in enumerate(self.m)]
        return hs[0] * hs[1] - hs[2] + hs[3]


def test_fused_program_is_never_reused():
    """A fused kernel views stacked values with the sizes it was planned at: a plan with
    one compiles its own program at every size, even where the graph reads the same."""
    torch.manual_seed(0)
    model = MixedSlices().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    _plan_at(sm, model, torch.randn(4, 20))
    graph, program = _planned(sm)[1], sm._ss.last.program
    x = torch.randn(4, 24)
    _plan_at(sm, model, x)
    assert _planned(sm)[1] == graph
    assert sm._ss.last.program.call is not program.call
    assert sum(c.hits for c in sm._ss.programs.values()) == 0
    assert _planned(sm) == _fresh(model, x, executor="serial")


def test_training_sizes_reuse_and_match_gradients():
    """Training plans at a new size: same gradients as eager."""
    torch.manual_seed(0)
    model = SlicedMLPs(n=4)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for b in (3, 5, 5):
        x = torch.randn(b, 16)
        sm(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert _schedule(sm).fusion_reuse.signatures
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
