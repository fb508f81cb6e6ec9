"""The proposal's shortcuts give the groups and notes a full look at every node gives.

A wide group's key is made only for a Linear/Conv whose input has at least
``fuse_min_size`` users; a function without a batched kernel has its arguments looked
at only where the plan notes why it is not fused (it takes part in an effect: an
in-place write of shared storage, a random draw; its gradient is retained); a module's parameters are described from its
own table, a tensor registered twice once.
"""

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion.propose import _EFFECT, _RETAINED
from streamsched.testing import assert_path

from .helpers import check_against_eager

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")


class TwoHeads(nn.Module):
    """Two Linear heads of different widths reading one hidden value: a wide group of
    exactly two members, the smallest one kept."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.a = nn.Linear(32, 3)
        self.b = nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def test_a_wide_group_of_exactly_the_minimum_size_is_fused():
    sm = check_against_eager(TwoHeads(), (torch.randn(4, 16),), executor="serial", fuse_min_size=2)
    assert_path(sm, "plan:serial")
    wide = [g for g in sm.plan.fused_groups if "concatenated" in g.kernel]
    assert [g.size for g in wide] == [2]
    assert sorted(wide[0].members) == ["a", "b"]


@ss.branch
class Pair(nn.Module):
    """A module without a kernel of its own (fused with vmap): ``tied`` registers one
    parameter under both names, which ``named_parameters()`` gives once."""

    def __init__(self, tied: bool):
        super().__init__()
        self.a = nn.Parameter(torch.randn(4))
        self.b = self.a if tied else nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x * self.a + torch.tanh(x) * self.b


class Pairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.members = nn.ModuleList(Pair(tied=i % 2 == 0) for i in range(8))

    def forward(self, x):
        return torch.cat([m(x[:, 4 * i : 4 * i + 4]) for i, m in enumerate(self.members)], 1)


def test_members_with_a_parameter_registered_twice_group_apart_from_the_others():
    sm = check_against_eager(Pairs(), (torch.randn(2, 32),), backward=False, executor="serial")
    assert_path(sm, "plan:serial")
    groups = sorted(sorted(g.members) for g in sm.plan.fused_groups)
    assert groups == [
        ["members.0", "members.2", "members.4", "members.6"],
        ["members.1", "members.3", "members.5", "members.7"],
    ]


class WritesSlices(nn.Module):
    """Slices (a function without a batched kernel) of one value, each written in place:
    they take part in the effect, and the plan says so."""

    def forward(self, x):
        h = x * 1.0
        for i in range(4):
            part = h[:, 2 * i : 2 * i + 2]
            part.add_(1.0)
        return h.relu()


def test_unfused_slices_taking_part_in_an_effect_are_noted():
    model = WritesSlices()
    sm = ss.StreamScheduledModule(WritesSlices(), executor="serial")
    for _ in range(3):
        x = torch.randn(3, 8)
        assert torch.equal(sm(x), model(x))
    assert_path(sm, "plan:serial")
    noted = {(u.kind, u.reason) for u in sm.plan.unfused}
    assert ("getitem", _EFFECT) in noted
    assert ("add_", _EFFECT) in noted


class RetainsSlices(nn.Module):
    """Slices of one hidden value whose gradients the forward retains: they are noted as
    left alone for that reason, as any node whose gradient is retained."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)

    def forward(self, x):
        h = self.body(x)
        parts = [h[:, 2 * i : 2 * i + 2] for i in range(4)]
        for part in parts:
            part.retain_grad()
        return torch.relu(h), parts


def test_unfused_slices_whose_gradient_is_retained_are_noted():
    torch.manual_seed(0)
    model, reference = RetainsSlices(), RetainsSlices()
    reference.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x = torch.randn(3, 8)
        out, parts = sm(x)
        expected, parts_ref = reference(x)
        (out.sum() + sum(p.square().sum() for p in parts)).backward()
        (expected.sum() + sum(p.square().sum() for p in parts_ref)).backward()
        assert torch.equal(out, expected)
        for p, p_ref in zip(parts, parts_ref):
            assert torch.allclose(p.grad, p_ref.grad)
    assert_path(sm, "plan:serial")
    noted = {(u.kind, u.reason) for u in sm.plan.unfused}
    assert ("getitem", _RETAINED) in noted
