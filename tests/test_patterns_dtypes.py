"""Dtypes the trace derives (frontend.ranks) against models whose dtypes move in ways the
rules must not guess: a hooked submodule (its hooks may return another dtype), compared
with eager on every call and with the path asserted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import runner
from streamsched.testing import assert_path

from .helpers import assert_close


class _BranchOnDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        h = self.b(torch.relu(self.a(x)))
        if h.dtype == torch.float64:
            return h.float() * 2
        return h * 3


def test_hooked_linear_output_dtype_is_not_derived():
    # A forward hook on a Linear may hand back another dtype; a pre-hook may cast its
    # input. The rule "a Linear keeps its input's dtype" holds for torch's forward alone.
    state = {"cast": False}

    def hook(module, args, out):
        return out.double() if state["cast"] else out

    def make():
        model = _BranchOnDtype()
        model.b.double()
        model.a.register_forward_hook(hook)
        return model

    torch.manual_seed(0)
    model = make()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for cast in (True, False, True):
        state["cast"] = cast
        for _ in range(2):
            x = torch.randn(4, 8)
            try:
                expected = model(x)
            except RuntimeError:
                expected = None  # float input into the double Linear
            if expected is None:
                continue
            out = sm(x)
            assert_path(sm, "recorded", "plan", "as-written", "eager-dispatch")
            assert_close(out, expected, what=f"cast={cast}")


class _BranchOnRank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.dim() == 3:
            return h.sum(0) * 2
        return h * 3


def test_hooked_linear_output_rank_is_not_derived():
    state = {"lift": False}

    def hook(module, args, out):
        return out.unsqueeze(0) if state["lift"] else out

    torch.manual_seed(0)
    model = _BranchOnRank()
    model.a.register_forward_hook(hook)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for lift in (True, False, True):
        state["lift"] = lift
        for _ in range(2):
            x = torch.randn(4, 8)
            out = sm(x)
            assert_path(sm, "recorded", "plan", "as-written", "eager-dispatch")
            assert_close(out, model(x), what=f"lift={lift}")


class _EmbeddingDtypeBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 2)
        self.emb = nn.Embedding(10, 8)

    def forward(self, ids):
        h = self.emb(ids)
        if h.dtype == torch.float64:
            return self.head(h.float()) * 2
        return self.head(h) * 3


def test_parameter_replaced_in_its_table_moves_the_dtype_guard(monkeypatch):
    # Changes this frequent are churn, which runs the model as written for a window of
    # calls (Runner.retrace) under every executor: here the plan must see each change.
    monkeypatch.setattr(runner, "CHURN_RETRACES", 1000)
    # torch.func.functional_call (and torch.nn.utils.stateless) put the given tensors
    # straight into the modules' _parameters, without __setattr__: the dtype guard must
    # look at the tensor the module holds now, not the one it held when the probes were made.
    torch.manual_seed(0)
    model = _EmbeddingDtypeBranch()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(2):
        ids = torch.randint(0, 10, (3, 4))
        assert_close(sm(ids), model(ids))
    assert_path(sm, "plan")
    double = {"emb.weight": model.emb.weight.detach().double()}
    for _ in range(2):
        ids = torch.randint(0, 10, (3, 4))
        out = torch.func.functional_call(sm, double, (ids,))
        assert_close(out, torch.func.functional_call(model, double, (ids,)), what="functional_call")
    same = {"emb.weight": torch.randn(10, 8)}  # the same dtype: the plan stands
    for _ in range(2):
        ids = torch.randint(0, 10, (3, 4))
        out = torch.func.functional_call(sm, same, (ids,))
        assert_close(out, torch.func.functional_call(model, same, (ids,)), what="functional_call, float32")
    assert_path(sm, "plan")
    model.emb._parameters["weight"] = nn.Parameter(model.emb.weight.detach().double())
    for _ in range(2):
        ids = torch.randint(0, 10, (3, 4))
        out = sm(ids)
        assert_path(sm, "recorded", "plan", "eager-dispatch")
        assert_close(out, model(ids), what="replaced in _parameters")


class _PromotedBranch(nn.Module):
    """A dtype that follows by type promotion: a float32 Linear's output times a float64
    parameter (and a 0-dim float64 input, which promotes less) is float64."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.rand(8, dtype=torch.float64) + 0.5)

    def forward(self, x, t):
        h = self.a(x) * t
        g = self.b(x) * self.scale
        if h.dtype == torch.float64:
            h = h * 10
        if g.dtype == torch.float64:
            return (g * 2).float() + h
        return g * 3 + h


def test_type_promotion_traces_without_adding_nodes():
    # The promotion rule asks torch.result_type of small meta tensors: made while the
    # trace runs, a factory call becomes a node of the graph (the trace's factory mode),
    # and the rule then answered nothing.
    torch.manual_seed(0)
    model = _PromotedBranch()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for t in (torch.tensor(2.0, dtype=torch.float64), torch.tensor([2.0], dtype=torch.float64)):
        for _ in range(2):
            x = torch.randn(4, 8)
            assert_close(sm(x, t), model(x, t))
        assert_path(sm, "plan")
        for traced in sm._ss.traces.values():
            targets = {n.target for n in traced.graph.nodes}
            assert torch.empty not in targets and torch.result_type not in targets
    with torch.no_grad():
        model.scale.data = model.scale.data.float()  # a cast in place: the guard re-traces
    for _ in range(2):
        x, t = torch.randn(4, 8), torch.tensor(2.0, dtype=torch.float64)
        assert_close(sm(x, t), model(x, t))
    assert_path(sm, "plan")


class _IndexedByBuffer(nn.Module):
    """``x[index]`` with a tensor index: its rank depends on the index's dtype (a boolean
    mask of x's shape selects into one dimension; integers of that shape gather, adding
    one), here a buffer's."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("index", torch.rand(4, 8) > 0.5)

    def forward(self, x):
        h = (self.a(x) + self.b(x))[self.index]
        if h.dim() == 1:
            return h.sum() * 2
        return h.sum() * 3


@pytest.mark.parametrize("how", ["assign", "data"])
def test_rank_from_a_buffers_dtype_is_guarded(how):
    torch.manual_seed(0)
    model = _IndexedByBuffer()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(2):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan")
    gather = torch.randint(0, 4, (4, 8))  # the same rank, another dtype: another rank out
    if how == "assign":
        model.index = gather
    else:
        model.index.data = gather
    for _ in range(2):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=how)
    assert_path(sm, "plan")


class _BranchOnAttributeRank(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.register_buffer("mask", torch.rand(4, 8) > 0.5)
        self.scale = nn.Parameter(torch.rand(8) + 0.5)

    def forward(self, x):
        h = (self.a(x) + self.b(x))[self.mask]
        if self.scale.dim() == 2:
            h = h * 10
        if h.dim() == 1:
            return h.sum() * 2
        return h.sum() * 3


@pytest.mark.parametrize("how", ["buffer", "buffer_data", "parameter", "parameter_data"])
def test_rank_of_a_tensor_attribute_is_guarded(how):
    # A get_attr's rank is read off the tensor when tracing; re-assigned (or given new
    # data) with another rank, the plan made for the old one must not run.
    torch.manual_seed(0)
    model = _BranchOnAttributeRank()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(2):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan")
    if how == "buffer":
        model.mask = torch.rand(4) > 0.5
    elif how == "buffer_data":
        model.mask.data = torch.rand(4) > 0.5
    elif how == "parameter":
        model.scale = nn.Parameter(torch.rand(1, 8))
    else:
        model.scale.data = torch.rand(1, 8)
    for _ in range(2):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what=how)
    assert_path(sm, "plan")
