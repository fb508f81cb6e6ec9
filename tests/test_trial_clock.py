"""What the ``auto`` trial times on the CPU: the call's wall time less the time the
system kept the calling thread off the cores while it was ready to run (another process
on a loaded machine). Waits that are the way's own (a sleep, a lock, lanes) stay."""

from __future__ import annotations

import time

import torch

import streamsched as ss
from streamsched import _clock
from streamsched import runner as runner_module
from streamsched.runtime.serial import SerialExecutor
from streamsched.testing import assert_path

from .helpers import Towers, assert_close


def test_time_off_the_cores_is_not_charged_to_the_schedule(monkeypatch):
    """The schedule's trial calls each lose 40 ms to other processes (the thread's run-queue
    wait grows by as much as its wall time: simulated), the model as written really waits
    20 ms per call. The trial keeps the schedule: preemption decides nothing."""
    # The simulated wait on top of the real one: a loaded machine's real waits (a sleep
    # that wakes late) are taken off both ways as they would be.
    waited = [0]
    monkeypatch.setattr(runner_module, "runqueue_wait_ns", lambda: (_clock.runqueue_wait_ns() or 0) + waited[0])

    def preempted(self, *args, _run=SerialExecutor.run, **kwargs):
        time.sleep(0.04)
        waited[0] += 40_000_000
        return _run(self, *args, **kwargs)

    def waits(self, x, _forward=Towers.forward):
        time.sleep(0.02)
        return _forward(self, x)

    monkeypatch.setattr(SerialExecutor, "run", preempted)
    monkeypatch.setattr(Towers, "forward", waits)
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="auto", num_streams=1)
    compiled = None
    for _ in range(30):
        x = torch.randn(4, 16)
        with torch.no_grad():
            assert_close(sm(x), model(x), atol=1e-5)
        compiled = sm._ss.last
        if compiled.trial is None and compiled.verdict is not None:
            break
    assert compiled is not None and compiled.verdict is not None, "the trial did not finish"
    assert not compiled.as_written, sm.plan.reason
    with torch.no_grad():
        sm(torch.randn(4, 16))
    assert_path(sm, "plan:serial")


def test_the_way_s_own_waits_still_count(monkeypatch):
    """A schedule that really waits 60 ms (a sleep: no run-queue time) loses to the model
    as written busy for 5 ms more than it: the trial times the wait, not the CPU. (The
    wide margin holds under load: with the run-queue reading switched off, the busy 5 ms
    are timed on the wall clock, which a loaded machine stretches several times.)"""
    monkeypatch.setattr(runner_module, "runqueue_wait_ns", lambda: 0)

    def slow(self, *args, _run=SerialExecutor.run, **kwargs):
        time.sleep(0.06)
        return _run(self, *args, **kwargs)

    def busy(self, x, _forward=Towers.forward):
        end = time.thread_time() + 0.005
        while time.thread_time() < end:
            pass
        return _forward(self, x)

    monkeypatch.setattr(SerialExecutor, "run", slow)
    monkeypatch.setattr(Towers, "forward", busy)
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="auto", num_streams=1)
    for _ in range(30):
        x = torch.randn(4, 16)
        with torch.no_grad():
            assert_close(sm(x), model(x), atol=1e-5)
        if last_ran_as_written(sm):
            break
    assert sm.plan.executor == "eager", sm.plan.reason
    with torch.no_grad():
        sm(torch.randn(4, 16))
    assert_path(sm, "as-written")


def last_ran_as_written(sm) -> bool:
    compiled = sm._ss.last
    return compiled is not None and compiled.as_written


def test_the_run_queue_wait_is_read_where_linux_has_it():
    waited = _clock.runqueue_wait_ns()
    assert waited is None or (isinstance(waited, int) and waited >= 0)


def test_a_preemption_around_the_call_is_not_taken_off_its_time(monkeypatch):
    """The system may keep the thread off the cores just before or after a run-queue
    reading. Such a wait, counted between the two readings, must lie inside the call's
    wall time too: taken off a span that never held it, it would make a 20 ms call
    look shorter than the 20 ms it sleeps. Each simulated reading is preceded by 10 ms
    off the cores."""
    waited = [0]

    def preempted_then_read():
        time.sleep(0.01)
        waited[0] += 10_000_000
        return waited[0]

    monkeypatch.setattr(runner_module, "runqueue_wait_ns", preempted_then_read)

    def sleeps(self, x, _forward=Towers.forward):
        time.sleep(0.02)
        return _forward(self, x)

    monkeypatch.setattr(Towers, "forward", sleeps)
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="auto", num_streams=1)
    for _ in range(30):
        x = torch.randn(4, 16)
        with torch.no_grad():
            assert_close(sm(x), model(x), atol=1e-5)
        compiled = sm._ss.last
        if compiled.trial is None and compiled.verdict is not None:
            break
    trial = sm.plan.trial
    assert trial is not None and "eager" in trial.best_us, sm.plan.reason
    assert trial.best_us["eager"] >= 20_000, trial.best_us


class _Stalls(torch.autograd.Function):
    """The identity, with a backward that sleeps ``seconds`` and, where ``preempted``,
    adds as much to the simulated run-queue wait (a stall that is no cost of the way)."""

    @staticmethod
    def forward(ctx, x, seconds, waited, preempted):
        ctx.seconds, ctx.waited, ctx.preempted = seconds, waited, preempted
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        if ctx.preempted:
            ctx.waited[0] += int(ctx.seconds * 1e9)
        return grad, None, None, None


def _simulated_waits(monkeypatch) -> list[int]:
    waited = [0]
    real = _clock.runqueue_wait_ns
    monkeypatch.setattr(_clock, "runqueue_wait_ns", lambda: (real() or 0) + waited[0])
    return waited


def test_a_backward_kept_off_the_cores_is_not_charged_to_its_way(monkeypatch):
    """A training trial's backward (backward_timing) that loses 40 ms to other processes
    is timed at its own few milliseconds, as the forward is."""
    from streamsched.backward_timing import BackwardSample

    waited = _simulated_waits(monkeypatch)
    w = torch.randn(8, 8, requires_grad=True)
    out = _Stalls.apply(torch.randn(4, 8) @ w, 0.04, waited, True)
    sample = BackwardSample.attach(out, [w], device=None)
    assert sample is not None
    out.sum().backward()
    seconds = sample.seconds
    sample.remove()
    assert seconds is not None and seconds < 0.02, seconds


def test_a_wait_after_the_call_s_backward_is_not_taken_off_it(monkeypatch):
    """The run-queue reading ends when the engine finishes the whole backward, after the
    call's own part: a wait upstream of the call's input (20 ms, simulated) must not be
    taken off the call's backward, which really sleeps 10 ms (its own wait: it stays)."""
    from streamsched.backward_timing import BackwardSample

    waited = _simulated_waits(monkeypatch)
    leaf = torch.randn(4, 8, requires_grad=True)
    x = _Stalls.apply(leaf * 2, 0.02, waited, True)  # upstream of the call: after its backward
    w = torch.randn(8, 8, requires_grad=True)
    out = _Stalls.apply(x @ w, 0.01, waited, False)
    sample = BackwardSample.attach(out, [x, w], device=None)
    assert sample is not None
    out.sum().backward()
    seconds = sample.seconds
    sample.remove()
    assert seconds is not None and seconds >= 0.01, seconds
