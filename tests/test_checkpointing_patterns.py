"""Activation checkpointing (``torch.utils.checkpoint``) inside a wrapped model, in the
patterns libraries use (``frontend.checkpointing``; ``test_activation_checkpointing.py``
holds the mechanism's own tests).

A checkpointed region runs its forward twice: once without keeping its activations, and
again during backward. A trace would go through ``checkpoint`` and record the region's
operations as plain nodes: outputs and gradients still equal eager's, but nothing is
recomputed and every activation is kept, the memory the user turned checkpointing on
to save. The models here checkpoint as the common libraries do: a layer whose own
``forward`` checkpoints its body when a flag is set (transformers' layers), and a
model that hands its blocks to a helper function that checkpoints each one (timm's
``checkpoint_seq``), with the reentrant and the non-reentrant implementation. Each
training step is compared with eager (outputs and every gradient), and the layers
inside the checkpointed region must run as often as eager runs them: again in backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, 2 * D)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * D, D)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


class CheckpointingLayer(nn.Module):
    """Checkpoints its own body when ``gradient_checkpointing`` is set and training."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.block = Block()
        self.norm = nn.LayerNorm(D)
        self.gradient_checkpointing = False
        self.reentrant = reentrant

    def body(self, x):
        return self.norm(self.block(x))

    def forward(self, x):
        if self.gradient_checkpointing and self.training:
            return checkpoint(self.body, x, use_reentrant=self.reentrant)
        return self.body(x)


class LayeredModel(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layers = nn.ModuleList(CheckpointingLayer(reentrant) for _ in range(2))
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)

    def enable_checkpointing(self) -> None:
        for layer in self.layers:
            layer.gradient_checkpointing = True


def checkpoint_each(blocks: nn.Sequential, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    for block in blocks:
        x = checkpoint(block, x, use_reentrant=reentrant)
    return x


class SequenceModel(nn.Module):
    """Hands its blocks to a helper function that checkpoints each of them."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.stem = nn.Linear(D, D)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(D, 3)
        self.grad_checkpointing = False
        self.reentrant = reentrant

    def forward(self, x):
        x = self.stem(x)
        if self.grad_checkpointing:
            x = checkpoint_each(self.blocks, x, self.reentrant)
        else:
            x = self.blocks(x)
        return self.head(x)

    def enable_checkpointing(self) -> None:
        self.grad_checkpointing = True


def count_block_calls(model: nn.Module) -> dict:
    """How many times the Linear layers inside the blocks ran (forward hooks)."""
    calls = {"n": 0}

    def hook(module, args, out):
        calls["n"] += 1

    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".fc" in f".{name.rsplit('.', 1)[-1]}":
            m.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
@pytest.mark.parametrize("make", [LayeredModel, SequenceModel], ids=["layer-forward", "helper-function"])
def test_checkpointed_regions_are_recomputed_in_backward_as_eager(make, executor, reentrant):
    torch.manual_seed(0)
    model = make(reentrant)
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for m in (eager, model):
        m.train()
        m.enable_checkpointing()
    counted_eager, counted = count_block_calls(eager), count_block_calls(model)
    paths = []
    for step in range(6):
        x = torch.randn(4, D, requires_grad=reentrant)
        for m in (eager, model):
            for p in m.parameters():
                p.grad = None
        counted_eager["n"] = counted["n"] = 0
        expected = eager(x)
        expected.square().sum().backward()
        out = sm(x)
        paths.append(assert_path(sm, "recorded", "plan", "as-written", "eager-dispatch"))
        assert_close(out, expected, what=f"step {step} ({paths[-1]})")
        out.square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert_close(q.grad, p.grad, what=f"step {step} ({paths[-1]}): {name}.grad")
        # Eager runs each block's layers twice: forward, and again in backward.
        assert counted["n"] == counted_eager["n"], (
            f"step {step} ({paths[-1]}): the checkpointed layers ran {counted['n']} times, "
            f"eager {counted_eager['n']} (paths {paths})"
        )
    if executor != "auto":
        assert paths[-1].startswith("plan"), paths


def test_a_checkpointing_layer_in_eval_is_traced_through():
    """Without training, the layer does not checkpoint: its body is traced and scheduled
    as any forward's (the checkpointing trace is its own, made for training)."""
    torch.manual_seed(0)
    model = LayeredModel(reentrant=False)
    model.enable_checkpointing()
    sm = ss.StreamScheduledModule(model, executor="serial").eval()
    x = torch.randn(4, D)
    with torch.no_grad():
        sm(x)
        out = sm(x)
    assert_path(sm, "plan")
    assert_close(out, model(x))
    assert not sm.plan.opaque and not sm.plan.opaque_functions


class TwoHeads(nn.Module):
    """Two Linear layers reading one tensor: fused into one matmul where planned."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x):
        return self.a(x) * torch.sigmoid(self.b(x))


class CheckpointsTwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = TwoHeads()
        self.norm = nn.LayerNorm(D)

    def body(self, x):
        return self.norm(self.heads(x))

    def forward(self, x):
        if self.training:
            return checkpoint(self.body, x, use_reentrant=False)
        return self.body(x)


class HeadsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layer = CheckpointsTwoHeads()
        self.out = nn.Linear(D, 3)

    def forward(self, x):
        return self.out(self.layer(self.inp(x)))


@pytest.mark.parametrize("executor", ["serial", "auto"])
def test_children_inside_a_checkpointed_region_run_as_the_recomputation_does(executor):
    """The module that checkpoints runs as written, and its children would get plans of
    their own (nested plans), run in the forward; the recomputation in backward runs
    them as written (the parent's call is over). A plan whose operations differ from
    eager's (two heads fused into one matmul) then saves other tensors than the
    recomputation makes, and the checkpoint refuses the backward: inside a checkpointed
    region the children run as written."""
    torch.manual_seed(0)
    model = HeadsModel().train()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for step in range(6):
        x = torch.randn(4, D)
        for m in (eager, model):
            for p in m.parameters():
                p.grad = None
        expected = eager(x)
        expected.square().sum().backward()
        out = sm(x)
        path = assert_path(sm, "recorded", "plan", "as-written")
        assert_close(out, expected, what=f"step {step} ({path})")
        out.square().sum().backward()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert_close(q.grad, p.grad, what=f"step {step} ({path}): {name}.grad")


@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_a_wrapped_module_checkpointed_by_its_caller_runs_as_written_there(executor):
    """A wrapped module called inside the caller's ``checkpoint`` runs twice per step
    (forward, recomputation): the recording call then a plan, or the trial's candidates
    in turn, would save other tensors each time, and the checkpoint refuses the
    backward. There it runs as written, on both calls; outside, it is scheduled."""
    torch.manual_seed(0)
    model = TwoHeads()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for step in range(5):
        x = torch.randn(4, D, requires_grad=True)
        x_eager = x.detach().clone().requires_grad_()
        for m in (eager, model):
            for p in m.parameters():
                p.grad = None
        expected = checkpoint(eager, x_eager, use_reentrant=False)
        expected.square().sum().backward()
        out = checkpoint(sm, x, use_reentrant=False)
        assert_path(sm, "as-written")
        out.square().sum().backward()
        assert_path(sm, "as-written")
        assert_close(out, expected, what=f"step {step}")
        assert_close(x.grad, x_eager.grad, what=f"step {step}: input grad")
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            assert_close(q.grad, p.grad, what=f"step {step}: {name}.grad")
    x = torch.randn(4, D)
    sm(x)
    sm(x)
    assert_path(sm, "recorded", "plan", "as-written")
    if executor != "auto":
        assert_path(sm, "plan")
