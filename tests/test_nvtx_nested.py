"""The ranges of a nested child's plan name the child: ``"blocks.0: heads.*.0 [x4 wide
linear] [s0]"``, its path in the wrapped model before its task's name, so that two
children with the same structure (whose plans name their tasks alike) are two rows of a
timeline and two lines of ``nsys stats --report nvtx_sum``, not one.

The ranges are seen here as the torch profiler sees them (each NVTX range opens a
``record_function`` of the same name while it records); ``test_nvtx_injection.py`` checks
the same names reach a real NVTX tool. A timeline, which observes the wrapped model's own
plan only, says so for such a model and names the children to time instead.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.observe.nvtx_ranges import range_name
from streamsched.testing import assert_path

from .helpers import assert_close


class _Heads(nn.Module):
    def __init__(self, n: int = 4, d: int = 16):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.ReLU()) for _ in range(n))

    def forward(self, x):
        return torch.stack([h(x) for h in self.heads]).mean(0)


class _Checked(nn.Module):
    """A forward fx cannot trace (a check on the input's values) around two identical blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Heads() for _ in range(2))

    def forward(self, x):
        if x.abs().max() > 1e9:
            raise ValueError("input out of range")
        for block in self.blocks:
            x = x + block(x)
        return x


def _profiled_names(sm, x) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = sm(x)
    return out, [e.name for e in prof.events() if e.name.endswith("]") and " [s" in e.name]


def test_a_nested_childs_ranges_carry_its_path():
    model = _Checked()
    sm = ss.StreamScheduledModule(model, executor="serial", strict=False)
    for _ in range(3):  # records, then plans each block
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    x = torch.randn(8, 16)
    out, names = _profiled_names(sm, x)
    assert_close(out, model(x))
    plans = sm.nested_plans
    assert set(plans) == {"blocks.0", "blocks.1"}, set(plans)
    for path in plans:
        site = next(s for s in sm._ss.nested.sites() if s.path == path)
        assert_path(site.wrapper, "plan:serial")  # the profiled call ran the child's plan
    expected = [range_name(t.name, t.stream, path) for path, plan in plans.items() for t in plan.tasks]
    assert sorted(names) == sorted(expected), (names, expected)
    assert all(name.startswith(("blocks.0: ", "blocks.1: ")) for name in names), names
    # The two blocks' plans name their tasks alike; their ranges differ by the path alone.
    assert [t.name for t in plans["blocks.0"].tasks] == [t.name for t in plans["blocks.1"].tasks]


def test_the_wrapped_models_own_ranges_have_no_prefix():
    model = _Heads()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(8, 16)
    sm(x)
    out, names = _profiled_names(sm, x)
    assert_close(out, model(x))
    assert_path(sm, "plan:serial")
    assert sorted(names) == sorted(range_name(t.name, t.stream) for t in sm.plan.tasks)
    assert not any(": " in name for name in names), names


def test_a_timeline_of_a_model_whose_children_have_the_plans_says_what_to_time():
    from streamsched.observe import timeline

    model = _Checked()
    sm = ss.StreamScheduledModule(model, executor="serial", strict=False)
    x = torch.randn(8, 16)
    with torch.no_grad(), pytest.raises(RuntimeError) as info:
        timeline(sm, x)
    text = str(info.value)
    assert "sm.nested_plans: blocks.0, blocks.1" in text, text
    assert "timeline(StreamScheduledModule(model.get_submodule('blocks.0')), its input)" in text, text
    # What it advises works: the child wrapped on its own is timed task by task.
    child = ss.StreamScheduledModule(model.get_submodule("blocks.0"), executor="serial")
    with torch.no_grad():
        tl = timeline(child, x)
    assert_path(child, "plan:serial")
    assert {e.name for e in tl.entries} == {t.name for t in child.plan.tasks}
    assert_close(child(x), model.blocks[0](x))
