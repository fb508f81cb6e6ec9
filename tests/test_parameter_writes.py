"""A module that writes its own parameter in place inside its forward (a weight
renormalised under ``no_grad``, as weight normalisation written by hand does): alike
members of such a module are not fused (a fused member's parameter is a view of its
group's stack, which autograd refuses to see written), and every call, with its
gradients and the parameters it leaves, equals eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss

from .helpers import assert_close, step_alongside

# Without the exclusion, a vmap kernel of the three members (too few for one to pay)
# would be built and fail: let it be built.
pytestmark = pytest.mark.usefixtures("vmap_any_size")

D = 6
PATHS = ("recorded", "plan:serial", "plan:threads")


class Renormalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.div_(self.lin.weight.norm(dim=1, keepdim=True))
        return self.lin(x)


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(Renormalised(), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        return sum(t(x) for t in self.towers)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_members_that_write_their_weights_run_as_eager(executor):
    torch.manual_seed(0)
    model = Towers()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(5):
        # (Outputs, the input's and every parameter's gradient; no optimizer: they add up.)
        paths.append(step_alongside(reference, sm, model, torch.randn(4, D), [], PATHS, f"call {call}"))
        for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
            assert_close(p_new, p_ref, what=f"{name} after call {call}")
    assert paths[1:] == [f"plan:{executor}"] * 4, paths
    assert not [g for g in sm.plan.fused_groups if g.kind == "Renormalised"], sm.plan.fused_groups
    assert any("writes its own parameter in place" in u.reason for u in sm.plan.unfused), sm.plan.unfused
