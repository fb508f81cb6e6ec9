"""What the trace assumes of ranks is checked on the recording call (frontend.rank_checks):
a rank rule planted wrong makes the call raise, naming the node, instead of returning
what a graph built on the wrong rank computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.frontend.rank_checks import RankAssumptionError
from streamsched.frontend.ranks import RankTracker
from streamsched.testing import assert_path

from .helpers import assert_close


class Flatten(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h.reshape(*h.shape[:-1], -1)  # the length of h.shape[:-1] is baked in


class ByRank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = self.lin(x)
        return h * 2 if h.dim() == 3 else h * 3  # the rank of h decides the branch


@pytest.mark.parametrize("model_cls", [Flatten, ByRank])
def test_right_ranks_pass_the_check(model_cls):
    model = model_cls()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x = torch.randn(2, 3, 8)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_a_wrong_length_is_refused_not_computed(monkeypatch):
    length = RankTracker.length
    monkeypatch.setattr(RankTracker, "length", lambda self, node: (lambda n: n - 1 if n else n)(length(self, node)))
    model = Flatten()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with pytest.raises(RankAssumptionError, match="assuming its length is 1, but the call gave 2"):
        sm(torch.randn(2, 3, 8))


def test_a_wrong_rank_is_refused_not_computed(monkeypatch):
    rank_of = RankTracker.rank_of
    monkeypatch.setattr(RankTracker, "rank_of", lambda self, node: (lambda r: r + 1 if r else r)(rank_of(self, node)))
    model = ByRank()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with pytest.raises(RankAssumptionError, match="assuming its rank is 4, but the call gave 3"):
        sm(torch.randn(2, 3, 8))
