"""NVTX ranges and measured timelines (Chrome trace, Gantt chart), on CPU."""

from __future__ import annotations

import importlib.util
import json
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.observe import NvtxRanges, Timeline, timeline
from streamsched.observe.nvtx_ranges import STREAM_COLORS, range_name
from streamsched.observe.timeline import (
    TaskSpan,
    _gaps,
    fit_label,
    label_candidates,
    measured_critical_path,
    model_parts,
)
from streamsched.testing import assert_path

from .helpers import ConvTowers, Towers, assert_close, called_on

EXECUTORS = ["serial", "threads", "streams"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the plot extra) is not installed"
)


class RecordingDomain:
    """Stands in for an ``nvtx`` domain: records every call, per thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.created: list[tuple[str, int]] = []
        self.calls: list[tuple[str, int, object]] = []

    def get_event_attributes(self, message=None, color=None):
        with self.lock:
            self.created.append((message, color))
        return SimpleNamespace(message=message, color=color)

    def push_range(self, attr):
        with self.lock:
            self.calls.append(("push", threading.get_ident(), attr))

    def pop_range(self):
        with self.lock:
            self.calls.append(("pop", threading.get_ident(), None))

    def per_thread_ranges(self) -> list[str]:
        """Every closed range's message; fails if a thread pops what it did not push."""
        stacks: dict[int, list] = {}
        closed = []
        for kind, thread, attr in self.calls:
            stack = stacks.setdefault(thread, [])
            if kind == "push":
                stack.append(attr)
            else:
                assert stack, "pop_range without a matching push_range on this thread"
                closed.append(stack.pop().message)
        assert all(not s for s in stacks.values()), "a range was left open"
        return closed


