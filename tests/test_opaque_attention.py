"""An attention function of transformers' attention interface, run as one opaque call,
returns its output with the query's rank and dtype (frontend.opaque_functions,
``known_items``): GPT-2's ``attn_output.reshape(*attn_output.shape[:-2], -1)`` after
``sdpa_attention_forward`` traces. The promise is checked on every call that runs the
function: an output of another rank raises instead of going on in the graph."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.frontend.rank_checks import RankAssumptionError
from streamsched.testing import assert_path

from .helpers import assert_close


def toy_attention(module, query, key, value, mask, scaling=1.0):
    """The interface's shape: (batch, heads, length, dim) in, (batch, length, heads, dim)
    and the weights (None here) out. A branch on a size: fx cannot trace it."""
    if query.shape[2] > 1:
        weights = (query @ key.transpose(-1, -2) * scaling).softmax(-1)
    else:
        weights = torch.ones_like(query[..., :1])
    out = (weights @ value).transpose(1, 2)
    if bool((query > 50).any()):
        # Not what the interface returns: the rank changes with the values.
        out = out.flatten(2)
    return out, None


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q(x).view(shape).transpose(1, 2)
        k = self.k(x).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        out, weights = toy_attention(self, q, k, v, None, scaling=0.5)
        out = out.reshape(*out.shape[:-2], -1)  # the rank of an opaque call's output
        if out.dtype == torch.float64:  # and its dtype
            out = out * 2
        return self.o(out), weights


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = Attention()
        self.mlp = nn.Linear(8, 8)

    def forward(self, x):
        h, _ = self.attn(self.norm(x))
        return self.mlp(x + h)


@pytest.fixture
def interface(monkeypatch):
    """A stand-in for ``transformers.modeling_utils`` with toy_attention registered."""
    module = types.ModuleType("transformers.modeling_utils")
    module.AttentionInterface = type("AttentionInterface", (), {"_global_mapping": {"sdpa": toy_attention}})
    monkeypatch.setitem(sys.modules, "transformers.modeling_utils", module)
    return module


def _run(sm, model, dtype=torch.float32):
    for _ in range(3):
        x = torch.randn(2, 5, 8, dtype=dtype)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_an_attention_functions_output_has_its_querys_rank(interface):
    model = Block()
    sm = ss.StreamScheduledModule(model, executor="serial")
    _run(sm, model)
    assert not sm.plan.opaque, sm.plan.opaque
    assert [f.function for f in sm.plan.opaque_functions] == [f"{__name__}.toy_attention"]
    assert sm.plan.coverage == 1.0


def test_and_its_querys_dtype(interface):
    model = Block().double()
    sm = ss.StreamScheduledModule(model, executor="serial")
    _run(sm, model, torch.float64)
    assert not sm.plan.opaque, sm.plan.opaque


def test_an_unregistered_function_has_no_rank(monkeypatch):
    # Without the rule the rank of its output is unknown: the attention runs opaque.
    monkeypatch.delitem(sys.modules, "transformers.modeling_utils", raising=False)
    model = Block()
    sm = ss.StreamScheduledModule(model, executor="serial")
    _run(sm, model)
    assert [o.path for o in sm.plan.opaque] == ["attn"]


def test_another_rank_on_a_later_call_is_refused(interface):
    # The recording call saw rank 4; a later call of the same signature gets rank 3 from
    # the function (its values decide): the opaque call checks its output every time.
    model = Block()
    sm = ss.StreamScheduledModule(model, executor="serial")
    _run(sm, model)
    big = torch.full((2, 5, 8), 1000.0)
    with torch.no_grad():
        model.attn.q.bias.fill_(100.0)
    with pytest.raises(RankAssumptionError, match="toy_attention.*item 0 with rank 3, where the trace relied on 4"):
        sm(big)
