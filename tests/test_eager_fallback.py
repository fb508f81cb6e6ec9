"""executor="auto" includes running the model as written: the first calls after a plan is
made time the schedule against the model's own forward, and the schedule stays only where
it is not slower (beyond a 2% margin). Slow paths are planted (a busy wait) so that the
decisions do not depend on this machine's speed or noise."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import streamsched as ss
from benchmarks.zoo import ParallelFCN
from streamsched import runner as runner_module
from streamsched.runner import Runner
from streamsched.runtime.serial import SerialExecutor
from streamsched.runtime.threads import ThreadExecutor
from streamsched.testing import assert_path

from .helpers import Towers, assert_close, spin

Out = namedtuple("Out", ["y", "aux"])


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Heads(nn.Module):
    """A trunk and three heads; returns a namedtuple (the wrapper rebuilds it on its path)."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 4) for _ in range(3))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return Out(torch.cat([head(h) for head in self.heads], dim=1), {"h": h})


class _TrialClock:
    """The trial's clock, advanced only by planted delays: two ways planted equally slow
    then time exactly alike, whatever a loaded machine adds to their real work."""

    def __init__(self, monkeypatch) -> None:
        self.now = 0.0
        monkeypatch.setattr(runner_module, "time", self)

    def perf_counter(self) -> float:
        return self.now


def _wait(seconds, clock):
    if clock is None:
        spin(seconds)
    else:
        clock.now += seconds


def _slow_serial(monkeypatch, seconds=0.02, when=lambda inputs: True, clock=None):
    """Make the serial executor (the schedule's) slow; returns a list counting its runs."""
    runs = []
    original = SerialExecutor.run

    def delay(inputs):
        runs.append(1)
        if when(inputs):
            _wait(seconds, clock)

    def slow(self, program, inputs, *args, **kwargs):
        delay(inputs)
        return original(self, program, inputs, *args, **kwargs)

    monkeypatch.setattr(SerialExecutor, "run", slow)
    # A plan decided for the serial executor calls its program's function directly
    # (streamsched.runner.Runner.direct): slow that function too.
    original_direct = Runner.direct

    def slow_direct(self, schedule, executor):
        found = original_direct(self, schedule, executor)
        if found is None:
            return None
        verdict, call, wanted = found

        def slow_call(inputs):
            delay(inputs)
            return call(inputs)

        return verdict, slow_call, wanted

    monkeypatch.setattr(Runner, "direct", slow_direct)
    return runs


def _slow_forward(monkeypatch, cls, seconds=0.02, when=lambda x: True, clock=None):
    """Make the model's own forward slow (the schedule never calls it after the trace)."""
    runs = []
    original = cls.forward

    def slow(self, x):
        runs.append(1)
        if when(x):
            _wait(seconds, clock)
        return original(self, x)

    monkeypatch.setattr(cls, "forward", slow)
    return runs


def _calls_until_decided(sm, x, limit=40):
    for i in range(limit):
        out = sm(x)
        if sm._ss.last.trial is None:
            return i + 1, out
    raise AssertionError(f"no decision after {limit} calls")


