"""``fuse_params="copy"`` stacks the members' tensors per call: a batched kernel that
updates buffers in training (BatchNorm's running statistics, a vmap kernel's buffers)
would update the copies. Such members stay unfused in training; the statistics, and the
outputs in eval afterwards, equal eager's."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)) for _ in range(4)
        )

    def forward(self, x):
        return torch.cat([t(x) for t in self.towers], -1)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_running_statistics_under_copy_mode_follow_eager(executor):
    torch.manual_seed(0)
    model = Towers()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, fuse_params="copy")
    for step in range(4):
        x = torch.randn(5, 8)
        out, expected = sm(x), reference(x)
        path = last_path(sm)
        assert_close(out, expected, what=f"step {step} ({path})")
        out.sum().backward()
        expected.sum().backward()
        for (name, b), (_, b_ref) in zip(model.named_buffers(), reference.named_buffers()):
            assert_close(b, b_ref, what=f"{name} after step {step} ({path})")
    assert path == f"plan:{executor}"
    assert any("running statistics would be stacked per call" in u.reason for u in sm.plan.unfused), sm.plan.unfused
    sm.eval()
    reference.eval()
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(5, 8)
            assert_close(sm(x), reference(x), what=f"eval call {call} ({last_path(sm)})")
