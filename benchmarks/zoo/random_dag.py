"""Cell-based and randomly wired networks: many small independent ops per stage.

``NASNetCells`` follows the NASNet-A (mobile) normal cell: five blocks, each the sum of
two ops (separable convolutions, pooling, identity) on two earlier states, the unused
block outputs concatenated. ``RandWire`` wires each stage as a random DAG (Watts-
Strogatz, fixed seed) of ReLU-SepConv-BN nodes, as in Xie et al. (2019). Both are
deterministic for a given seed.
"""

from __future__ import annotations

import random

import torch
from torch import nn


class SepConv(nn.Module):
    """ReLU, depthwise k x k, pointwise 1x1, BatchNorm."""

    def __init__(self, c: int, k: int, stride: int = 1):
        super().__init__()
        self.relu = nn.ReLU()
        self.dw = nn.Conv2d(c, c, k, stride=stride, padding=k // 2, groups=c, bias=False)
        self.pw = nn.Conv2d(c, c, 1, bias=False)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.pw(self.dw(self.relu(x))))


def _op(name: str, c: int) -> nn.Module:
    if name == "sep3":
        return SepConv(c, 3)
    if name == "sep5":
        return SepConv(c, 5)
    if name == "avg3":
        return nn.AvgPool2d(3, stride=1, padding=1, count_include_pad=False)
    if name == "max3":
        return nn.MaxPool2d(3, stride=1, padding=1)
    return nn.Identity()


# NASNet-A normal cell: (input a, op a, input b, op b) for each of the five blocks;
# input 0 is the previous cell's output, 1 the one before it.
_NASNET_A = [
    (0, "sep3", 1, "identity"),
    (1, "sep3", 1, "sep5"),
    (0, "avg3", 1, "identity"),
    (1, "avg3", 1, "avg3"),
    (1, "sep5", 1, "sep3"),
]


class NormalCell(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.prep0 = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.prep1 = nn.Sequential(nn.ReLU(), nn.Conv2d(c, c, 1, bias=False), nn.BatchNorm2d(c))
        self.ops_a = nn.ModuleList(_op(a_op, c) for _, a_op, _, _ in _NASNET_A)
        self.ops_b = nn.ModuleList(_op(b_op, c) for _, _, _, b_op in _NASNET_A)
        self.reduce = nn.Conv2d(6 * c, c, 1, bias=False)

    def forward(self, h: torch.Tensor, h_prev: torch.Tensor) -> torch.Tensor:
        states = [self.prep0(h), self.prep1(h_prev)]
        for (a, _, b, _), op_a, op_b in zip(_NASNET_A, self.ops_a, self.ops_b):
            states.append(op_a(states[a]) + op_b(states[b]))
        return self.reduce(torch.cat(states[1:], dim=1))


class NASNetCells(nn.Module):
    """A stem and ``cells`` NASNet-A normal cells at ``channels`` channels."""

    def __init__(self, channels: int = 44, cells: int = 4, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels))
        self.cells = nn.ModuleList(NormalCell(channels) for _ in range(cells))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_prev = h = self.stem(x)
        for cell in self.cells:
            h, h_prev = cell(h, h_prev), h
        return self.fc(torch.flatten(self.pool(h), 1))


def watts_strogatz_dag(nodes: int, k: int, p: float, seed: int) -> list[list[int]]:
    """Predecessors of each node of a Watts-Strogatz graph oriented low -> high index."""
    rng = random.Random(seed)
    edges = set()
    for i in range(nodes):
        for j in range(1, k // 2 + 1):
            edges.add((i, (i + j) % nodes))
    rewired = set()
    for u, v in sorted(edges):
        if rng.random() < p:
            w = rng.randrange(nodes)
            while w == u or (min(u, w), max(u, w)) in rewired:
                w = rng.randrange(nodes)
            v = w
        rewired.add((min(u, v), max(u, v)))
    preds: list[list[int]] = [[] for _ in range(nodes)]
    for u, v in sorted(rewired):
        preds[v].append(u)
    return preds


class RandStage(nn.Module):
    def __init__(self, c: int, nodes: int, seed: int):
        super().__init__()
        self.preds = watts_strogatz_dag(nodes, 4, 0.75, seed)
        self.nodes = nn.ModuleList(SepConv(c, 3) for _ in range(nodes))
        succs = {u for ps in self.preds for u in ps}
        self.sinks = [i for i in range(nodes) if i not in succs]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs: list[torch.Tensor] = []
        for i, node in enumerate(self.nodes):
            ps = self.preds[i]
            inp = x if not ps else outs[ps[0]]
            for p in ps[1:]:
                inp = inp + outs[p]
            outs.append(node(inp))
        total = outs[self.sinks[0]]
        for s in self.sinks[1:]:
            total = total + outs[s]
        return total / len(self.sinks)


class RandWire(nn.Module):
    """A stem and ``stages`` random-DAG stages of ``nodes`` nodes (seeded)."""

    def __init__(self, channels: int = 78, stages: int = 2, nodes: int = 16, seed: int = 0, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(channels))
        self.stages = nn.ModuleList(RandStage(channels, nodes, seed + s) for s in range(stages))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for stage in self.stages:
            h = stage(h)
        return self.fc(torch.flatten(self.pool(h), 1))
