"""Modules changed while wrapped, compared with eager PyTorch on fresh inputs after each
change: a tensor held as a plain attribute (not a parameter or buffer) re-assigned or
updated in place, on the model itself and on a submodule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.scale = torch.tensor(2.0)  # a plain attribute: not a parameter, not a buffer

    def forward(self, x):
        return self.lin(x) * self.scale


class HoldsTensors(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = Scaled()
        self.right = nn.Linear(D, D)
        self.offset = torch.zeros(D)

    def forward(self, x):
        return self.left(x) + self.right(x) + self.offset


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_tensor_attributes_reassigned_or_updated_are_read_every_call(executor):
    model = HoldsTensors()
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for call in range(8):
        if call % 3 == 1:
            model.offset = torch.full((D,), float(call))  # the model's own attribute
            model.left.scale = torch.tensor(float(call))  # a submodule's
        elif call % 3 == 2:
            model.offset.add_(1)
            model.left.scale.mul_(-1)
        x = torch.randn(4, D)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan")
        assert_close(out, model(x), what=f"call {call} ({path})")