def test_a_slower_schedule_falls_back_to_the_models_own_forward(monkeypatch):
    torch.manual_seed(0)
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(5, 16)
    first = sm(x)  # traces and plans
    assert type(first) is Out and sm.plan.executor == "serial" and sm._ss.last.trial is not None
    runs = _slow_serial(monkeypatch)
    with torch.no_grad():
        expected = model(x)
    for _ in range(sm._ss.last.trial.rounds * 2 + 2):
        out = sm(x)  # outputs equal eager on every call of the trial, structure and types too
        assert type(out) is Out and pytree.tree_structure(out) == pytree.tree_structure(expected)
        assert_close(out, expected)
    plan = sm.plan
    assert plan.executor == "eager"
    assert plan.trial is not None and plan.trial.chosen == "eager" and plan.trial.schedule_executor == "serial"
    # The plan says why, with the figures.
    best = plan.trial.best_us
    assert best["serial"] > 20_000 > best["eager"]  # the planted 20 ms wait
    assert "own forward measured faster" in plan.reason
    # In the plan's units (ms from 1000 us): serial above 20 ms, eager below.
    assert f"serial {best['serial'] / 1000:.2f} ms" in plan.reason, plan.reason
    assert f"eager {best['eager']:.1f} us" in plan.reason or f"eager {best['eager'] / 1000:.2f} ms" in plan.reason
    assert "eager" in plan.summary() and "measured" in plan.summary()
    # From now on the schedule does not run: the model's forward does, with its own types.
    before = len(runs)
    y = torch.randn(5, 16)
    for _ in range(5):
        out, expected = sm(y), model(y)
        assert type(out) is Out and pytree.tree_structure(out) == pytree.tree_structure(expected)
        assert_close(out, expected)
    assert len(runs) == before
    assert ss.Plan.from_json(plan.to_json()) == plan


