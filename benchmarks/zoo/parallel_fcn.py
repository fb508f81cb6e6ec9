"""The reference case: N two-layer MLPs, each on its own slice of one input.

``ParallelFCN`` is the model as people write it (a Python loop over an
``nn.ModuleList``). ``GroupedConvFCN`` is the well-known hand rewrite into two grouped
``Conv1d`` layers, and ``StackedFCN`` a hand rewrite into two ``baddbmm`` calls on
pre-stacked weights: the peers a scheduler has to match (``StackedFCN`` is also the
hand-written model of the training benchmark). Both rewrites copy their
weights from a ``ParallelFCN`` so that all three compute the same function.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, d_in: int = 20, hidden: int = 10, d_out: int = 1):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.relu(self.fc1(x)))


class ParallelFCN(nn.Module):
    """``n`` MLPs; member ``i`` reads columns ``[d_in*i, d_in*(i+1))``."""

    def __init__(self, n: int = 1000, d_in: int = 20, hidden: int = 10, d_out: int = 1):
        super().__init__()
        self.n, self.d_in = n, d_in
        self.mlps = nn.ModuleList(MLP(d_in, hidden, d_out) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [m(x[:, self.d_in * i : self.d_in * (i + 1)]) for i, m in enumerate(self.mlps)]
        return torch.cat(outs, dim=1)


class GroupedConvFCN(nn.Module):
    """The hand rewrite: two grouped 1x1 ``Conv1d`` layers (weights copied from ``src``)."""

    def __init__(self, src: ParallelFCN):
        super().__init__()
        n, d_in = src.n, src.d_in
        hidden = src.mlps[0].fc1.out_features
        d_out = src.mlps[0].fc2.out_features
        self.n = n
        self.conv1 = nn.Conv1d(n * d_in, n * hidden, 1, groups=n)
        self.conv2 = nn.Conv1d(n * hidden, n * d_out, 1, groups=n)
        with torch.no_grad():
            self.conv1.weight.copy_(torch.cat([m.fc1.weight for m in src.mlps]).unsqueeze(-1))
            self.conv1.bias.copy_(torch.cat([m.fc1.bias for m in src.mlps]))
            self.conv2.weight.copy_(torch.cat([m.fc2.weight for m in src.mlps]).unsqueeze(-1))
            self.conv2.bias.copy_(torch.cat([m.fc2.bias for m in src.mlps]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.conv1(x.unsqueeze(-1)))
        return self.conv2(h).squeeze(-1)


class StackedFCN(nn.Module):
    """The hand rewrite with pre-stacked weights and two ``baddbmm`` calls."""

    def __init__(self, src: ParallelFCN):
        super().__init__()
        self.n, self.d_in = src.n, src.d_in
        with torch.no_grad():
            self.w1 = nn.Parameter(torch.stack([m.fc1.weight.t() for m in src.mlps]).contiguous())
            self.b1 = nn.Parameter(torch.stack([m.fc1.bias for m in src.mlps]).unsqueeze(1))
            self.w2 = nn.Parameter(torch.stack([m.fc2.weight.t() for m in src.mlps]).contiguous())
            self.b2 = nn.Parameter(torch.stack([m.fc2.bias for m in src.mlps]).unsqueeze(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        xs = x.view(b, self.n, self.d_in).transpose(0, 1)
        h = torch.relu(torch.baddbmm(self.b1, xs, self.w1))
        y = torch.baddbmm(self.b2, h, self.w2)
        return y.transpose(0, 1).reshape(b, -1)

    def member_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """The stacked gradients cut per member, under ``ParallelFCN``'s parameter names
        (``mlps.{i}.fc1.weight``) and in its layout (``[out, in]``: the stacked weights are
        held transposed, ``[n, in, out]``); ``None`` where there is no gradient."""
        out: dict[str, Optional[torch.Tensor]] = {}
        for layer, w, b in (("fc1", self.w1, self.b1), ("fc2", self.w2, self.b2)):
            for i in range(self.n):
                out[f"mlps.{i}.{layer}.weight"] = None if w.grad is None else w.grad[i].t()
                out[f"mlps.{i}.{layer}.bias"] = None if b.grad is None else b.grad[i, 0]
        return out
