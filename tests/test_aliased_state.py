"""Tensors the model holds that share a storage with a parameter or buffer: a buffer
registered as a fused member's ``weight.detach()``, a slice of a batch norm's running
mean registered as a buffer, one buffer under two names, a plain attribute viewing a
running variance. Eager sees every write to the shared storage (an optimizer step, the
batch norm's update in training) through each of them; so must every call of the
wrapper, whatever it fuses and whichever executor runs the plan."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

D = 6


def _pair(make):
    """The model and its eager twin, built from one seed (``copy.deepcopy`` would not
    keep a buffer's storage shared with a weight)."""
    torch.manual_seed(0)
    model = make()
    torch.manual_seed(0)
    return model, make()


class WeightViewBuffer(nn.Module):
    """Fusable towers, and a buffer that is a detached view of one tower's weight."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(4))
        self.register_buffer("wv", self.heads[1][0].weight.detach())

    def forward(self, x):
        return torch.stack([h(x) for h in self.heads]) + x @ self.wv


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("write", ["parameter step", "through the buffer"])
def test_a_buffer_sharing_a_fused_members_weight_sees_every_step(executor, write):
    model, eager = _pair(WeightViewBuffer)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for i in range(4):
        x = torch.randn(3, D)
        with torch.no_grad():
            assert_close(sm(x), eager(x), atol=1e-5)
            if i:
                assert_path(sm, "plan")
            for m in (model, eager):  # an optimizer step, or a write through the buffer
                if write == "parameter step":
                    for p in m.parameters():
                        p.sub_(0.05)
                else:
                    m.wv.mul_(1.1)
    assert sm.plan.fused_groups  # the towers are fused ...
    # ... and the buffer still shares the weight's storage (the weight was not moved).
    assert model.wv.untyped_storage().data_ptr() == model.heads[1][0].weight.untyped_storage().data_ptr()


class RunningMeanSlice(nn.Module):
    """Batch-normed towers, and a buffer that is a slice of one tower's running mean,
    read after the towers ran (in training, they updated it)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Conv2d(D, D, 1), nn.BatchNorm2d(D)) for _ in range(4))
        self.register_buffer("stats", self.heads[1][1].running_mean[:3])

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], 1), self.stats * 1


class RunningMeanTwice(RunningMeanSlice):
    """The running mean itself, registered a second time under another name."""

    def __init__(self):
        super().__init__()
        del self._buffers["stats"]
        self.register_buffer("stats", self.heads[1][1].running_mean)


def _compare_outputs_and_stats(sm, eager) -> None:
    """One call of each on a fresh input: the towers' output and the statistics read."""
    x = torch.randn(5, D, 3, 3)
    with torch.no_grad():
        (out, stats), (expected, expected_stats) = sm(x), eager(x)
    assert_close(out, expected, atol=1e-5)
    assert_close(stats, expected_stats, atol=1e-6)


@pytest.mark.parametrize("make", [RunningMeanSlice, RunningMeanTwice])
@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_buffer_aliasing_running_statistics_is_read_after_their_update(make, executor, fuse):
    model, eager = _pair(make)
    sm = ss.StreamScheduledModule(model, executor=executor, fuse=fuse, min_task_cost=0.0, num_streams=4)
    for i in range(4):
        _compare_outputs_and_stats(sm, eager)
        if i:
            assert_path(sm, "plan")
    # The read is ordered after the batch norm's update (an edge, not luck).
    assert sm.plan.effect_edges >= 1
    for a, b in zip(model.buffers(), eager.buffers()):
        assert_close(a, b, atol=1e-6)


class RunningVarView(RunningMeanSlice):
    """A plain attribute (no buffer) viewing a running variance: the trace computes
    with it as a real tensor."""

    def __init__(self):
        super().__init__()
        del self._buffers["stats"]
        self.stats = self.heads[2][1].running_var.view(2, 3)


def test_a_held_view_of_running_statistics_is_refused_not_baked():
    """The trace would compute ``stats * 1`` from the value before the call: the forward
    runs in eager dispatch instead, with a warning that names the buffer and module."""
    model, eager = _pair(RunningVarView)
    sm = ss.StreamScheduledModule(model, executor="threads", min_task_cost=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            _compare_outputs_and_stats(sm, eager)
    assert_path(sm, "eager-dispatch")
    messages = [str(w.message) for w in caught if issubclass(w.category, ss.UntraceableWarning)]
    assert any("'running_var' of BatchNorm2d ('heads.2.1')" in m for m in messages), messages


class SharedStatistics(nn.Module):
    """Two branches normalised in training with one pair of running statistics
    (``F.batch_norm`` on the same buffers): each call updates them twice, in program
    order. (A batch norm module called twice is ordered by its ``num_batches_tracked``
    write; these writes are the statistics' alone.)"""

    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(D, D, 1)
        self.b = nn.Conv2d(D, D, 1)
        self.register_buffer("mean", torch.zeros(D))
        self.register_buffer("var", torch.ones(D))

    def forward(self, x):
        left = F.batch_norm(self.a(x), self.mean, self.var, training=True, momentum=0.5)
        right = F.batch_norm(self.b(x).tanh(), self.mean, self.var, training=True, momentum=0.5)
        return left + right


def test_running_statistics_shared_by_two_branches_are_updated_in_order():
    model, eager = _pair(SharedStatistics)
    sm = ss.StreamScheduledModule(model, executor="threads", min_task_cost=0.0, fuse=False, num_streams=4)
    for i in range(4):
        x = torch.randn(5, D, 3, 3)
        with torch.no_grad():
            assert_close(sm(x), eager(x), atol=1e-5)
        if i:
            assert_path(sm, "plan")
    assert sm.plan.effect_edges >= 1
    assert_close(model.mean, eager.mean, atol=1e-6)
    assert_close(model.var, eager.var, atol=1e-6)
