"""Activation checkpointing inside a wrapped model (``torch.utils.checkpoint``, as timm's
``set_grad_checkpointing`` and transformers' ``gradient_checkpointing_enable`` use it):
the checkpointed part runs again in backward, so its recomputation must see what its
forward saw. Outputs, gradients and the optimizer's steps equal eager's on the schedule's
executors, the fused members included, and on the emulated device's streams."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import streamsched as ss
from streamsched.testing import assert_path, last_path

from .helpers import assert_close, saving


class CheckpointedBranches(nn.Module):
    """Independent branches, each run under ``checkpoint``; ``members`` are alike (fusable
    when called directly), ``towers`` are not."""

    def __init__(self, reentrant: bool, n: int = 4, d: int = 16):
        super().__init__()
        self.reentrant = reentrant
        self.members = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 4)) for _ in range(n))
        self.towers = nn.ModuleList(
            [nn.Sequential(nn.Linear(d, 24), nn.GELU(), nn.Linear(24, 4)), nn.Sequential(nn.Linear(d, 8), nn.Tanh())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [checkpoint(m, x, use_reentrant=self.reentrant, preserve_rng_state=False) for m in self.members]
        outs += [checkpoint(t, x, use_reentrant=self.reentrant) for t in self.towers]
        return torch.cat(outs, dim=1)


class CheckpointedMembers(nn.Module):
    """Fusable members, checkpointed inside each member's own forward."""

    def __init__(self, n: int = 6, d: int = 16):
        super().__init__()
        self.members = nn.ModuleList(_Member(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members])


class _Member(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False)


def _train_alongside(sm, model, ref, make_input, steps: int, planned: str) -> list[str]:
    """SGD steps of the wrapper and of an eager copy on the same inputs; every output,
    input gradient, parameter gradient and parameter compared. Returns the paths."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    paths = []
    for step in range(steps):
        x = make_input(step)
        x_ref = x.detach().clone().requires_grad_(x.requires_grad)
        opt.zero_grad()
        opt_ref.zero_grad()
        (out, saved), (expected, saved_ref) = saving(sm, x), saving(ref, x_ref)
        paths.append(last_path(sm))
        # What autograd keeps outside the checkpointed regions: as eager's (a region
        # traced through would keep its activations).
        assert saved == saved_ref, f"step {step}: {saved} tensors kept for backward, eager keeps {saved_ref}"
        assert_close(out, expected, atol=1e-5, what=f"output, step {step}")
        out.square().sum().backward()
        expected.square().sum().backward()
        if x.requires_grad:
            assert_close(x.grad, x_ref.grad, atol=1e-5, what=f"input grad, step {step}")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, atol=1e-5, what=f"grad {name}, step {step}")
        opt.step()
        opt_ref.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, what=name)
    assert planned in paths, paths  # the schedule itself ran, not only the model as written
    return paths


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_checkpointed_branches_train_as_eager(reentrant, executor):
    torch.manual_seed(0)
    model = CheckpointedBranches(reentrant).train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    _train_alongside(
        sm,
        model,
        ref,
        lambda step: torch.randn(8 + step % 3, 16, requires_grad=True),
        steps=8,
        planned=f"plan:{executor}",
    )


def test_checkpointed_members_train_as_eager():
    torch.manual_seed(0)
    model = CheckpointedMembers().train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_alongside(sm, model, ref, lambda step: torch.randn(5, 16), steps=6, planned="plan:serial")


def test_checkpointed_members_fused_by_the_plan_train_as_eager():
    """The members' checkpointed bodies, called directly: fused into stacked kernels the
    recomputation runs again."""

    class Direct(nn.Module):
        def __init__(self):
            super().__init__()
            self.members = nn.ModuleList(_Member(16).body for _ in range(6))

        def forward(self, x):
            return checkpoint(lambda t: torch.stack([m(t) for m in self.members]), x, use_reentrant=False)

    torch.manual_seed(0)
    model = Direct().train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_alongside(sm, model, ref, lambda step: torch.randn(5, 16), steps=6, planned="plan:serial")


@pytest.mark.cuda
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointed_branches_on_streams_train_as_eager(emulated_cuda, reentrant):
    torch.manual_seed(0)
    model = CheckpointedBranches(reentrant).cuda().train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, fuse=False)
    _train_alongside(
        sm,
        model,
        ref,
        lambda step: torch.randn(8, 16, device="cuda", requires_grad=True),
        steps=5,
        planned="plan:streams",
    )
    assert sm.plan.num_streams > 1
    assert emulated_cuda.take_reports() == []
    assert_path(sm, "plan:streams")


class _Branchy(nn.Module):
    """Independent towers: what a nested plan schedules (fused or side by side)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, d)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(t(x) for t in self.towers)


class CheckpointedThroughAnObject(nn.Module):
    """Layers checkpointing their body through a partial they hold, as transformers'
    ``gradient_checkpointing_enable`` does: the trace cannot take the call, the layer
    runs as written, and its children are scheduled by nested plans, inside the region."""

    def __init__(self, reentrant: bool, n: int = 2, d: int = 16):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.layers = nn.ModuleList(_PartialLayer(reentrant, d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x


class _PartialLayer(nn.Module):
    def __init__(self, reentrant: bool, d: int):
        super().__init__()
        self.inner = _Branchy(d)
        self.norm = nn.LayerNorm(d)
        self.checkpointing = functools.partial(checkpoint, use_reentrant=reentrant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.checkpointing(functools.partial(_PartialLayer.body, self), x)

    def body(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.inner(x))


@pytest.mark.parametrize("reentrant", [False, True])
def test_nested_plans_inside_a_region_recompute_what_the_forward_saved(reentrant):
    """The region's recomputation must save the tensors its forward saved (checkpoint
    checks): a wrapper called inside a region runs as written, whichever way its other
    calls take."""
    torch.manual_seed(0)
    model = CheckpointedThroughAnObject(reentrant).train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_alongside(
        sm, model, ref, lambda step: torch.randn(6, 16, requires_grad=True), steps=8, planned="plan:serial"
    )
    assert "layers.0" in str([o.path for o in sm.plan.opaque]), sm.plan


def _checkpoint_stages(stages, x):
    """timm's ``checkpoint_seq``: a closure per segment, made while the forward runs."""

    def segment(i):
        def run(t):
            return stages[i](t)

        return run

    for i in range(len(stages)):
        x = torch.utils.checkpoint.checkpoint(segment(i), x, use_reentrant=False)
    return x


class CheckpointedStages(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.stages = nn.ModuleList(_Branchy(d) for _ in range(2))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(_checkpoint_stages(self.stages, self.stem(x)))


def test_a_checkpoint_handed_a_closure_made_in_the_forward_runs_its_caller_as_written():
    torch.manual_seed(0)
    model = CheckpointedStages().train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_alongside(
        sm, model, ref, lambda step: torch.randn(6, 16, requires_grad=True), steps=6, planned="plan:serial"
    )
    assert "_checkpoint_stages" in str(sm.plan.opaque_functions), sm.plan
