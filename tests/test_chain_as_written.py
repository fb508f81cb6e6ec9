"""A traced forward that is a chain (every operation reads the one before it) has nothing
to run side by side or batch: a plan could win only the forward's Python (a 30-layer
chain of small Linear layers ran as fast as eager on the serial program). In inference
under ``executor="auto"`` its call structure is decided for the model as written at every
size as soon as it is traced, with no recording call and no trial (a small language
model's decoding pass paid a 5-6 ms recording call and plan, and a trial, of a 37 ms pass for
nothing). In training the first call is still planned at once, and branchy models still
get their plan. Every call equals eager."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, ParallelFCN
from streamsched import new_signatures
from streamsched.testing import assert_path

from .helpers import assert_close


class Chain(nn.Module):
    def __init__(self, n=6, d=16):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 50)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = torch.relu(layer(h)) + h  # (h read twice: still one after another)
        return self.head(h[:, -1:])


class TwoReads(nn.Module):
    """Two layers reading one value: they could run side by side (or be batched)."""

    def __init__(self, d=16):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return self.a(x) * self.b(x)


def _recordings(monkeypatch):
    recorded = []
    compile_signature = new_signatures.compile_signature

    def counting(*args, **kwargs):
        recorded.append(1)
        return compile_signature(*args, **kwargs)

    monkeypatch.setattr(new_signatures, "compile_signature", counting)
    return recorded


def test_a_chain_in_inference_runs_as_written_with_nothing_recorded(monkeypatch):
    recorded = _recordings(monkeypatch)
    torch.manual_seed(0)
    model = Chain().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    # Greedy decoding without a cache, three prompts: every length comes back with the
    # second prompt, where its plan was recorded and tried.
    for prompt in range(3):
        ids = torch.randint(0, 50, (1, 4))
        for step in range(12):
            with torch.no_grad():
                expected, actual = reference(ids), sm(ids)
            assert_close(actual, expected, what=f"prompt {prompt}, step {step}")
            assert_path(sm, "as-written")
            ids = torch.cat([ids, expected.argmax(-1)], dim=1)
    assert recorded == [], recorded
    assert "chain" in sm.plan.reason, sm.plan.reason


def test_a_chain_in_training_is_still_planned_at_once(monkeypatch):
    recorded = _recordings(monkeypatch)
    torch.manual_seed(0)
    model = Chain().train()
    sm = ss.StreamScheduledModule(model)
    ids = torch.randint(0, 50, (2, 4))
    assert_close(sm(ids), Chain.forward(model, ids))
    assert_path(sm, "recorded")
    assert recorded == [1], recorded


def test_a_forward_with_two_reads_of_one_value_is_still_planned(monkeypatch):
    recorded = _recordings(monkeypatch)
    torch.manual_seed(0)
    model = TwoReads().eval()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for call in range(3):
            assert_close(sm(x), model(x), what=f"call {call}")
    assert recorded == [1], recorded
    assert "chain" not in sm.plan.reason, sm.plan.reason


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: ParallelFCN(n=16), (8, 20 * 16)),
        (lambda: CriticEnsemble(n=8), (8, 23)),
        (lambda: MultiTaskHeads(), (8, 64)),
    ],
)
def test_models_that_win_from_a_plan_still_get_it(make, shape):
    torch.manual_seed(0)
    model = make().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    auto = ss.StreamScheduledModule(copy.deepcopy(model))
    x = torch.randn(*shape)
    with torch.no_grad():
        for call in range(3):
            assert_close(sm(x), model(x), what=f"call {call}")
            assert_close(auto(x), model(x), what=f"auto, call {call}")
    assert_path(sm, "plan:serial")
    # Under auto the structure is traced and recorded, not decided as a chain.
    assert "chain" not in auto.plan.reason, auto.plan.reason
    assert auto.plan.fused_groups or auto.plan.num_streams > 1, auto.plan.reason
