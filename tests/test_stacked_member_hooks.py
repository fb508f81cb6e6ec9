"""``sm.fused_parameters()`` refuses a group one of whose members has a gradient hook:
the group's gradient accumulates into the stacked tensor's ``.grad``, past the hook,
which would silently not fire (or, as ``register_hook(lambda g: g * 3)``, not scale)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion import StackedLayoutError


class Towers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)) for _ in range(4))

    def forward(self, x):
        return torch.cat([t(x) for t in self.towers], -1)


@pytest.mark.parametrize("kind", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_member_with_a_gradient_hook_is_refused(kind):
    model = Towers()
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(5, 8))
    weight = model.towers[1][0].weight
    if kind == "register_hook":
        weight.register_hook(lambda g: g * 3)
    else:
        weight.register_post_accumulate_grad_hook(lambda p: None)
    with pytest.raises(StackedLayoutError, match=r"towers\.1\.0\.weight has a gradient hook"):
        sm.fused_parameters()


def test_members_without_hooks_are_stacked():
    model = Towers()
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(5, 8))
    assert len(sm.fused_parameters()) < len(list(model.parameters()))
