"""Planning as a list of passes, and the flat schedule it hands the runtime.

- every pass's check holds on real plans, and each dump is handed over in pass order;
- a check catches a pass that breaks what it produced, naming the pass; checks do not run
  outside ``pass_instruments``;
- the plan, the compiled program and the timeline's dependencies all come from the one
  list of scheduled tasks (streams, issue order, waits, records, storages, dependencies);
- the program cache keys on the scheduled tasks: a new size reuses the program, another
  stream does not.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.errors import PlanError
from streamsched.planning import planner
from streamsched.planning.pipeline import PlanningPass, pass_instruments, run_passes
from streamsched.runtime.program import program_key

from .helpers import Towers, assert_close, called_on
from .test_inplace_effects import Pattern

NAMES = [
    "copy-graph",
    "fuse",
    "tasks",
    "coarsen",
    "measured-costs",
    "assign-streams",
    "choose-executor",
    "cuda-graph-note",
    "critical-path",
    "scheduled-tasks",
    "plan",
]


class Heads(nn.Module):
    """Same-shaped heads (fused) beside towers of different depths (on their own lanes)."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(64, 16) for _ in range(4))
        self.towers = Towers(3, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x) for h in self.heads], dim=1).sum(1, keepdim=True) + self.towers(x)


def _planned(model: nn.Module, x: torch.Tensor, **options) -> ss.StreamScheduledModule:
    """``model`` wrapped and planned at ``x``; its plan's second call checked against eager."""
    sm = ss.StreamScheduledModule(copy.deepcopy(model), **options)
    with torch.no_grad():
        called_on(sm, "recorded", x)
        fresh = torch.randn_like(x)
        assert_close(called_on(sm, "plan", fresh), model(fresh))
    return sm


def _schedule(sm: ss.StreamScheduledModule):
    return sm._ss.last.schedule


CASES = [
    ("towers on lanes", Heads, (8, 64), dict(executor="threads", num_streams=4, fuse=False)),
    ("in-place write", lambda: Pattern("mul_"), (4, 64), dict(executor="threads", num_streams=4, sync_log=True)),
    ("fused, serial", Heads, (8, 64), dict(executor="serial")),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_check_holds_and_every_dump_comes_in_pass_order(case):
    _, make, shape, options = case
    torch.manual_seed(0)
    model = make().eval()
    dumps: list[tuple[str, str]] = []
    with pass_instruments(check=True, dump=lambda name, text: dumps.append((name, text))):
        sm = _planned(model, torch.randn(*shape), **options)
    assert [p.name for p in planner.PASSES] == NAMES
    dumped = [p.name for p in planner.PASSES if p.dump is not None]
    assert [name for name, _ in dumps] == dumped
    assert dict(dumps)["plan"] == str(sm.plan)
    assert all(p.check is not None for p in planner.PASSES if p.name in ("tasks", "assign-streams", "plan"))


def _replaced(name: str, run) -> tuple[PlanningPass, ...]:
    return tuple(dataclasses.replace(p, run=run(p.run)) if p.name == name else p for p in planner.PASSES)


def _reversed_order(run):
    """The stream assignment, then its issue order reversed: dependencies issued late."""

    def broken(ctx):
        run(ctx)
        ctx.assignment.order.reverse()

    return broken


def test_a_check_names_the_pass_that_broke_the_schedule(monkeypatch):
    torch.manual_seed(0)
    model = Heads().eval()
    monkeypatch.setattr(planner, "PASSES", _replaced("assign-streams", _reversed_order))
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="threads", num_streams=4)
    with pass_instruments(check=True), pytest.raises(PlanError, match="planning pass 'assign-streams'.*issued before"):
        with torch.no_grad():
            sm(torch.randn(8, 64))


def test_checks_run_only_inside_pass_instruments():
    calls = []

    def check(ctx):
        calls.append(ctx)
        raise PlanError("checked")

    passes = [PlanningPass("noop", lambda ctx: None, check, lambda ctx: "dumped")]
    run_passes(passes, object())  # no instruments: neither hook runs
    assert calls == []
    dumps = []
    with pass_instruments(dump=lambda name, text: dumps.append((name, text))):
        run_passes(passes, object())
    assert (calls, dumps) == ([], [("noop", "dumped")])
    with pass_instruments(check=True), pytest.raises(PlanError, match="planning pass 'noop': checked"):
        run_passes(passes, object())
    run_passes(passes, object())  # the block is left: no checks again
    assert len(calls) == 1


