"""A plan's generated functions are compiled once per source text and only when run
(runtime/generated.py): the serial executor's whole-call function at once, the task
functions when an executor first runs them; a program whose text another program had
reuses its code under its own file name, and still names the node an error came from."""

from __future__ import annotations

import builtins

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.runtime import generated
from streamsched.runtime.program import failing_node
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
        self.right = nn.Sequential(nn.Linear(D, D), nn.ReLU(), nn.Linear(D, D))

    def forward(self, x):
        return self.left(x) + self.right(x)


def _planned(model: nn.Module, **options) -> ss.StreamScheduledModule:
    sm = ss.StreamScheduledModule(model, executor="serial", fuse=False, **options)
    for _ in range(2):
        x = torch.randn(4, D)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    return sm


def test_the_serial_executor_compiles_only_its_whole_call_function():
    model = Pair()
    sm = _planned(model)
    program = sm._ss.last.program
    assert program.call is not None
    assert program.tasks and not any(t.source.compiled for t in program.tasks)
    assert not program.serial_source.compiled and not program.load_source.compiled
    # A call whose tasks are looked at (the SyncLog) runs the task functions: compiled then.
    logged = _planned(model, sync_log=True)
    x = torch.randn(4, D)
    assert_close(logged(x), model(x))
    assert_path(logged, "plan:serial")
    tasks = logged._ss.last.program.tasks
    assert all(t.source.compiled for t in tasks)


@pytest.fixture
def compiled(monkeypatch) -> list:
    """The source texts ``generated`` compiles from now on (its cache emptied first)."""
    texts: list = []

    def counting(source, *args, **kwargs):
        texts.append(source)
        return builtins.compile(source, *args, **kwargs)

    monkeypatch.setattr(generated, "compile", counting, raising=False)
    generated._CODES.clear()
    return texts


def test_a_program_with_the_same_text_reuses_its_code_under_its_own_file_name(compiled):
    first = _planned(Pair())
    assert len(compiled) == 1  # the whole call
    model = Pair()
    second = _planned(model)
    assert len(compiled) == 1  # the same text: no second compile
    a, b = first._ss.last.program, second._ss.last.program
    assert a.call.__code__.co_code == b.call.__code__.co_code
    assert a.call.__code__.co_filename != b.call.__code__.co_filename
    assert {f for f, _ in b.lines} >= {b.call.__code__.co_filename}
    # Its own constants (modules, parameters): the second model's.
    x = torch.randn(4, D)
    assert_close(b.call([x]), model(x))
    # An error in the reused code names the node it came from.
    try:
        b.call([torch.randn(4, D + 1)])
    except RuntimeError as exc:
        label = failing_node(b, exc)
    else:
        raise AssertionError("a too-wide input ran")
    assert label is not None and "left.0" in label, label


class Fused(nn.Module):
    """Four alike heads (fused groups, whose kernels are planned at the call's sizes) and
    another head, stacked with them (the fused heads' outputs are taken apart at the
    planned sizes)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 4)) for _ in range(4))
        self.other = nn.Sequential(nn.Linear(D, 4), nn.Tanh())

    def forward(self, x):
        return torch.stack([h(x) for h in self.heads] + [self.other(x)]).sum(0)


def test_a_fused_plan_at_another_size_generates_the_same_text(compiled):
    # A fused kernel's planned sizes are constants of the program, not literals in its
    # text: a plan of the same trace at another size compiles nothing new.
    model = Fused()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for rows in (3, 5, 9):
        for _ in range(2):
            x = torch.randn(rows, D)
            assert_close(sm(x), model(x))
        assert_path(sm, "plan:serial")
        assert len(sm.plan.fused_groups) == 3
    assert len(compiled) == 1, f"{len(compiled)} compiles for one trace at three sizes"
