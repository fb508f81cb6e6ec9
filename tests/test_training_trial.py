"""The ``auto`` trial in training: a call whose output carries gradients is timed with
its backward (``streamsched.backward_timing``), so a schedule whose cost sits in backward
is not kept for a training step it makes slower. Slow paths are planted (busy waits), so
the decisions do not depend on this machine's speed or noise."""

from __future__ import annotations

import collections
import gc
import time

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import streamsched as ss
from streamsched import backward_timing
from streamsched import runner as runner_module
from streamsched.runtime.serial import SerialExecutor
from streamsched.testing import last_path

from .helpers import assert_close

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(16, 32)
        self.heads = nn.ModuleList(nn.Linear(32, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.trunk(x))
        return torch.cat([head(h) for head in self.heads], dim=1)


class _TrialClock:
    """The clock the trial reads (its forward timer and the backward timer): real time
    plus the planted delays, which are added to it, not spun. A loaded machine that stalls
    the process stretches the real work of both ways alike, never a planted delay."""

    def __init__(self, monkeypatch) -> None:
        self.planted = 0.0
        monkeypatch.setattr(runner_module, "time", self)
        monkeypatch.setattr(backward_timing, "time", self)

    def perf_counter(self) -> float:
        return time.perf_counter() + self.planted


class _SlowBackward(torch.autograd.Function):
    """The identity, with a backward that takes ``seconds`` more on ``clock``."""

    @staticmethod
    def forward(ctx, x, seconds, clock):
        ctx.seconds, ctx.clock = seconds, clock
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.clock.planted += ctx.seconds
        return grad, None, None


def _schedule_slow_in_backward(monkeypatch, clock: _TrialClock, seconds: float = 0.03) -> None:
    """The schedule's outputs get a backward ``seconds`` slower; its forward is unchanged."""
    original = SerialExecutor.run

    def run(self, program, inputs, *args, **kwargs):
        outs = original(self, program, inputs, *args, **kwargs)
        return pytree.tree_map_only(
            torch.Tensor, lambda o: _SlowBackward.apply(o, seconds, clock) if o.requires_grad else o, outs
        )

    monkeypatch.setattr(SerialExecutor, "run", run)


def _forward_slower(monkeypatch, clock: _TrialClock, seconds: float = 0.003) -> None:
    """The model's own forward gets ``seconds`` slower: the schedule wins every forward."""
    original = Heads.forward

    def forward(self, x):
        clock.planted += seconds
        return original(self, x)

    monkeypatch.setattr(Heads, "forward", forward)


def _train(sm, model, calls: int) -> list[str]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    paths = []
    for _ in range(calls):
        x = torch.randn(5, 16)
        sm(x).square().mean().backward()
        paths.append(last_path(sm))
        opt.step()
        opt.zero_grad()
    return paths


def test_a_schedule_slower_in_backward_loses_the_training_trial(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))  # traces and plans
    assert sm.plan.executor == "serial" and sm._ss.last.trial is not None
    clock = _TrialClock(monkeypatch)
    _schedule_slow_in_backward(monkeypatch, clock)
    _forward_slower(monkeypatch, clock)  # a forward-only trial would keep the schedule
    paths = _train(sm, model, 12)
    plan = sm.plan
    assert plan.executor == "eager" and plan.trial is not None and plan.trial.chosen == "eager"
    assert "forward and backward" in plan.reason
    assert plan.trial.best_us["serial"] > 30_000 > plan.trial.best_us["eager"]
    # Bounded: each way's first backward warms up, then one timed call each decides.
    assert paths.count("plan:serial") <= 3, paths
    assert paths[-3:] == ["as-written"] * 3
    # Gradients after the decision are eager's.
    x = torch.randn(5, 16)
    sm(x).sum().backward()
    wrapped = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(wrapped, (p.grad for p in model.parameters())):
        assert_close(got, want)


def test_a_forward_only_trial_would_have_kept_that_schedule(monkeypatch):
    """The same planted costs without backward: the schedule wins every forward, and the
    trial (forward only: nothing is backpropagated) keeps it. What the training trial
    above decides is the backward's doing."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    clock = _TrialClock(monkeypatch)
    _schedule_slow_in_backward(monkeypatch, clock)
    _forward_slower(monkeypatch, clock)
    for _ in range(12):
        x = torch.randn(5, 16)
        assert_close(sm(x), model(x))
    plan = sm.plan
    assert plan.executor == "serial" and plan.trial is not None and plan.trial.chosen == "serial"
    assert "forward and backward" not in plan.reason


def test_no_backward_hook_is_left_on_the_parameters(monkeypatch):
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    for _ in range(60):  # a close call takes up to max_rounds calls of each way
        _train(sm, model, 1)
        if sm._ss.last.trial is None:
            break
    assert sm._ss.last.trial is None
    for p in model.parameters():
        # No hook dict at all: an emptied one still has autograd call into Python for
        # the parameter on every later backward.
        assert p._backward_hooks is None, p._backward_hooks


def test_each_parameter_is_hooked_once_per_trial(monkeypatch):
    """The parameters' end hooks are shared by the trial's calls: registering a tensor's
    first hook costs 40-50 us, which a model of thousands of parameters paid per call."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    params = {id(p) for p in model.parameters()}
    hooked: collections.Counter = collections.Counter()
    original = torch.Tensor.register_hook

    def register_hook(self, hook):
        if id(self) in params:
            hooked[id(self)] += 1
        return original(self, hook)

    monkeypatch.setattr(torch.Tensor, "register_hook", register_hook)
    _train(sm, model, 4)
    trial = sm._ss.last.trial
    assert trial is not None and trial.backward and trial.backpropagated >= 2
    assert set(hooked) == params and set(hooked.values()) == {1}, hooked
    # Each hook moves the end of the samples waiting: a parameter's gradient ends them.
    assert all(len(p._backward_hooks) == 1 for p in model.parameters())


