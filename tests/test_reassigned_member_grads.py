"""Gradients, outputs and BatchNorm statistics of a model whose fused members were given

other values after planning, in training, against eager.

A member given new storage (``p.data = t``), a new ``nn.Parameter`` in its place, or new
values through ``load_state_dict`` must be what the next call's fused kernels read and
what its gradient reaches. Everything runs in float64, where fused and eager summation
orders agree to far below 1e-9 of a value's size: a stale stack, a gradient handed to the
replaced tensor or a BatchNorm statistic kept in the old storage is off by far more than
the 1e-9 allowed. (In float32 such a model's gradients differ from eager's by rounding
that a ReLU close to its kink can amplify to 1e-2 of their size, as eager's own
gradients move under a 1e-6 relative change of the input: no float32 tolerance tells
that from a wrong result.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion import params as stacked_params

from .helpers import called_on

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")

DT = torch.float64
RTOL = 1e-9


C = 8


class _NormAct(nn.BatchNorm2d):
    """A BatchNorm with an activation after it, its own forward (timm's BatchNormAct2d):
    a leaf as its base is, fused by ``vmap(functional_call)``."""

    def forward(self, x):
        return torch.nn.functional.hardtanh(super().forward(x), -3.0, 3.0)


class _Branch(nn.Sequential):
    def __init__(self, k: int):
        super().__init__(nn.Conv2d(C, C, k, padding=k // 2, groups=C, bias=False), _NormAct(C))


class _Block(nn.Module):
    """Parallel depthwise conv + BatchNorm branches summed (MobileOne's re-parameterisable
    blocks): the convolutions fuse as one grouped convolution, the norms by vmap."""

    def __init__(self):
        super().__init__()
        self.kxk = nn.ModuleList(_Branch(3) for _ in range(3))
        self.scale = _Branch(1)

    def forward(self, x):
        return torch.relu(sum(b(x) for b in self.kxk) + self.scale(x))


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, C, 3, padding=1)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.head = nn.Linear(C, 5)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def _randomized(model: nn.Module, seed: int) -> nn.Module:
    """BatchNorm affine values away from 1 and 0 (products then round)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(1 + 0.3 * torch.randn(m.weight.shape, generator=g, dtype=DT))
                m.bias.copy_(0.3 * torch.randn(m.bias.shape, generator=g, dtype=DT))
    return model


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = float((got - want).norm())
    assert err <= RTOL * max(float(want.norm()), 1e-30), f"{name}: off by {err:.3g} (norm {float(want.norm()):.3g})"


def _step_and_compare(sm, model, ref, seed: int) -> None:
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=DT)
    w = torch.randn(2, 5, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    out = called_on(sm, "plan:serial", x)
    want = ref(x)
    (out * w).sum().backward()
    (want * w).sum().backward()
    _close("output", out.detach(), want.detach())
    got_params, want_params = dict(model.named_parameters()), dict(ref.named_parameters())
    assert got_params.keys() == want_params.keys()
    for name, p in want_params.items():
        q = got_params[name]
        assert (q.grad is None) == (p.grad is None), name
        if p.grad is not None:
            _close(f"{name}.grad", q.grad, p.grad)
    want_buffers = dict(ref.named_buffers())
    for name, b in model.named_buffers():
        if b.is_floating_point():
            _close(name, b, want_buffers[name])
        else:
            assert torch.equal(b, want_buffers[name]), name


def _new_data(m: nn.Module) -> None:
    conv = m.blocks[0].kxk[1][0]
    conv.weight.data = torch.randn(conv.weight.shape, generator=torch.Generator().manual_seed(7), dtype=DT)


def _new_parameter(m: nn.Module) -> None:
    bn = m.blocks[1].kxk[2][1]
    bn.weight = nn.Parameter(0.5 + torch.rand(bn.weight.shape, generator=torch.Generator().manual_seed(8), dtype=DT))


_OTHER = _randomized(_Net().to(DT), 9).state_dict()


def _loaded(m: nn.Module) -> None:
    m.load_state_dict(_OTHER)


@pytest.mark.parametrize(
    "change, restacks",
    [(_new_data, True), (_new_parameter, True), (_loaded, False)],
    ids=["data-assigned", "new-parameter", "load_state_dict"],
)
def test_a_member_given_other_values_after_planning_gets_eagers_gradients(change, restacks):
    torch.manual_seed(0)
    model = _randomized(_Net().to(DT), 1).train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    called_on(sm, "recorded", x).sum().backward()
    ref(x).sum().backward()
    _step_and_compare(sm, model, ref, 10)
    kinds = {g.kind for g in sm.plan.fused_groups}
    assert {"Conv2d", "_NormAct"} <= kinds, kinds
    plan = sm.plan
    before = stacked_params._restacks
    change(model)
    change(ref)
    _step_and_compare(sm, model, ref, 20)
    # The same plan (nothing re-traced); the changed member's group re-stacked where its
    # storage was replaced, written in place by load_state_dict.
    assert sm.plan is plan
    assert (stacked_params._restacks > before) == restacks
    _step_and_compare(sm, model, ref, 30)
