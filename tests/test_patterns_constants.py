"""Tensors a forward makes from plain values (``torch.zeros(4, 4)``, ``torch.randn(d)``,
``torch.from_numpy(...)``) are made on every call, as in eager, compared with eager on
fresh inputs under several executors: random values drawn anew, writes into them not
carried from one call to the next, a fresh output object each call."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 6
GLOBAL = torch.ones(D)


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Linear(D, D)


class ScattersIntoZeros(Pair):
    def forward(self, x, index):
        out = torch.zeros(D, D)  # plain sizes: no graph value among the arguments
        out.scatter_(1, index, self.left(x))
        return out + self.right(x)


class AddsNoise(Pair):
    def forward(self, x):
        return self.left(x) + self.right(x) + torch.randn(D, D)


class ReturnsAConstant(Pair):
    def forward(self, x):
        return self.left(x) + self.right(x), torch.ones(2), torch.tensor([1.0, 2.0])


class WritesANumpyConstant(Pair):
    def forward(self, x):
        acc = torch.from_numpy(np.zeros((D, D), dtype=np.float32))  # no factory: a constant
        acc += self.left(x)
        return acc + self.right(x)


class TensorOfANumpyArray(Pair):
    def forward(self, x):
        acc = torch.tensor(np.zeros((D, D), dtype=np.float32))  # a factory a node cannot hold
        acc += self.left(x)
        return acc + self.right(x)


class PythonLayerDrop(Pair):
    def forward(self, x):
        y = self.left(x)
        if random.random() < 0.5:  # a Python random number: drawn anew every call in eager
            y = y + self.right(x)
        return y


class NoiseLikeAGlobal(Pair):
    def forward(self, x):
        noise = torch.randn_like(GLOBAL)  # a factory reading a real tensor: a node
        mask = nn.functional.dropout(GLOBAL, 0.5, True)  # random numbers from a real tensor
        return self.left(x) + self.right(x) + noise * mask


def _inputs(name: str) -> tuple:
    x = torch.randn(D, D)
    if name == "scatter":
        return x, torch.randint(0, D, (D, D))
    return (x,)


CASES = {
    "scatter": ScattersIntoZeros,
    "noise": AddsNoise,
    "returns_constant": ReturnsAConstant,
    "numpy_constant": WritesANumpyConstant,
    "tensor_of_numpy": TensorOfANumpyArray,
    "python_random": PythonLayerDrop,
    "noise_like_global": NoiseLikeAGlobal,
}
EXECUTORS = {"serial": {"executor": "serial"}, "threads": {"executor": "threads", "min_task_cost": 0.0}}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", CASES)
def test_tensors_made_from_plain_values_are_made_every_call(name, executor):
    torch.manual_seed(0)
    model = CASES[name]()
    sm = ss.StreamScheduledModule(model, **EXECUTORS[executor])
    returned = []
    paths = set()
    for call in range(6):
        inputs = _inputs(name)
        torch.manual_seed(100 + call)
        random.seed(call)
        expected = model(*inputs)
        torch.manual_seed(100 + call)
        random.seed(call)
        actual = sm(*inputs)
        paths.add(assert_path(sm, "recorded", "plan", "eager-dispatch"))
        assert_close(actual, expected, what=f"{name} call {call} ({paths})")
        returned.append(actual)
        if isinstance(actual, tuple):
            actual[1].add_(10)  # the caller owns what it got: later calls must not see this
    if name not in ("noise_like_global", "python_random"):  # random draws outside the graph: not traced
        assert "plan:serial" in paths or "plan:threads" in paths
    if name == "returns_constant":
        assert len({id(out[1]) for out in returned}) == len(returned)


class SeedsItsNoise(nn.Module):
    """Reseeds the generator in its forward, then draws (a fixed noise pattern per call)."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(8, 8)
        self.right = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, x):
        torch.manual_seed(1234)
        return self.left(x) + self.right(x) + torch.rand(x.shape[0], 8)


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
def test_a_forward_that_reseeds_the_generator_reseeds_it_every_call(executor):
    # The trace ran torch.manual_seed once: later calls drew on from wherever the
    # generator was, not from the seed (and left it elsewhere than eager leaves it).
    model = SeedsItsNoise()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(6):
        x = torch.randn(3, 8)
        expected, after_eager = model(x), torch.rand(2)
        out, after = sm(x), torch.rand(2)
        assert_close(out, expected, what=f"call {call}")
        assert torch.equal(after, after_eager), f"call {call}: the generator is not where eager leaves it"