def _longest_path_us(tasks) -> float:
    finish: dict[int, float] = {}
    for t in tasks:  # ids are a topological order
        finish[t.id] = max((finish[d] for d in t.deps), default=0.0) + t.cost_us
    return max(finish.values(), default=0.0)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plan_program_and_timeline_read_the_one_task_list(case):
    _, make, shape, options = case
    torch.manual_seed(0)
    sm = _planned(make().eval(), torch.randn(*shape), **options)
    schedule, program, plan = _schedule(sm), sm._ss.last.program, sm.plan
    tasks = schedule.tasks
    assert [t.id for t in tasks] == list(range(len(tasks)))
    order = schedule.issue_order()
    assert sorted(order) == list(range(len(tasks))) and plan.order == order
    if options.get("fuse") is False:
        assert schedule.num_streams > 1 and any(t.waits for t in tasks)
    if options.get("executor") == "serial":
        assert plan.fused_groups and any(t.fused_group is not None for t in plan.tasks)
    for t, planned in zip(tasks, plan.tasks, strict=True):
        assert (planned.id, planned.name, planned.stream, planned.records) == (t.id, t.name, t.stream, t.records)
        assert (planned.nodes, planned.waits) == ([n.name for n in t.nodes], list(t.waits))
        assert planned.cost_us == round(t.cost_us, 3)
    assert [c.id for c in program.tasks] == order
    n_values = program.n_slots
    for compiled in program.tasks:
        t = tasks[compiled.id]
        assert (compiled.stream, compiled.waits, compiled.records) == (t.stream, t.waits, t.records)
        assert compiled.node_names == tuple(n.name for n in t.nodes)
        assert [s - n_values for s in compiled.reads if s >= n_values] == list(t.storage_reads)
        assert [s - n_values for s in compiled.writes if s >= n_values] == list(t.storage_writes)
    # The dependencies the timeline follows are the task graph's: the longest path over
    # them is the plan's critical path.
    assert _longest_path_us(tasks) == pytest.approx(plan.critical_path_us, abs=1e-2)
    assert sm._ss.last.tasks is tasks


def test_in_place_writes_are_storages_of_the_tasks_that_make_them():
    torch.manual_seed(0)
    sm = _planned(Pattern("mul_").eval(), torch.randn(4, 64), executor="threads", num_streams=4, sync_log=True)
    schedule = _schedule(sm)
    writers = [t for t in schedule.tasks if t.storage_writes]
    assert [n.target for t in writers for n in t.nodes if n.op == "call_method"].count("mul_") == 1
    readers = {t.id for t in schedule.tasks if t.storage_reads}
    assert readers - {t.id for t in writers}  # a branch reads the storage another task writes


def test_a_new_size_reuses_the_program_another_stream_does_not():
    torch.manual_seed(0)
    model = Heads().eval()
    sm = _planned(model, torch.randn(8, 64), executor="threads", num_streams=4, fuse=False)
    first = _schedule(sm)
    with torch.no_grad():
        x = torch.randn(5, 64)
        called_on(sm, "recorded", x)
        assert_close(called_on(sm, "plan:threads", x), model(x))
    again = _schedule(sm)
    assert again is not first and program_key(again) == program_key(first)
    assert next(iter(sm._ss.programs.values())).hits == 1
    moved = next(t for t in again.tasks if t.stream != 0)
    tasks = [dataclasses.replace(t, stream=0) if t is moved else t for t in again.tasks]
    assert program_key(dataclasses.replace(again, tasks=tasks)) != program_key(again)
    waits = [dataclasses.replace(t, waits=()) if t.waits else t for t in again.tasks]
    assert program_key(dataclasses.replace(again, tasks=waits)) != program_key(again)


def test_the_timeline_follows_the_scheduled_tasks_dependencies(monkeypatch):
    from streamsched.observe.timeline import analysis
    from streamsched.observe.timeline.record import ObservedCall
    from streamsched.observe.timeline.spans import TaskSpan

    torch.manual_seed(0)
    sm = _planned(Heads().eval(), torch.randn(8, 64), executor="threads", num_streams=4, fuse=False)
    compiled = sm._ss.last
    seen = []
    follow = analysis.measured_critical_path
    monkeypatch.setattr(
        analysis,
        "measured_critical_path",
        lambda plan, preds, durations: seen.append(preds) or follow(plan, preds, durations),
    )
    clock, spans = 0.0, []
    for tid in sm.plan.order:
        t = compiled.tasks[tid]
        spans.append(TaskSpan(task=tid, name=t.name, stream=t.stream, start_us=clock, end_us=clock + t.cost_us))
        clock += t.cost_us
    tl = analysis.build_timeline(ObservedCall(compiled, clock, spans), runs=1)
    assert seen == [[set(t.deps) for t in compiled.tasks]] and any(t.deps for t in compiled.tasks)
    assert tl.critical_path_us == pytest.approx(sum(compiled.tasks[t].cost_us for t in tl.critical_path))
