"""``print(sm.plan)`` reads as a sentence: counts agree with their nouns ("1 task on 1
stream", "3 groups of 24 branches"), the stream bound says what it is ("at most 4"), and
times are in the unit that suits them (``_us``: microseconds below one millisecond)."""

from __future__ import annotations

import torch
from torch import nn

import streamsched as ss
from streamsched.planning.plan import _count, _us
from streamsched.testing import assert_path

from .helpers import Towers, assert_close


def test_counts_agree_with_their_nouns():
    assert [_count(n, "task") for n in (0, 1, 2)] == ["0 tasks", "1 task", "2 tasks"]
    assert _count(1, "branch") == "1 branch" and _count(24, "branch") == "24 branches"
    assert _count(3, "cross-stream wait") == "3 cross-stream waits"
    assert _us(340.46) == "340.5 us" and _us(61896.0) == "61.90 ms"


def test_a_fused_plan_of_one_task_says_so():
    model = nn.ModuleList(nn.Sequential(nn.Linear(20, 10), nn.ReLU(), nn.Linear(10, 1)) for _ in range(8))

    class Ensemble(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlps = model

        def forward(self, x):
            return torch.cat([m(x) for m in self.mlps], dim=1)

    net = Ensemble()
    sm = ss.StreamScheduledModule(net, executor="serial", num_streams=4)
    x = torch.randn(16, 20)
    sm(x)
    assert_close(sm(x), net(x))
    assert_path(sm, "plan:serial")
    text = str(sm.plan)
    assert "  1 task on 1 stream (at most 4); 0 cross-stream waits\n" in text, text
    assert "(1 task)\n" in text and "fused: 3 groups of 24 branches\n" in text, text
    assert "(s)" not in text and "1 tasks" not in text, text


def test_a_plan_of_several_streams_counts_them():
    model = Towers(3, 64)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=3, min_task_cost=0.0, fuse=False)
    x = torch.randn(4, 64)
    sm(x)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:threads")
    plan = sm.plan
    line = text_line(str(plan), "tasks on")
    assert line == (
        f"  {len(plan.tasks)} tasks on {plan.num_streams} streams (at most {plan.stream_bound}); "
        f"{_count(plan.cross_stream_waits, 'cross-stream wait')}"
    ), line
    assert plan.num_streams > 1


def text_line(text: str, part: str) -> str:
    return next(line for line in text.splitlines() if part in line)