def test_a_far_slower_schedule_is_dropped_after_two_calls(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(5, 16)
    sm(x)
    _slow_serial(monkeypatch, seconds=0.05)
    calls, _ = _calls_until_decided(sm, x)
    # 50 ms against well under 1 ms is decided without more rounds: the schedule after
    # its second call (one slow call may be another process's doing), the model as
    # written after its first.
    assert calls == 3
    assert sm.plan.executor == "eager" and sm.plan.trial.calls == {"serial": 2, "eager": 1}


def test_a_faster_schedule_is_kept(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(5, 16)
    sm(x)
    slow = _slow_forward(monkeypatch, Heads, seconds=0.02)
    calls, _ = _calls_until_decided(sm, x)
    plan = sm.plan
    assert plan.executor == "serial" and plan.trial.chosen == "serial"
    assert plan.trial.best_us["eager"] > 20_000 > plan.trial.best_us["serial"]
    assert "measured serial" in plan.reason and "eager" in plan.reason
    # The slow forward was tried twice and dropped (one slow call of the model as written
    # may be something else's doing): the trial cost two slow calls.
    assert len(slow) == 2 and calls <= plan.trial.rounds + 2
    n = len(slow)
    for _ in range(5):
        assert_close(sm(x), model(x))  # the reference call itself is slow, the wrapper is not
    assert len(slow) == n + 5  # only the reference calls above ran the model's forward


def test_a_close_call_takes_more_calls_and_keeps_the_schedule(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(5, 16)
    sm(x)
    # Both ways take 30 ms on the trial's clock, which only the planted delays advance:
    # a tie, whatever a loaded machine adds to their real work.
    clock = _TrialClock(monkeypatch)
    _slow_serial(monkeypatch, seconds=0.03, clock=clock)
    _slow_forward(monkeypatch, Heads, seconds=0.03, clock=clock)
    calls, _ = _calls_until_decided(sm, x)
    trial = sm.plan.trial
    assert calls == 2 * trial.max_rounds and trial.calls == {"serial": trial.max_rounds, "eager": trial.max_rounds}
    assert trial.max_rounds > trial.rounds
    assert sm.plan.executor == "serial"  # not more than 2% apart: the schedule stays
    assert f"fastest of {trial.max_rounds} calls each" in sm.plan.reason


def test_fusion_that_pays_is_kept_without_a_planted_delay():
    torch.manual_seed(0)
    model = ParallelFCN(100)
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(1, 2000)
    with torch.no_grad():
        sm(x)
        assert sm.plan.fused_groups
        _calls_until_decided(sm, x)
        assert sm.plan.executor == "serial"
        # Tens of times slower as written: dropped after its second call.
        assert sm.plan.trial.calls["eager"] == 2
        assert_close(sm(x), model(x), atol=1e-5)


def test_a_new_signature_is_measured_again(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    a, b = torch.randn(2, 16), torch.randn(7, 16)
    sm(a)
    # The schedule is slow for batch 2, the model's forward for batch 7.
    _slow_serial(monkeypatch, when=lambda inputs: inputs[0].shape[0] == 2)
    _slow_forward(monkeypatch, Heads, when=lambda x: x.shape[0] == 7)
    _calls_until_decided(sm, a)
    assert sm.plan.executor == "eager"
    sm(b)  # a new size runs as written once (planning.signatures)
    assert_path(sm, "as-written")
    sm(b)  # it came back: planned, then its own trial (another size bucket)
    assert_path(sm, "recorded")
    assert sm.plan.signature == "float32[7, 16]" and sm.plan.trial is None and sm._ss.last.trial is not None
    _calls_until_decided(sm, b)
    assert sm.plan.executor == "serial" and sm.plan.trial is not None
    by_signature = {p.signature: p.executor for p in sm.plans}
    assert by_signature == {"float32[2, 16]": "eager", "float32[7, 16]": "serial"}
    assert_close(sm(a), model(a))
    assert_close(sm(b), model(b))


def test_a_parallel_plan_competes_with_serial_and_the_models_forward(monkeypatch):
    model = Towers(4, 512)
    x = torch.randn(256, 512)
    sm = ss.StreamScheduledModule(model)
    sm(x)
    if sm.plan.executor == "serial":  # the estimate decides; force the three-way trial
        from streamsched.planning.choice import Trial as _Trial

        sm._ss.last.plan = sm.plan.model_copy(update={"executor": "threads"})
        sm._ss.last.trial = _Trial("threads", as_written=True)
    assert sm._ss.last.trial.candidates == ["threads", "serial", "eager"]
    original = ThreadExecutor.run

    def slow_threads(self, *args, **kwargs):
        spin(0.05)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ThreadExecutor, "run", slow_threads)
    _slow_serial(monkeypatch, seconds=0.05)
    _calls_until_decided(sm, x)
    assert sm.plan.executor == "eager" and set(sm.plan.trial.best_us) == {"threads", "serial", "eager"}
    assert_close(sm(x), model(x), atol=1e-5)


def test_gradients_equal_eager_before_and_after_the_fallback(monkeypatch):
    torch.manual_seed(0)
    model = Heads()
    ref = Heads()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model)
    _slow_serial(monkeypatch)
    for i in range(14):
        x = torch.randn(5, 16)
        for p in list(model.parameters()) + list(ref.parameters()):
            p.grad = None
        sm(x).y.square().sum().backward()
        ref(x).y.square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"call {i}: {name}.grad")
    assert sm.plan.executor == "eager"


@pytest.mark.parametrize("config", [{"executor": "serial"}, {"sync_log": True}, {"chaos": 3}])
def test_requested_schedules_never_fall_back(monkeypatch, config):
    model = Heads()
    sm = ss.StreamScheduledModule(model, **config)
    x = torch.randn(5, 16)
    sm(x)
    runs = _slow_serial(monkeypatch, seconds=0.005)
    for _ in range(12):
        assert_close(sm(x), model(x))
    assert len(runs) == 12 and sm.plan.executor == "serial" and sm.plan.trial is None


def test_observers_run_the_schedule_after_the_fallback(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(5, 16)
    sm(x)
    runs = _slow_serial(monkeypatch, seconds=0.03)
    _calls_until_decided(sm, x)
    assert sm.plan.executor == "eager"

    class Seen:
        def __init__(self):
            self.tasks = []

        def push(self, task, stream):
            self.tasks.append(task)

        def pop(self, task, stream):
            pass

    n = len(runs)
    with sm.observing(Seen()) as seen:
        out = sm(x)
    assert seen.tasks and len(runs) == n + 1  # the schedule ran, on its executor
    assert type(out) is Out
    assert_close(out, model(x))
    sm(x)
    assert len(runs) == n + 1  # and the model's forward again once the observer is gone


# --- untraceable forwards (eager dispatch) ---------------------------------------------------


class Untraceable(nn.Module):
    """``if x.sum() > 0`` cannot be traced; no @streamsched.branch anywhere."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(x) if x.sum() > 0 else self.b(x)


class UntraceableWithBranches(Untraceable):
    @ss.branch
    def head(self, x):
        return torch.tanh(x)

    def forward(self, x):
        h = super().forward(x)
        return self.head(h) + self.head(-h)


class CountsItsCalls(nn.Module):
    """Untraceable (it assigns ``self.calls``) and without @streamsched.branch: towers of
    alike MLPs and a head, which nested wrappers could schedule."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)) for _ in range(3))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.calls = 0

    def forward(self, x, seen=None):
        self.calls += 1
        if seen is not None:
            seen.append(self.calls)
        return torch.stack([t(x) for t in self.towers]).sum(0) + self.head(x)


@pytest.mark.parametrize("with_list", [False, True], ids=["tensor", "tensor-and-list"])
def test_an_untraceable_forward_that_went_quiet_settles_to_run_as_written(monkeypatch, with_list):
    # Once eager dispatch found nothing to dispatch, every later call still went the full
    # way (bind, key, a new-signature lookup, eager dispatch's own, its children's wrappers):
    # about 110 us over a 140 us model with a list argument, 25 us without (1 thread).
    # It now settles as a call passing an object does: no new-signature lookup per call.
    model = CountsItsCalls()
    sm = ss.StreamScheduledModule(model)
    looked_up = []
    original = runner_module.new_signature
    monkeypatch.setattr(runner_module, "new_signature", lambda *a, **k: (looked_up.append(1), original(*a, **k))[1])
    for call in range(60):
        x = torch.randn(4, 8)
        seen_e, seen_w = [], []  # a list the caller passes, the forward appends to
        expected = model(x, seen_e) if with_list else model(x)
        out = sm(x, seen_w) if with_list else sm(x)
        assert_close(out, expected, what=f"call {call}")
        if with_list:  # the caller's own list (eager's call came first)
            assert seen_w == [2 * call + 2] and seen_e == [2 * call + 1]
        assert_path(sm, "eager-dispatch", "as-written")
        if call == 39:
            looked_up.clear()
    assert model.calls == 120
    assert looked_up == [], f"{len(looked_up)} of the last 20 calls looked for a new signature"


def test_an_untraceable_forward_without_branches_runs_as_written(monkeypatch):
    import streamsched.runtime.dispatch as eager_dispatch

    model = Untraceable()
    sm = ss.StreamScheduledModule(model, strict=False)
    dispatched = []
    original = eager_dispatch.run_eager_dispatch

    def counting(*args, **kwargs):
        dispatched.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(eager_dispatch, "run_eager_dispatch", counting)
    for i in range(8):
        x = torch.randn(3, 8) * (1 if i % 2 else -1)
        assert_close(sm(x), model(x))
    assert len(dispatched) == 3  # then nothing left to dispatch: the forward runs as written
    plan = sm.plan
    assert plan.mode == "eager-dispatch" and plan.executor == "eager"
    assert "no @streamsched.branch call in 3 calls" in plan.reason and "runs as written" in plan.reason


@pytest.mark.parametrize("config", [{"executor": "threads"}, {"sync_log": True}])
def test_an_untraceable_forward_with_branches_or_a_request_keeps_dispatching(config):
    for model, kwargs in ((UntraceableWithBranches(), {}), (Untraceable(), config)):
        sm = ss.StreamScheduledModule(model, strict=False, **kwargs)
        for _ in range(6):
            x = torch.randn(3, 8)
            assert_close(sm(x), model(x))
        assert sm.plan.mode == "eager-dispatch" and sm.plan.executor != "eager"
