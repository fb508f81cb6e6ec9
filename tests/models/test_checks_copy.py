"""The model checks' float64 copy of a model whose forward left a tensor holding its
graph in an attribute (RecurrentGemma keeps its last recurrent state)."""

from __future__ import annotations

import torch
from torch import nn

from .checks import double_copy


class KeepsState(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = None

    def forward(self, x):
        y = self.lin(x)
        self.state = y.sum(0)  # holds the graph until the next call
        return y


def test_a_float64_copy_of_a_model_holding_a_graph_in_an_attribute():
    model = KeepsState()
    model(torch.randn(3, 4))
    assert not model.state.is_leaf
    m64 = double_copy(model)
    assert m64.lin.weight.dtype == torch.float64
    assert m64.state.is_leaf and torch.equal(m64.state, model.state.detach().double())
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(m64(x), model.double()(x))
