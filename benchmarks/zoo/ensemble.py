"""Ensembles and multi-task heads: independent networks over one input."""

from __future__ import annotations

import torch
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
