"""The fused-kernel check of the test helpers (``tests/fused_kernels.py``): every fused
kernel of a plan, run on its own inputs, against its members run one by one.

The model tier holds each fused plan to this check before any whole-model tolerance:
a kernel error that only float32 shows must fail here, where a float64 copy of the
wrapper (exact) would excuse it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, NASNetCells, ParallelFCN
from streamsched.passes.fusion import kernels

from .fused_kernels import assert_fused_kernels_match_members, fused_kernel_problems
from .helpers import ConvTowers, assert_close, called_on

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")


class NormsAndConvs(nn.Module):
    """LayerNorm + GELU per slice (stacked input), and Conv-BN-ReLU towers on one image."""

    def __init__(self):
        super().__init__()
        self.norms = nn.ModuleList(nn.LayerNorm(16) for _ in range(3))
        self.acts = nn.ModuleList(nn.GELU() for _ in range(3))
        self.convs = nn.ModuleList(
            nn.Sequential(nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU()) for _ in range(3)
        )

    def forward(self, x, img):
        a = [act(n(x[:, i])) for i, (n, act) in enumerate(zip(self.norms, self.acts))]
        b = [c(img) for c in self.convs]
        return torch.stack(a), torch.cat(b, 1)


@ss.branch
class Gated(nn.Module):
    """A branch class: no batched kernel of its own, fused by ``vmap``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(self.a(x)) * self.b(x)


class GatedSlices(nn.Module):
    def __init__(self):
        super().__init__()
        self.members = nn.ModuleList(Gated() for _ in range(4))

    def forward(self, x):
        return torch.cat([m(x[:, 8 * i : 8 * (i + 1)]) for i, m in enumerate(self.members)], dim=1)


CASES = {
    "parallel_fcn": (lambda: ParallelFCN(8), lambda: (torch.randn(4, 160),)),
    "critic_ensemble": (lambda: CriticEnsemble(4), lambda: (torch.randn(4, 23),)),
    "multitask_heads": (MultiTaskHeads, lambda: (torch.randn(4, 64),)),
    "conv_towers": (ConvTowers, lambda: (torch.randn(2, 8, 6, 6),)),
    "nasnet_cells": (lambda: NASNetCells(8, 2, 10), lambda: (torch.randn(2, 3, 32, 32),)),
    "norms_and_convs": (NormsAndConvs, lambda: (torch.randn(4, 3, 16), torch.randn(2, 4, 5, 5))),
    "vmap_members": (GatedSlices, lambda: (torch.randn(3, 32),)),
}


def _planned(name: str, train: bool) -> tuple[nn.Module, ss.StreamScheduledModule, tuple]:
    make, inputs = CASES[name]
    model = make().train(train)
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    called_on(sm, "recorded", *inputs())
    args = inputs()
    assert_close(called_on(sm, "plan", *args), eager(*args), atol=1e-5)
    assert sm.plan.fused_groups, f"{name}: nothing fused, nothing to check"
    return eager, sm, args


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_fused_kernel_matches_its_members(name, train):
    eager, sm, args = _planned(name, train)
    state = {k: v.clone() for k, v in sm.state_dict().items()}
    checked = assert_fused_kernels_match_members(sm, *args)
    assert checked == len(sm.plan.fused_groups)
    # The check leaves nothing behind: running statistics are as the planned call left them.
    for k, v in sm.state_dict().items():
        assert torch.equal(v, state[k]), f"the check changed {k}"


@pytest.fixture
def float32_linear_error(monkeypatch):
    """Every fused Linear kernel's float32 output 1e-3 off; float64 exact."""
    call = kernels.LinearKernel.__call__

    def off(self, x):
        y = call(self, x)
        return y + 1e-3 if y.dtype == torch.float32 else y

    monkeypatch.setattr(kernels.LinearKernel, "__call__", off)


def test_a_float32_only_kernel_error_fails_the_check_where_float64_is_exact(float32_linear_error):
    model = ParallelFCN(8)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    x = torch.randn(4, 160)
    sm(x)
    called_on(sm, "plan", x)
    checked, problems = fused_kernel_problems(sm, x)
    assert checked == len(sm.plan.fused_groups) and problems, "the float32 kernel error passed the kernel check"
    assert all("baddbmm" in p for p in problems)  # the Linear kernels, not the ReLU between them
    with pytest.raises(AssertionError, match="fused kernels differ from their members"):
        assert_fused_kernels_match_members(sm, x)
    # What the check exists for: in float64 the same wrapper is exact, so a float64 copy
    # of the wrapper (the model tier's last resort for fused values) would excuse it.
    sm64 = ss.StreamScheduledModule(copy.deepcopy(model).double(), executor="serial")
    x64 = x.double()
    sm64(x64)
    out64 = called_on(sm64, "plan", x64)
    assert sm64.plan.fused_groups
    assert_close(out64, model.double()(x64), atol=1e-12, rtol=1e-12)
    assert fused_kernel_problems(sm64, x64)[1] == []


def test_the_check_needs_a_compiled_plan():
    sm = ss.StreamScheduledModule(ParallelFCN(4), executor="serial")
    x = torch.randn(2, 80)
    sm(x)
    checked = assert_fused_kernels_match_members(sm, x)  # the plan exists after the recording call
    assert checked == len(sm.plan.fused_groups)
    fresh = ss.StreamScheduledModule(ParallelFCN(4))
    with pytest.raises(AssertionError, match="no compiled plan"):
        fused_kernel_problems(fresh, x)
