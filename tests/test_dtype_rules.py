"""Dtypes that follow from the inputs' and parameters' dtypes answer ``x.dtype`` while
tracing (frontend.ranks): a branch on a dtype (Whisper's ``if h.dtype == torch.float16``)
and ``torch.finfo(q.dtype)`` (DeBERTa's attention) trace instead of making their module
opaque. The trace is keyed by the inputs' dtypes, a parameter's dtype it relied on is
checked on every call, and the recording call checks every dtype the trace used."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.frontend.rank_checks import RankAssumptionError
from streamsched.frontend.ranks import RankTracker
from streamsched.testing import assert_path

from .helpers import assert_close


class BranchOnDtype(nn.Module):
    """Whisper's encoder layer: a branch on the dtype of a value computed by Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = x + self.b(torch.relu(self.a(x)))
        if h.dtype == torch.float64:
            return h * 2
        return h * 3


class MaskedScores(nn.Module):
    """DeBERTa's attention: ``torch.finfo(q.dtype).min`` of a query computed from an
    embedding (whose weight fixes the dtype) through a norm and a Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 4)  # the first parameter (the wrapper's placement probe)
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, ids, mask):
        h = self.norm(self.emb(ids))
        q, k = self.q(h), self.k(h)
        scores = q @ k.transpose(-1, -2)
        scores = scores.masked_fill(~mask, torch.finfo(q.dtype).min)
        if q.dtype == torch.float64:
            scores = scores * 2  # another program for another dtype
        return self.head(scores.softmax(-1).float() @ h.float())


def _masked_inputs():
    return torch.randint(0, 10, (2, 5)), torch.rand(2, 5, 5) > 0.3


def _no_opaque(sm):
    assert not sm.plan.opaque, sm.plan.opaque
    assert sm.plan.coverage == 1.0


def test_a_branch_on_a_dtype_from_the_inputs_traces():
    model = BranchOnDtype()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x = torch.randn(2, 3, 8)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    _no_opaque(sm)


def test_finfo_of_a_dtype_from_a_parameter_traces():
    model = MaskedScores()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        ids, mask = _masked_inputs()
        assert_close(sm(ids, mask), model(ids, mask))
    assert_path(sm, "plan:serial")
    _no_opaque(sm)


class InputDtype(nn.Module):
    """A branch on the dtype of the input itself; the parameters' dtype stays."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(x) + x
        if h.dtype == torch.float64:
            h = h * 2
        return self.lin(h.float())


def test_another_input_dtype_is_another_trace():
    # The same call structure and ranks in float64: the trace made for float32 took the
    # float32 branch (the trace key holds the inputs' dtypes).
    model = InputDtype()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for dtype in (torch.float32, torch.float64, torch.float32, torch.float64):
        for _ in range(2):
            x = torch.randn(2, 3, 8, dtype=dtype)
            assert_close(sm(x), model(x))
        assert_path(sm, "plan:serial")
    assert len(sm._ss.traces) == 2


def test_a_cast_of_one_submodule_re_traces():
    # Not the first parameter (the wrapper's placement probe): only the dtype guard of
    # the trace sees that the embedding is float64 now, and eager takes the float64 branch.
    model = MaskedScores()
    sm = ss.StreamScheduledModule(model, executor="serial")
    ids, mask = _masked_inputs()
    for _ in range(2):
        assert_close(sm(ids, mask), model(ids, mask))
    model.emb.double()
    model.norm.double()
    model.q.double()
    model.k.double()
    for _ in range(3):
        ids, mask = _masked_inputs()
        expected = model(ids, mask)
        assert_close(sm(ids, mask), expected)
    assert_path(sm, "plan:serial")


def test_under_autocast_input_dtypes_are_not_used():
    # Autocast computes Linears in its own dtype: the input's says nothing of theirs.
    model = BranchOnDtype()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.warns(UserWarning, match="cannot trace"):
        for _ in range(2):
            x = torch.randn(2, 3, 8)
            expected = model(x)
            assert_close(sm(x), expected, atol=0.1, rtol=0.1)
    assert_path(sm, "eager-dispatch")  # the branch on h.dtype is not decided by the input's
    tracker = RankTracker([3], [torch.float32])
    assert tracker.input_dtypes is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert RankTracker([3], [torch.float32]).input_dtypes is None


def test_a_wrong_dtype_is_refused_not_computed(monkeypatch):
    dtype_of = RankTracker.dtype_of

    def wrong(self, node):
        d = dtype_of(self, node)
        return torch.float64 if d is torch.float32 else d

    monkeypatch.setattr(RankTracker, "dtype_of", wrong)
    model = BranchOnDtype()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with pytest.raises(RankAssumptionError, match="its dtype is torch.float64, but the call gave torch.float32"):
        sm(torch.randn(2, 3, 8))


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((torch.float16, 3), (torch.float32, 0), torch.float16),  # a 0-dim tensor promotes less
        ((torch.float16, 3), (torch.float32, 2), torch.float32),
        ((torch.int64, 2), 2, torch.int64),
        ((torch.int64, 2), 2.5, None),  # the default dtype: not in the trace key
        ((torch.bfloat16, 1), (torch.float16, 1), torch.float32),
        ((torch.float16, None), (torch.float32, 0), None),  # unknown rank, the answer differs
        ((torch.float32, None), (torch.float32, None), torch.float32),
    ],
)
def test_promotion_follows_torch(a, b, expected):
    from torch import fx

    graph = fx.Graph()
    tracker = RankTracker([], [])
    operands = []
    for spec in (a, b):
        if type(spec) is tuple:
            node = graph.placeholder(f"x{len(operands)}")
            tracker.dtypes[node] = spec[0]
            if spec[1] is not None:
                tracker.rank[node] = spec[1]
            operands.append(node)
        else:
            operands.append(spec)
    assert tracker._promoted(operands, {}) == expected
