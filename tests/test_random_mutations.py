"""Random call sequences on a branchy model changed while wrapped, eager against wrapped.

Between calls, applied to the eager model and the wrapped one alike: a forward hook
added to a random submodule (it scales the output and counts its calls) or removed, an
activation swapped for another module, a parameter frozen or unfrozen, a parameter
written in place, the model cast to float64 and back, ``train()``/``eval()``. Between
changes come either three of the same call (a loop's usual one: the plans made before a
change, and the shortcut a repeated call takes, are met again after it) or one that
varies batch size, image size, channels-last or transposed
memory, grad mode, an input that takes a gradient, an optimizer step after some. Every call must equal eager
(outputs, every hook's count of calls, buffers, parameters' gradients, the input's
gradient); the test asserts that plans with fused kernels ran between the changes.
"""

from __future__ import annotations

import copy
import random
from collections import Counter

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path


class Branchy(nn.Module):
    """Two convolution towers with BatchNorm, pooled, and eight linear heads on their
    sum: the heads fuse, the towers run side by side."""

    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.right = nn.Sequential(nn.Conv2d(3, 8, 5, padding=2), nn.BatchNorm2d(8), nn.GELU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 2)) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.left(x) + self.right(x)).flatten(1)
        return torch.cat([head(h) for head in self.heads], 1)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def leaves(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if name and not list(m.children())]


def mutate(rng: random.Random, eager: nn.Module, sm: ss.StreamScheduledModule, hooks: list, log: list) -> None:
    """One random change, made to both models."""
    wrapped = sm.module
    r = rng.random()
    if r < 0.2:
        name = rng.choice(leaves(eager))
        counts = {"eager": 0, "wrapped": 0}

        def hook(side: str):
            def scale(module, args, out):
                counts[side] += 1
                return out * 1.5 if isinstance(out, torch.Tensor) else out

            return scale

        handles = (
            eager.get_submodule(name).register_forward_hook(hook("eager")),
            wrapped.get_submodule(name).register_forward_hook(hook("wrapped")),
        )
        hooks.append((name, counts, handles))
        log.append(f"hook on {name}")
    elif r < 0.3 and hooks:
        name, _, handles = hooks.pop(rng.randrange(len(hooks)))
        for handle in handles:
            handle.remove()
        log.append(f"hook on {name} removed")
    elif r < 0.45:
        activations = [n for n in leaves(eager) if isinstance(eager.get_submodule(n), (nn.ReLU, nn.GELU, nn.Tanh))]
        name = rng.choice(activations)
        make = rng.choice([nn.ReLU, nn.GELU, nn.Tanh, nn.SiLU])
        parent, _, attr = name.rpartition(".")
        setattr(eager.get_submodule(parent), attr, make())
        setattr(wrapped.get_submodule(parent), attr, make())
        log.append(f"{name} swapped for {make.__name__}")
    elif r < 0.55:
        k = rng.randrange(len(list(eager.parameters())))
        for model in (eager, wrapped):
            p = list(model.parameters())[k]
            p.requires_grad_(not p.requires_grad)
        log.append(f"parameter {k} requires_grad toggled")
    elif r < 0.65:
        k = rng.randrange(len(list(eager.parameters())))
        noise = torch.randn_like(list(eager.parameters())[k]) * 0.1
        with torch.no_grad():
            for model in (eager, wrapped):
                list(model.parameters())[k].add_(noise)
        log.append(f"parameter {k} written in place")
    elif r < 0.7:
        dtype = torch.float64 if next(eager.parameters()).dtype == torch.float32 else torch.float32
        eager.to(dtype)
        sm.to(dtype)
        log.append(f"cast to {dtype}")


def run_sequence(seed: int, executor: str, calls: int = 40) -> Counter:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = Branchy()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    hooks: list = []
    log: list = []
    paths: Counter = Counter()
    kinds: list[bool] = []  # the calls still to make: True for the usual call
    for i in range(calls):
        if not kinds:
            # Between runs of calls: maybe a change; then three of the loop's usual call
            # (the plans made before a change, and its shortcut, are met again after it)
            # or one that varies.
            if rng.random() < 0.5:
                mutate(rng, eager, sm, hooks, log)
            kinds = [True] * 3 if rng.random() < 0.5 else [False]
        usual = kinds.pop()
        training = not usual and rng.random() < 0.4
        grad = training or (not usual and rng.random() < 0.3)
        if training != eager.training:  # (as a loop does: only when the mode changes)
            eager.train(training)
            sm.train(training)
        dtype = next(eager.parameters()).dtype
        side = 8 if usual else rng.choice([8, 12])
        x = torch.randn(2 if usual else rng.choice([2, 3]), 3, side, side, dtype=dtype)
        layout = 1.0 if usual else rng.random()
        if layout < 0.3:
            x = x.contiguous(memory_format=torch.channels_last)
        elif layout < 0.4:
            x = x.transpose(2, 3).contiguous().transpose(2, 3)
        takes_grad = grad and rng.random() < 0.3
        x_eager, x_wrapped = x.clone().requires_grad_(takes_grad), x.clone().requires_grad_(takes_grad)
        where = f"seed {seed}, call {i}, executor {executor}, after {log[-4:]}"
        with torch.set_grad_enabled(grad):
            want = eager(x_eager)
            got = sm(x_wrapped)
        paths[last_path(sm)] += 1
        assert close(got, want), f"{where}: outputs differ ({last_path(sm)})"
        for name, counts, _ in hooks:
            assert counts["wrapped"] == counts["eager"], f"{where}: the hook on {name} ran {counts}"
        for (name, b), c in zip(eager.named_buffers(), sm.module.buffers()):
            assert close(c, b) if b.is_floating_point() else torch.equal(c, b), f"{where}: buffer {name} differs"
        if grad and want.requires_grad:
            eager.zero_grad()
            sm.module.zero_grad()
            want.pow(2).sum().backward()
            got.pow(2).sum().backward()
            for (name, p), q in zip(eager.named_parameters(), sm.module.parameters()):
                assert (p.grad is None) == (q.grad is None), f"{where}: {name}.grad is None in one"
                assert p.grad is None or close(q.grad, p.grad), f"{where}: {name}.grad differs"
            if takes_grad:
                assert close(x_wrapped.grad, x_eager.grad), f"{where}: the input's gradient differs"
            if rng.random() < 0.5:
                with torch.no_grad():
                    for model_ in (eager, sm.module):
                        for p in model_.parameters():
                            if p.grad is not None:
                                p.sub_(0.01 * p.grad)
    return paths


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
def test_random_changes_between_calls_equal_eager(executor):
    paths: Counter = Counter()
    for seed in range(6):
        paths.update(run_sequence(seed, executor))
    planned = sum(n for p, n in paths.items() if p.startswith("plan"))
    assert planned >= (50 if executor != "auto" else 15), paths
