"""A model returning a view of one of its parameters or buffers (a row of a weight, a slice
of a running statistic) whose owner is fused: the caller writing that view in place writes
the parameter, as in eager. Stacking the owner's parameter moves its storage into the
stack after the first (recording) call, which had returned a view of the old storage: the
caller's write went to a copy nothing reads, and every later call differed from eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 6


class ReturnsAWeightRow(nn.Module):
    """Three identical towers (their first linears fused into one kernel); the output
    holds a row of the second tower's first weight, and of the third one's bias."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(3))

    def forward(self, x):
        y = torch.stack([t(x) for t in self.towers]).sum(0)
        return y, self.towers[1][0].weight[0], self.towers[2][0].bias[1:]


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_returned_view_of_a_fused_parameter_written_by_the_caller_writes_the_parameter(executor):
    torch.manual_seed(0)
    model = ReturnsAWeightRow()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(8):
        x = torch.randn(4, D)
        expected = reference(x)
        actual = sm(x)
        paths.append(assert_path(sm, "recorded", "plan"))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
        with torch.no_grad():  # the caller writes the returned views
            for out in (expected, actual):
                out[1].mul_(0.5)
                out[2].add_(1.0)
        for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
            assert_close(p_new, p_ref, what=f"{name} after call {call} ({paths[-1]})")
    assert paths[0] == "recorded" and paths[-1] == "plan:" + executor, paths
    assert "wide linear" in sm.plan.summary()  # the towers' first linears are still one kernel
