"""The walks of a model's modules a first call makes (``frontend.nodes.modules_of``,
``named_modules_of``, ``own_tensor_ids``) give what ``nn.Module.modules()``,
``named_modules()`` and ``parameters()`` / ``buffers()`` give: the same modules in the
same order, each once (or every time, with ``remove_duplicate=False``), with shared
modules, empty slots and containers of every kind; and torch's own answer where a class
walks its own way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from benchmarks.zoo import Inception3, ParallelFCN
from streamsched.frontend.nodes import modules_of, named_modules_of, own_tensor_ids, own_tensors


class Shared(nn.Module):
    """A module at two places, an empty slot, a dict and a sequence of containers."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.Tanh()))
        self.again = self.body[2]  # the same Sequential under a second name
        self.register_module("empty", None)
        self.table = nn.ModuleDict({"z": nn.Linear(4, 2), "a": self.body[0]})
        self.register_buffer("scale", torch.ones(2))
        self.register_buffer("missing", None)
        self.tied = nn.Linear(4, 4)
        self.tied.weight = self.body[2][0].weight  # a parameter held twice


class OwnWalk(nn.Module):
    """A child whose class walks its own way (skips its second child)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def named_modules(self, memo=None, prefix="", remove_duplicate=True):
        yield prefix, self
        yield prefix + ("." if prefix else "") + "a", self.a


class Equal(nn.Linear):
    """Instances equal to each other: torch's memo set keeps one of them."""

    def __eq__(self, other):
        return isinstance(other, Equal)

    def __hash__(self):
        return 0


class Holder(nn.Module):
    def __init__(self, *children):
        super().__init__()
        self.items = nn.ModuleList(children)


MODELS = [
    ("pfcn", lambda: ParallelFCN(5)),
    ("inception", lambda: Inception3(num_classes=10)),
    ("shared", Shared),
    ("own_walk", lambda: Holder(nn.Linear(2, 2), OwnWalk(), nn.ReLU())),
    ("equal", lambda: Holder(Equal(2, 2), Equal(2, 2), nn.ReLU())),
    ("leaf", lambda: nn.Linear(2, 3)),
]


@pytest.mark.parametrize("name,make", MODELS, ids=[m[0] for m in MODELS])
def test_the_walks_give_torchs_answers(name, make):
    model = make()
    assert [id(m) for m in modules_of(model)] == [id(m) for m in model.modules()]
    for remove in (True, False):
        ours = [(n, id(m)) for n, m in named_modules_of(model, remove_duplicate=remove)]
        assert ours == [(n, id(m)) for n, m in model.named_modules(remove_duplicate=remove)]
    assert own_tensor_ids(model) == {id(t) for t in (*model.parameters(), *model.buffers())}
    # The tensors themselves, each of them (a shared one may come again): fusion's views
    # check walks them for their storages.
    assert {id(t) for t in own_tensors(model)} == own_tensor_ids(model)
    assert all(isinstance(t, torch.Tensor) for t in own_tensors(model))


def test_the_shared_model_is_walked_with_its_duplicates():
    model = Shared()
    once = [n for n, _ in named_modules_of(model)]
    every = [n for n, _ in named_modules_of(model, remove_duplicate=False)]
    assert "again" not in once and "again" in every and "table.a" in every and "table.a" not in once
    assert once.index("body.2.1") < once.index("table")  # depth first, in registration order
