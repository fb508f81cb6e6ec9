"""What the plan and the Gantt chart call things.

- A task that merges cheap neighbours names the user's ``@streamsched.branch`` calls in
  it (the README's branch example: ``refine`` and ``head`` by name).
- Fused members that differ in their first path component are listed (``{a,b}``), not
  written ``*``, which reads like the plan's critical-path mark.
- The Gantt chart's "model parts" band never draws two parts that overlap in time on
  one row.
"""

from __future__ import annotations

import torch
from torch import nn

import streamsched as ss
from streamsched.observe.timeline import model_parts, part_rows
from streamsched.observe.timeline.spans import TaskSpan
from streamsched.testing import assert_path

from .helpers import assert_close


@ss.branch
def refine(x):
    while x.norm() > 1:  # data-dependent loop: fine inside a branch
        x = x / 2
    return x


class BranchExample(nn.Module):
    """The README's branch example, made whole: a function and a method marked as branches,
    between two linears that fuse."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    @ss.branch
    def head(self, h):
        if h.sum() > 0:
            return torch.relu(h)
        return h

    def forward(self, x):
        return self.out(self.head(self.a(x)) + refine(self.b(x)))


def test_branch_functions_appear_by_name_in_the_plan():
    model = BranchExample()
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(8, 16))  # plans
    x = torch.randn(8, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    names = [t.name for t in sm.plan.tasks]
    text = str(sm.plan)
    for branch in ("head", "refine"):
        assert any(branch in name for name in names), names
        assert branch in text
    assert not any(name.startswith("*") for name in names), names
    assert any(name.startswith("{a,b} [x2 wide linear]") for name in names), names


def _span(name: str, start: float, end: float, stream: int = 0) -> TaskSpan:
    return TaskSpan(task=0, name=name, stream=stream, start_us=start, end_us=end)


def test_model_parts_band_never_overlaps_parts_on_a_row():
    # Three parts running side by side (three streams), then one after them.
    entries = [
        _span("left.fc", 0, 50, 0),
        _span("middle.fc", 5, 60, 1),
        _span("right.fc", 10, 40, 2),
        _span("head", 60, 70, 0),
    ]
    parts = model_parts(entries)
    rows = part_rows(parts)
    assert max(rows) + 1 == 3  # as many rows as parts overlap at most
    for i, (_, lo_i, hi_i) in enumerate(parts):
        for j, (_, lo_j, hi_j) in enumerate(parts):
            if i < j and rows[i] == rows[j]:
                assert hi_i <= lo_j or hi_j <= lo_i, (parts[i], parts[j])
    assert rows[parts.index(("head", 60, 70))] == 0  # a free row is reused


def test_model_parts_band_of_a_sequential_model_is_one_row():
    entries = [_span(f"layer{i}.fc", 10 * i, 10 * i + 10) for i in range(5)]
    assert part_rows(model_parts(entries)) == [0] * 5
