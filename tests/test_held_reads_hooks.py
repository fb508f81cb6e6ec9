"""A forward that reads a held tensor (an entry of a dict a plain object holds, an item of
a list, an object's attribute, a module's plain tensor attribute) that code the trace
does not run writes during the same call: a leaf module's forward hook or pre-hook, a
``@streamsched.branch`` function, a global module hook. The trace read the value the
previous call left and baked it in: every traced call (the recording call too) returned
the previous call's tensor. Such a trace is refused; the forward runs in eager dispatch
(global hooks: as written), exact on every call. A held read with no such code keeps its
plan, and a hook added after planning takes effect from the next call."""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import calls_alongside

D = 8
EXECUTORS = ["serial", "threads", "auto"]


def _planned(executor: str) -> tuple[str, ...]:
    """The paths a planned call may take (``auto`` runs a model this small as written)."""
    return ("recorded", "plan", "as-written") if executor == "auto" else ("recorded", "plan")


class Holder:
    """A plain object the model holds, written at run time by a hook or a branch."""

    def __init__(self):
        self.outputs = {"a": torch.zeros(4, D)}
        self.items = [torch.zeros(4, D)]
        self.last = torch.zeros(4, D)
        self.buf = torch.zeros(4, D)


def _store(where: str, holder: Holder, model: nn.Module, value: torch.Tensor) -> None:
    if where == "dict":
        holder.outputs["a"] = value
    elif where == "list":
        holder.items[0] = value
    elif where == "attribute":
        holder.last = value
    elif where == "module_attribute":
        model.last = value
    elif where == "in_place":
        holder.buf.copy_(value.detach())
    else:
        raise AssertionError(where)


def _load(where: str, holder: Holder, model: nn.Module) -> torch.Tensor:
    return {
        "dict": lambda: holder.outputs["a"],
        "list": lambda: holder.items[0],
        "attribute": lambda: holder.last,
        "module_attribute": lambda: model.last,
        "in_place": lambda: holder.buf,
    }[where]()


class Reads(nn.Module):
    """``(b(relu(a(x))), the held value, 2 * it + 1)``: the held value is written, at run time, by
    ``writer``: a forward hook on ``a`` (its output), a pre-hook on ``b`` (its input),
    a branch function (called between ``a`` and ``b``), or nothing."""

    def __init__(self, where: str = "dict", writer: str = "hook"):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)
        self.holder = Holder()
        self.last = torch.zeros(4, D)
        self.where, self.writer = where, writer
        if writer == "hook":
            self.a.register_forward_hook(self.after_a)
        elif writer == "pre_hook":
            self.b.register_forward_pre_hook(self.before_b)

    def after_a(self, module, args, out):
        _store(self.where, self.holder, self, out)

    def before_b(self, module, args):
        _store(self.where, self.holder, self, args[0])

    @ss.branch
    def store(self, t):
        self.holder.last = t * 2
        return t + 1

    def forward(self, x):
        h = torch.relu(self.a(x))
        if self.writer == "branch":
            h = self.store(h)
        y = self.b(h)
        held = _load("attribute" if self.writer == "branch" else self.where, self.holder, self)
        # Returned as it is, and computed with (an op on a held tensor runs while tracing).
        return y, held, held * 2 + 1


def _compare_calls(sm, model, ref, trains, paths, what):
    calls_alongside(sm, model, ref, trains, paths, what, D)


WRITERS = [
    ("dict", "hook"),
    ("list", "hook"),
    ("attribute", "hook"),
    ("module_attribute", "hook"),
    ("in_place", "hook"),
    ("dict", "pre_hook"),
    ("attribute", "pre_hook"),
    ("attribute", "branch"),
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("where,writer", WRITERS)
def test_held_value_written_by_run_time_code_is_read_when_eager_reads_it(where, writer, executor):
    torch.manual_seed(0)
    model = Reads(where, writer)
    ref = copy.deepcopy(model)  # (its hooks bound to the copy)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _compare_calls(
        sm, model, ref, [False, False, True, True, True, False], ("eager-dispatch", "as-written"), f"{where}/{writer}"
    )
    if last_path(sm) == "eager-dispatch":  # (sm.plan says why)
        assert "held outside the parameters and buffers" in str(sm.plan), str(sm.plan)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_held_read_without_run_time_writers_keeps_its_plan(executor):
    torch.manual_seed(0)
    model = Reads("attribute", writer="none")
    ref = copy.deepcopy(model)  # (its hooks bound to the copy)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _compare_calls(sm, model, ref, [False, False, False, True, True], _planned(executor), "no writer")
    assert "held outside" not in str(sm.plan)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_hook_added_after_planning_takes_effect_from_the_next_call(executor):
    torch.manual_seed(0)
    model = Reads("dict", writer="none")
    ref = copy.deepcopy(model)  # (its hooks bound to the copy)
    sm = ss.StreamScheduledModule(model, executor=executor)
    _compare_calls(sm, model, ref, [True, True, True], _planned(executor), "before the hook")
    for m in (model, ref):
        m.a.register_forward_hook(m.after_a)
    _compare_calls(sm, model, ref, [True, True, False, False], ("eager-dispatch", "as-written"), "after the hook")


@pytest.mark.parametrize("executor", EXECUTORS)
def test_global_forward_hook_writing_the_held_value(executor):
    torch.manual_seed(0)
    model = Reads("dict", writer="none")
    ref = copy.deepcopy(model)  # (its hooks bound to the copy)
    sm = ss.StreamScheduledModule(model, executor=executor)

    def collect(module, args, out):
        for m in (model, ref):
            if module is m.a:
                m.holder.outputs["a"] = out

    handle = nn.modules.module.register_module_forward_hook(collect)
    try:
        _compare_calls(sm, model, ref, [False, False, True, True], ("eager-dispatch", "as-written"), "global hook")
    finally:
        handle.remove()
    # Without the global hook nothing writes the value: the forward is planned again.
    for m in (model, ref):
        m.holder.outputs["a"] = torch.ones(4, D)
    _compare_calls(sm, model, ref, [True, True, True], _planned(executor), "hook removed")


def test_writer_hook_collecting_with_partial_on_a_plain_object():
    """The shape of the report: a collector object registers ``partial`` hooks and the
    forward returns what it collected; the first call finds the dict empty."""

    class Collector:
        def __init__(self, named):
            self.outputs = {}
            for name, module in named.items():
                module.register_forward_hook(partial(self._collect, name))

        def _collect(self, name, module, args, out):
            self.outputs[name] = out

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(D, D), nn.Linear(D, D)
            self.collector = Collector({"a": self.a})

        def forward(self, x):
            return self.b(torch.relu(self.a(x))), self.collector.outputs["a"]

    torch.manual_seed(0)
    model = M()
    ref = copy.deepcopy(model)  # (its hooks bound to the copy)
    sm = ss.StreamScheduledModule(model, executor="serial")
    trains = [False, False, False, True, True, True]
    _compare_calls(sm, model, ref, trains, ("eager-dispatch", "as-written"), "collector")