def test_a_trial_dropped_midway_takes_its_hooks_off():
    """A training trial dropped before it decided (here by ``invalidate``) leaves no hook
    on the parameters: autograd would call into them on every later backward."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    _train(sm, model, 2)
    assert sm._ss.last.trial is not None and sm._ss.last.trial.backward
    assert all(p._backward_hooks for p in model.parameters())
    sm.invalidate()
    gc.collect()
    assert all(p._backward_hooks is None for p in model.parameters())
    _train(sm, model, 2)  # and the next trial hooks them again
    assert all(p._backward_hooks for p in model.parameters())


def test_a_hook_of_the_users_on_a_parameter_outlives_the_trial():
    """The trial's timers come off the parameters; a hook the user put on one before the
    trial stays, and fires on every backward after it as in eager."""
    model = Heads()
    seen = []
    model.trunk.weight.register_hook(lambda g: seen.append(g.shape))
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16)).sum().backward()
    for _ in range(60):
        _train(sm, model, 1)
        if sm._ss.last.trial is None:
            break
    assert sm._ss.last.trial is None
    assert len(model.trunk.weight._backward_hooks) == 1
    assert all(p._backward_hooks is None for p in model.parameters() if p is not model.trunk.weight)
    before = len(seen)
    x = torch.randn(5, 16)
    sm(x).sum().backward()
    assert len(seen) == before + 1 and seen[-1] == model.trunk.weight.shape


def _forwards_until_decided(sm, model) -> None:
    """Forward-only calls (each checked against eager) until the trial has decided."""
    for _ in range(40):
        x = torch.randn(5, 16)
        assert_close(sm(x), model(x))
        if sm._ss.last.trial is None:
            break
    assert sm._ss.last.trial is None


def test_the_trial_hands_backward_timing_over_to_forwards_when_backward_stops(monkeypatch):
    """Training calls, then calls whose outputs are never backpropagated (an evaluation
    with grad enabled, mid-trial): the trial starts over on forwards and still decides."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    _train(sm, model, 3)
    trial = sm._ss.last.trial
    assert trial is not None and trial.backward
    _forwards_until_decided(sm, model)
    assert "forward and backward" not in sm.plan.reason


def test_autograd_grad_during_the_trial_equals_eager():
    """The trial's backward hooks sit on inputs and parameters: ``torch.autograd.grad``
    through a trial call still works and gives eager's gradients."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    seen = set()
    for _ in range(8):
        x = torch.randn(5, 16, requires_grad=True)
        (gx,) = torch.autograd.grad(sm(x).square().sum(), x)
        seen.add(last_path(sm))
        (want,) = torch.autograd.grad(model(x).square().sum(), x)
        assert_close(gx, want)
    assert any(p.startswith("plan:") for p in seen), seen


def test_a_training_trial_whose_outputs_stop_carrying_gradients_still_decides():
    """Parameters frozen mid-trial (the same signature: inputs and modes unchanged): the
    outputs carry no gradient, so no backward can be timed; the trial times forwards."""
    model = Heads()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(5, 16))
    _train(sm, model, 3)
    assert sm._ss.last.trial is not None and sm._ss.last.trial.backward
    model.requires_grad_(False)
    _forwards_until_decided(sm, model)
    assert "forward and backward" not in sm.plan.reason


def test_a_sample_ends_with_its_own_backward():
    """The parameters' end hooks fire in every backward over the model; a sample is read
    at its signature's next trial call, after other calls' backwards (another signature's,
    in a workload that mixes them). Its time is its own backward's, not until theirs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    ends = backward_timing.ParameterEnds(list(model.parameters()))
    x = torch.randn(4, 8)
    out = model(x)
    sample = backward_timing.BackwardSample.attach(out, [x], None, ends=ends)
    out.sum().backward()
    own = sample.seconds
    assert own is not None
    time.sleep(0.05)
    model(x).sum().backward()  # another call's backward over the same parameters
    assert sample.seconds == own
    ends.remove()
    sample.remove()


def test_a_mixed_training_workload_times_each_trial_call_by_its_own_backward(monkeypatch):
    """Two call structures (two ranks) in training, alternating, each under its own trial:
    with other calls' backwards between a sample's backward and its reading, the figures
    the trial keeps stay those of one step, not of the steps in between."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    sm = ss.StreamScheduledModule(model)

    def step(x):
        out = sm(x)
        out.sum().backward()
        time.sleep(0.01)  # the loop's own work between steps

    for i in range(40):
        step(torch.randn(4, 16) if i % 2 else torch.randn(2, 4, 16))
    trials = [p.trial for p in sm.plans if p.trial is not None]
    assert trials, [p.reason for p in sm.plans]
    for trial in trials:
        # Each step's forward and backward take well under the 10 ms slept between steps.
        assert max(trial.best_us.values()) < 10_000, trial