class Failing(nn.Module):
    """Three independent towers; tower ``fail`` raises inside a branch when armed."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)) for _ in range(3))
        self.fail = -1

    @ss.branch
    def check(self, h, k: int):
        if k == self.fail:
            raise ValueError(f"boom in tower {k}")
        return h

    def forward(self, x):
        return sum(self.check(t(x), k) for k, t in enumerate(self.towers))


# --- NVTX ------------------------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
def test_one_range_per_task_named_by_task_and_stream_coloured_by_stream(executor):
    model = ConvTowers()
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=4, min_task_cost=0.0)
    x = torch.randn(2, 8, 12, 12)
    sm(x)  # plans
    domain = RecordingDomain()
    with sm.observing(NvtxRanges(domain)):
        out = sm(torch.randn(2, 8, 12, 12))
        out = sm(x)
    assert_close(out, model(x), atol=1e-4)
    expected = sorted(range_name(t.name, t.stream) for t in sm.plan.tasks)
    closed = domain.per_thread_ranges()
    assert sorted(closed) == sorted(expected * 2)
    colors = {message: color for message, color in domain.created}
    for t in sm.plan.tasks:
        assert colors[range_name(t.name, t.stream)] == STREAM_COLORS[t.stream]
    if executor != "serial":
        assert len({t.stream for t in sm.plan.tasks}) > 1


def test_event_attributes_are_built_once_per_task_and_stream():
    model = Towers(3, 32)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=3, min_task_cost=0.0)
    x = torch.randn(4, 32)
    sm(x)
    domain = RecordingDomain()
    ranges = NvtxRanges(domain)
    with sm.observing(ranges):
        for _ in range(4):
            sm(x)
    created = [message for message, _ in domain.created]
    assert sorted(created) == sorted(range_name(t.name, t.stream) for t in sm.plan.tasks)
    pushed = [attr for kind, _, attr in domain.calls if kind == "push"]
    assert len(pushed) == 4 * len(sm.plan.tasks)
    # The same attribute object is pushed every time for a given task.
    by_message: dict[str, set[int]] = {}
    for attr in pushed:
        by_message.setdefault(attr.message, set()).add(id(attr))
    assert all(len(ids) == 1 for ids in by_message.values())


@pytest.mark.parametrize("executor", EXECUTORS)
def test_ranges_are_closed_when_a_task_raises(executor):
    model = Failing()
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=3, min_task_cost=0.0, fuse=False)
    x = torch.randn(8, 64)
    expected = model(x)  # eager: the wrapper is compared with the model, not with itself
    assert_close(called_on(sm, "recorded", x), expected)
    domain = RecordingDomain()
    model.fail = 1
    with sm.observing(NvtxRanges(domain)):
        with pytest.raises(ValueError, match="boom in tower 1"):
            sm(x)
    assert_path(sm, f"plan:{executor}")
    closed = domain.per_thread_ranges()  # balanced on every thread
    failing = [t for t in sm.plan.tasks if "check_1" in t.nodes]
    assert len(failing) == 1 and range_name(failing[0].name, failing[0].stream) in closed
    if executor != "serial":
        assert failing[0].stream != 0  # the failure happened off the caller's stream
    model.fail = -1
    with sm.observing(NvtxRanges(domain)):
        assert_close(called_on(sm, f"plan:{executor}", x), expected)


def test_record_function_scopes_pair_the_ranges_only_while_the_profiler_runs(monkeypatch):
    model = Towers(3, 32)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=3, min_task_cost=0.0)
    x = torch.randn(4, 32)
    sm(x)
    ranges = NvtxRanges(RecordingDomain())
    with sm.observing(ranges):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            sm(x)

        def no_scope_without_a_profiler(name):
            raise AssertionError(f"record_function({name!r}) opened with no profiler running")

        monkeypatch.setattr(torch.profiler, "record_function", no_scope_without_a_profiler)
        sm(x)
    names = {event.name for event in prof.events()}
    expected = {range_name(t.name, t.stream) for t in sm.plan.tasks}
    assert expected <= names, expected - names


def test_nvtx_off_by_environment_or_missing_package(monkeypatch):
    monkeypatch.setenv("NVTX_DISABLE", "1")
    assert NvtxRanges.create() is None
    monkeypatch.delenv("NVTX_DISABLE")
    monkeypatch.setitem(sys.modules, "nvtx", None)  # "import nvtx" now fails
    assert NvtxRanges.create() is None


def test_real_nvtx_domain_runs_a_model_unchanged(monkeypatch):
    monkeypatch.delenv("NVTX_DISABLE", raising=False)
    ranges = NvtxRanges.create()
    assert ranges is not None  # the nvtx package is a dependency
    if not ranges.tool_attached:  # no Nsight here: only a running torch profiler would see them
        assert not ranges.wanted()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            assert ranges.wanted()
    model = ConvTowers()
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=4)
    x = torch.randn(2, 8, 12, 12)
    sm(x)
    with sm.observing(ranges):
        assert_close(sm(x), model(x), atol=1e-4)


# --- timelines: analysis -----------------------------------------------------------------------


def _plan(streams, order, waits=None):
    tasks = [SimpleNamespace(id=i, stream=s, waits=(waits or {}).get(i, [])) for i, s in enumerate(streams)]
    return SimpleNamespace(tasks=tasks, order=order)


def test_measured_critical_path_follows_data_edges_and_stream_order():
    preds = [set(), {0}, {0}, {1, 2}]  # a diamond
    durations = {0: 1.0, 1: 5.0, 2: 2.0, 3: 1.0}
    path, length = measured_critical_path(_plan([0, 1, 2, 0], [0, 1, 2, 3]), preds, durations)
    assert (path, length) == ([0, 1, 3], 7.0)
    # Tasks 2 and 1 on one stream, 2 issued first: 1 also waits for 2 to finish.
    path, length = measured_critical_path(_plan([0, 1, 1, 0], [0, 2, 1, 3]), preds, durations)
    assert (path, length) == ([0, 2, 1, 3], 9.0)
    # Eager dispatch has no task graph: waits and stream order only.
    path, length = measured_critical_path(_plan([0, 1, 0], [0, 1, 2], waits={2: [1]}), [], {0: 1, 1: 4, 2: 1})
    assert (path, length) == ([1, 2], 5.0)


def test_idle_gaps_are_the_holes_between_consecutive_tasks_of_a_stream():
    def span(task, stream, start, end):
        return TaskSpan(task=task, name=f"t{task}", stream=stream, start_us=start, end_us=end)

    gaps = _gaps({0: [span(0, 0, 0, 10), span(2, 0, 30, 40), span(1, 0, 10, 20)], 1: [span(3, 1, 5, 6)]})
    assert [(g.stream, g.after_task, g.before_task, g.duration_us) for g in gaps] == [(0, 1, 2, 10.0)]


def test_labels_shrink_to_the_room_and_prefer_the_module_path():
    name = "Mixed_6b.branch7x7_2.conv .. Mixed_6b.branch7x7_2.relu"
    assert label_candidates(name)[0] == "Mixed_6b.branch7x7_2.conv..relu"
    for room in range(0, 40):
        label = fit_label(name, room)
        assert len(label) <= room
    assert fit_label(name, 12) == "branch7x7_2"
    assert fit_label(name, 9) == "branch7x\u2026"
    assert fit_label("Mixed_6e.*.bn [x3 batch_norm over N*C channels]", 40) == "Mixed_6e.*.bn"
    assert fit_label("fc", 1) == ""


# --- timelines: measured ----------------------------------------------------------------------


def _measure(executor, model=None, x=None, **config):
    model = model or ConvTowers()
    x = torch.randn(2, 8, 12, 12) if x is None else x
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=4, min_task_cost=0.0, **config)
    with torch.no_grad():
        tl = timeline(sm, x, runs=2, warmup=1)
    return sm, tl


@pytest.mark.parametrize("executor", EXECUTORS)
def test_chrome_trace_has_one_lane_per_stream_and_one_slice_per_task(executor):
    sm, tl = _measure(executor)
    trace = json.loads(json.dumps(tl.to_chrome_trace()))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    lanes = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    plan_streams = {t.stream for t in sm.plan.tasks}
    assert set(lanes) == plan_streams
    assert lanes[0] == "stream 0 (caller)"
    assert sorted(e["args"]["task"] for e in slices) == sorted(t.id for t in sm.plan.tasks)
    by_id = {t.id: t for t in sm.plan.tasks}
    for e in slices:
        assert e["pid"] == 1
        assert e["name"] == by_id[e["args"]["task"]].name
        assert e["tid"] == by_id[e["args"]["task"]].stream
        assert 0.0 <= e["ts"] and e["dur"] >= 0.0
        assert e["ts"] + e["dur"] <= tl.wall_us + 1e-6
    if executor != "serial":
        assert len(plan_streams) > 1


@pytest.mark.parametrize("executor", EXECUTORS)
def test_streams_run_one_task_at_a_time_and_overlap_is_bounded(executor):
    sm, tl = _measure(executor)
    for stream in tl.streams:
        spans = sorted((e for e in tl.entries if e.stream == stream), key=lambda e: e.start_us)
        for before, after in zip(spans, spans[1:]):
            assert after.start_us >= before.end_us, f"stream {stream}: {before.name} overlaps {after.name}"
        assert tl.busy_us[stream] == pytest.approx(sum(e.duration_us for e in spans))
    assert 0.0 < tl.overlap <= len(tl.streams) + 1e-9
    assert tl.overlap == pytest.approx(sum(tl.busy_us.values()) / tl.wall_us)
    if executor != "threads":  # one thread runs everything: nothing can overlap
        assert tl.overlap <= 1.0 + 1e-9
    # The measured critical path is a chain of the plan's tasks whose length adds up.
    durations = {e.task: e.duration_us for e in tl.entries}
    assert tl.critical_path_us == pytest.approx(sum(durations[t] for t in tl.critical_path))
    assert tl.critical_path_us >= max(durations.values()) - 1e-9
    assert tl.critical_path_us <= tl.wall_us + 1e-6


def test_timeline_round_trips_through_json_and_summarises():
    sm, tl = _measure("threads")
    assert Timeline.model_validate_json(tl.model_dump_json()) == tl
    text = tl.summary()
    assert "overlap" in text and "critical path" in text
    for stream in tl.streams:
        assert f"stream {stream}:" in text
    assert tl.runs == 2 and tl.model == "ConvTowers" and tl.executor == "threads"


@needs_matplotlib
def test_save_writes_chrome_trace_and_png(tmp_path):
    sm, tl = _measure("threads")
    written = tl.save(tmp_path / "sub" / "conv.json")  # the suffix is ignored
    assert written == [tmp_path / "sub" / "conv.json", tmp_path / "sub" / "conv.png"]
    trace = json.loads(written[0].read_text())
    assert len([e for e in trace["traceEvents"] if e["ph"] == "X"]) == len(sm.plan.tasks)
    png = written[1].read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 1000


@needs_matplotlib
def test_timeline_with_path_saves_both_files(tmp_path):
    model = Towers(3, 32)
    sm = ss.StreamScheduledModule(model, executor="serial")
    timeline(sm, torch.randn(4, 32), path=tmp_path / "towers", runs=1, warmup=1)
    assert (tmp_path / "towers.json").is_file()
    assert (tmp_path / "towers.png").read_bytes().startswith(PNG_MAGIC)


def test_without_matplotlib_save_writes_json_and_says_how_to_get_the_png(tmp_path, monkeypatch):
    sm, tl = _measure("serial")
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.warns(RuntimeWarning, match="pip install matplotlib"):
        written = tl.save(tmp_path / "t")
    assert written == [tmp_path / "t.json"]
    assert not (tmp_path / "t.png").exists()


def test_model_parts_span_each_top_level_module():
    sm, tl = _measure("serial", model=Towers(3, 32), x=torch.randn(4, 32))
    parts = {name: (lo, hi) for name, lo, hi in model_parts(tl.entries)}
    assert "towers" in parts
    towers = [e for e in tl.entries if e.name.startswith("towers")]
    assert parts["towers"] == (min(e.start_us for e in towers), max(e.end_us for e in towers))


def test_timeline_refuses_what_it_cannot_time():
    model = Towers(3, 32)
    with pytest.raises(TypeError, match="StreamScheduledModule"):
        timeline(model, torch.randn(4, 32))
    sm = ss.StreamScheduledModule(model)
    with pytest.raises(ValueError, match="runs"):
        timeline(sm, torch.randn(4, 32), runs=0)
    with pytest.raises(ValueError, match="warmup"):
        timeline(sm, torch.randn(4, 32), warmup=0)


@pytest.mark.cuda
def test_cuda_timeline_times_tasks_on_their_streams(tmp_path):
    model = ConvTowers().cuda().eval()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0)
    with torch.no_grad():
        tl = timeline(sm, torch.randn(8, 8, 64, 64, device="cuda"), runs=3, path=tmp_path / "cuda")
    assert sorted(e.task for e in tl.entries) == sorted(t.id for t in sm.plan.tasks)
    assert set(tl.streams) == {t.stream for t in sm.plan.tasks}
    for e in tl.entries:
        assert -1.0 <= e.start_us <= e.end_us <= tl.wall_us + 1.0  # event resolution is about 0.5 us
    assert 0.0 < tl.overlap <= len(tl.streams) + 1e-6
    assert (tmp_path / "cuda.png").read_bytes().startswith(PNG_MAGIC)
