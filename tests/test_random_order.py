"""Random draws in eager order: ops that draw from a random-number generator (dropout in
training, ``bernoulli_``, ``randn_like``) are recorded as writes of one generator state
(``frontend.effects.RNG_KEY``). Eager draws them in program order, so with the same seed
every mask a plan draws is eager's: a schedule runs them in that order, never side by
side, a fused kernel never draws for several members at once, and no group is fused
where one kernel would sit between two draws that eager makes in the other order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Ensemble(nn.Module):
    """Alike members (fusion runs) drawing one or two dropout masks each."""

    def __init__(self, n: int = 4, two: bool = False) -> None:
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(
                nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4), *([nn.Dropout(0.2)] if two else [])
            )
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members])


class _Tower(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(64, width), nn.Dropout(0.5), nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.relu(self.a(x))))


class Towers(nn.Module):
    """Branches of different widths (not fused) that each draw a mask: side by side on
    lanes, they would draw in whatever order the lanes reach them."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(_Tower(256 + 64 * i) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([t(x) for t in self.towers], 1) + torch.randn_like(x[:, :1])


def _seeded_calls(sm, model, make_input, calls: int = 8, planned: str = "") -> None:
    for i in range(calls):
        x = make_input()
        torch.manual_seed(1000 + i)
        out = sm(x)
        after = torch.rand(1)
        if planned and i:  # (the first call is the recording call)
            assert_path(sm, planned)
        torch.manual_seed(1000 + i)
        expected = model(x)
        assert_close(out, expected, what=f"call {i}")
        assert torch.equal(after, torch.rand(1)), "the generator's state after the call differs from eager's"


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("two", [False, True], ids=["one-mask", "two-masks"])
def test_fused_members_draw_eager_s_masks(executor, two):
    model = Ensemble(two=two).train()
    sm = ss.StreamScheduledModule(model, executor=executor)
    _seeded_calls(sm, model, lambda: torch.randn(5, 8), planned=f"plan:{executor}")
    plan = sm.plan
    assert plan.fused_groups, plan.summary()  # the layers before the first mask are fused
    text = plan.summary()
    assert "Dropout" in text and "draws random numbers" in text, text
    if two:
        # Between a member's two masks: one kernel for every second Linear would need
        # every first mask before it and every second one after it.
        assert "break the eager order" in text, text


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_branches_side_by_side_draw_in_eager_order(executor):
    model = Towers().train()
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=3, min_task_cost=0.0)
    _seeded_calls(sm, model, lambda: torch.randn(32, 64), planned=f"plan:{executor}")
    with torch.no_grad():  # in eval only the noise draws
        model.eval()
        x = torch.randn(32, 64)
        torch.manual_seed(7)
        out = sm(x)
        torch.manual_seed(7)
        assert_close(out, model(x))


def test_gradients_of_the_drawn_masks_are_eager_s():
    model = Ensemble(two=True).train()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for i in range(4):
        x = torch.randn(5, 8)
        torch.manual_seed(i)
        sm(x).square().sum().backward()
        wrapped = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(i)
        model(x).square().sum().backward()
        for a, b in zip(wrapped, (p.grad for p in model.parameters())):
            assert_close(a, b, what=f"call {i}")
        model.zero_grad()
    assert_path(sm, "plan:serial")


@pytest.mark.cuda
def test_streams_draw_in_eager_order(emulated_cuda):
    model = Towers().cuda().train()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=3, min_task_cost=0.0)
    _seeded_calls(sm, model, lambda: torch.randn(32, 64, device="cuda"), calls=5, planned="plan:streams")
    assert emulated_cuda.take_reports() == []
