"""Ensembles and multi-task heads: independent networks over one input."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class Critic(nn.Module):
    def __init__(self, obs: int = 23, hidden: int = 64):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(obs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CriticEnsemble(nn.Module):
    """``n`` critics reading the same observation; outputs stacked to ``[n, B, 1]``."""

    def __init__(self, n: int = 32, obs: int = 23, hidden: int = 64):
        super().__init__()
        self.critics = nn.ModuleList(Critic(obs, hidden) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([c(x) for c in self.critics])


class HandStackedCritics(nn.Module):
    """``CriticEnsemble`` rewritten by hand for inference, as fast as people write it:
    each layer's weights stacked once as ``[n, in, out]`` (contiguous: no transposed
    operand for the CPU's batched matmul) and biases as ``[n, 1, out]``, one ``baddbmm``
    per layer, ReLU in place. Copies of ``src``'s weights, held as buffers (no
    gradients)."""

    def __init__(self, src: CriticEnsemble):
        super().__init__()
        layers = [[c.net[i] for c in src.critics] for i in (0, 2, 4)]
        self.n = len(src.critics)
        with torch.no_grad():
            for k, layer in enumerate(layers):
                self.register_buffer(f"w{k}", torch.stack([m.weight.t() for m in layer]).contiguous())
                self.register_buffer(f"b{k}", torch.stack([m.bias for m in layer]).unsqueeze(1).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.baddbmm(self.b0, x.expand(self.n, *x.shape), self.w0).relu_()
        h = torch.baddbmm(self.b1, h, self.w1).relu_()
        return torch.baddbmm(self.b2, h, self.w2)


class StackedCritics(nn.Module):
    """``CriticEnsemble`` rewritten by hand (weights copied from ``src``): each layer's
    weights of all critics as one stacked parameter ``[n, out, in]`` (bias ``[n, out]``);
    the first layer as one wide ``linear`` (all critics read the same input), the others
    as ``baddbmm`` over the stacked weights."""

    def __init__(self, src: CriticEnsemble):
        super().__init__()
        layers = [[c.net[i] for c in src.critics] for i in (0, 2, 4)]
        with torch.no_grad():
            self.w = nn.ParameterList(torch.stack([m.weight for m in ms]).clone() for ms in layers)
            self.b = nn.ParameterList(torch.stack([m.bias for m in ms]).clone() for ms in layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, hidden, obs = self.w[0].shape
        h = torch.relu(F.linear(x, self.w[0].reshape(n * hidden, obs), self.b[0].reshape(-1)))
        h = h.view(x.shape[0], n, hidden).transpose(0, 1)
        h = torch.relu(torch.baddbmm(self.b[1].unsqueeze(1), h, self.w[1].transpose(1, 2)))
        return torch.baddbmm(self.b[2].unsqueeze(1), h, self.w[2].transpose(1, 2))

    def member_grads(self) -> dict[str, Optional[torch.Tensor]]:
        """The stacked gradients cut per critic, under ``CriticEnsemble``'s parameter names
        (``critics.{i}.net.{k}.weight``), in its layout; ``None`` where there is no gradient."""
        out: dict[str, Optional[torch.Tensor]] = {}
        for w, b, k in zip(self.w, self.b, (0, 2, 4)):
            for i in range(w.shape[0]):
                out[f"critics.{i}.net.{k}.weight"] = None if w.grad is None else w.grad[i]
                out[f"critics.{i}.net.{k}.bias"] = None if b.grad is None else b.grad[i]
        return out


class MultiTaskHeads(nn.Module):
    """A shared trunk and one head per task, of different widths; returns a dict."""

    def __init__(self, d_in: int = 64, trunk: int = 256, widths: tuple[int, ...] = (10, 3, 1, 32, 7)):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(d_in, trunk), nn.GELU(), nn.LayerNorm(trunk))
        self.heads = nn.ModuleDict(
            {
                f"task{i}": nn.Sequential(nn.Linear(trunk, trunk // 2), nn.ReLU(), nn.Linear(trunk // 2, w))
                for i, w in enumerate(widths)
            }
        )

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.trunk(x)
        return {name: head(h) for name, head in self.heads.items()}
