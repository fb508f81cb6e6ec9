"""Arguments that change from call to call, compared with eager PyTorch on fresh inputs:
objects holding tensors (a dataclass batch) under every executor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class ReadsABatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Linear(D, D)

    def forward(self, batch: Batch):
        return self.left(batch.x) * self.right(batch.y)


@pytest.mark.parametrize(
    "options",
    [{}, {"executor": "serial"}, {"executor": "threads", "min_task_cost": 0.0}, {"sync_log": True}],
    ids=["default", "serial", "threads", "sync_log"],
)
def test_an_object_holding_tensors_runs_as_written_under_every_executor(options):
    # A trace would bake the first call's object in, and with it that call's tensors
    # (graph constants): every later call would compute on them.
    model = ReadsABatch()
    sm = ss.StreamScheduledModule(model, **options)
    for _ in range(4):
        batch = Batch(torch.randn(3, D), torch.randn(3, D))
        assert_close(sm(batch), model(batch), what=f"{options}")
        assert_path(sm, "as-written")
