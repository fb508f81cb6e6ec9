"""Nested plans: where a forward cannot be traced and runs as written, its children that
can be are scheduled by plans of their own (``streamsched/nesting.py``). Every output
and gradient is compared with eager, and each check says which path the nested child's
call ran."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import nesting, nesting_trial, new_signatures
from streamsched.testing import assert_path, last_path

from .helpers import assert_close


class Block(nn.Module):
    """Four heads reading one tensor: a fused group when traced."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(sum(h(x) for h in self.heads))


class Untraceable(nn.Module):
    """Control flow on a tensor's value in the forward: fx cannot trace it."""

    def __init__(self, d: int = 16, blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(blocks))
        self.out = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            x = x * 0.5
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Deep(nn.Module):
    """An untraceable forward whose child is untraceable too: nesting goes down a level."""

    def __init__(self):
        super().__init__()
        self.inner = Untraceable()
        self.proj = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.inner(x)
        if y.mean() > 10:
            y = y - 1
        return self.proj(y)


@pytest.fixture(autouse=True)
def _quiet():
    # One intra-op thread: the trials time calls, and two OpenMP threads on a shared
    # 2-core machine made tiny calls take tens of milliseconds at random.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.UntraceableWarning)
        yield
    torch.set_num_threads(before)


def _site(sm, path: str):
    return next(s for s in sm._ss.nested.sites() if s.path == path)


def test_the_children_of_an_untraceable_forward_run_their_own_plans():
    torch.manual_seed(0)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(4):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    assert sm.plan.mode in ("eager-dispatch", "as-written")
    for path in ("blocks.0", "blocks.1"):
        assert_path(_site(sm, path).wrapper, "plan:serial")
    plans = sm.nested_plans
    assert sorted(plans) == ["blocks.0", "blocks.1"]  # `out` is one leaf: nothing to schedule
    assert all(p.fused_groups and p.fused_groups[0].size == 4 for p in plans.values())
    # Outside the wrapper's call the children are the user's modules, as written.
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_gradients_through_nested_plans_equal_eager():
    torch.manual_seed(0)
    model = Untraceable()
    ref = Untraceable()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor="serial")
    for step in range(3):
        x = torch.randn(8, 16)
        sm(x).square().sum().backward()
        ref(x).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"step {step}: {name}")
    assert_path(_site(sm, "blocks.0").wrapper, "plan:serial")


def test_nesting_goes_down_through_untraceable_children():
    torch.manual_seed(0)
    model = Deep().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(4):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    plans = sm.nested_plans
    assert {"inner", "proj", "inner.blocks.0", "inner.blocks.1"} <= set(plans), sorted(plans)
    assert plans["inner"].mode in ("eager-dispatch", "as-written")
    assert plans["inner.blocks.0"].fused_groups
    inner = _site(sm, "inner").wrapper
    assert_path(_site(inner, "blocks.1").wrapper, "plan:serial")


def test_a_child_that_raises_is_restored_and_the_next_call_works():
    torch.manual_seed(0)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(8, 16))
    with pytest.raises(RuntimeError):
        sm(torch.randn(8, 5))  # the first block's heads take 16 features
    assert all("forward" not in b.__dict__ for b in model.blocks)
    x = torch.randn(8, 16)
    assert_close(sm(x), model(x))


def test_hooks_on_a_nested_child_fire_once_per_call_as_in_eager():
    torch.manual_seed(0)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    seen = []
    model.blocks[1].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    for _ in range(3):
        x = torch.randn(8, 16)
        y = sm(x)
        n = len(seen)
        assert_close(y, model(x))
        assert len(seen) == n + 1  # the eager call's own firing
        assert_close(seen[n - 1], seen[n])  # the wrapped call fired with eager's value
    # A hooked subtree runs as written (its hooks see eager's calls); the rest is nested.
    assert _site(sm, "blocks.1").wrapper is None
    assert_path(_site(sm, "blocks.0").wrapper, "plan:serial")


def test_a_swapped_child_is_nested_in_its_place():
    torch.manual_seed(0)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(2):
        sm(torch.randn(8, 16))
    model.blocks[0] = Block().eval()
    for _ in range(3):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    site = _site(sm, "blocks.0")
    assert site.module is model.blocks[0]
    assert_path(site.wrapper, "plan:serial")


def test_a_child_that_only_runs_as_written_stops_being_nested():
    """Every call a new size: the child's wrapper runs it as written each time, and after
    a few calls it is no longer put in the child's way."""
    torch.manual_seed(0)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model)
    for n in range(1, nesting._QUIET_CALLS + 4):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
    site = _site(sm, "blocks.0")
    assert not site.active
    ran = last_path(site.wrapper)
    sm(torch.randn(100, 16))
    assert last_path(site.wrapper) == ran  # the child was called as written, not through it
    sm.invalidate()
    assert all(s.active for s in sm._ss.nested.sites())


def test_a_traced_model_nests_nothing():
    torch.manual_seed(0)
    model = Block()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(4, 16))
    assert sm.nested_plans == {} and sm._ss.nested is None


class OpaqueInside(nn.Module):
    """A traced root whose middle module cannot be traced: one opaque task of the plan."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.mid = Untraceable()
        self.post = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mid(self.pre(x)))


class OpaqueBeside(OpaqueInside):
    """OpaqueInside with a branch beside its chain: a plan with something to schedule
    (a chain around an opaque call alone runs as written, its children nested)."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.mid(self.pre(x))) + self.side(x)


def test_an_opaque_call_of_a_traced_plan_is_nested():
    torch.manual_seed(0)
    model = OpaqueInside().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(4):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    assert [o.path for o in sm.plan.opaque] == ["mid"]
    plans = sm.nested_plans
    assert {"mid", "mid.blocks.0", "mid.blocks.1"} <= set(plans), sorted(plans)
    mid = _site(sm, "mid").wrapper
    assert_path(_site(mid, "blocks.0").wrapper, "plan:serial")
    assert "forward" not in model.mid.__dict__


def test_a_trial_leaves_out_calls_in_which_a_nested_child_planned(monkeypatch):
    from streamsched import new_signatures
    from streamsched import runner as runner_module
    from streamsched.planning.choice import Trial

    trial = Trial("serial", as_written=True)
    first = trial.next()
    assert trial.skip(first) and trial.next() == first  # the same candidate runs again
    for _ in range(Trial._MAX_SKIPPED - 1):
        assert trial.skip(trial.next())
    assert not trial.skip(trial.next())  # bounded: the trial goes on with what it has

    class Clock:
        """The trials' clock, advanced only by planning: every call times alike
        except those in which something was planned, whatever the machine's load."""

        now = 0.0

        def perf_counter(self) -> float:
            return self.now

    clock = Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    compile_signature = new_signatures.compile_signature

    def slow_planning(*args, **kwargs):
        clock.now += 1.0  # a nested child's first calls (trace, record, plan) take long
        return compile_signature(*args, **kwargs)

    monkeypatch.setattr(new_signatures, "compile_signature", slow_planning)
    torch.manual_seed(0)
    model = OpaqueBeside().eval()
    sm = ss.StreamScheduledModule(model)  # auto: the root's trial, the children's trials
    for _ in range(60):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    root_trial = sm.plan.trial
    assert root_trial is not None, sm.plan.reason
    # The root's first schedule call ran the nested children's first calls: left out,
    # it does not drop the schedule from the trial after one call.
    assert root_trial.calls["serial"] >= root_trial.rounds, root_trial
    assert root_trial.best_us["serial"] < 1e6, root_trial  # no planning call was timed


def test_coverage_counts_what_nested_plans_schedule():
    torch.manual_seed(0)
    model = OpaqueInside().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(8, 16)
    sm(x)
    first = sm.plan  # the recording call: mid ran as written, nothing nested yet
    assert first.nested_leaf_calls == {"mid": 9}  # two blocks of four heads, and out
    assert first.coverage_calls == (2, 11)
    for _ in range(3):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    # mid's forward runs as written; its blocks' plans schedule 8 of its 9 leaf calls.
    assert sm.plan.nested_in_tasks == 8
    assert sm.plan.coverage_calls == (10, 11)
    assert sm.nested_plans["mid"].coverage_calls == (8, 9)


class Capturing(Untraceable):
    """Registers hooks on its blocks while its forward runs and returns what they saw, as
    transformers' output capturing does (``output_hidden_states=True``)."""

    def forward(self, x: torch.Tensor) -> tuple:
        seen: list = []
        # On modules inside the nested children, as transformers hooks each layer.
        handles = [b.heads[0].register_forward_hook(lambda m, a, out: seen.append(out)) for b in self.blocks]
        try:
            y = super().forward(x)
        finally:
            for h in handles:
                h.remove()
        return y, tuple(seen)


def test_hooks_the_parent_registers_while_it_runs_see_eager_calls():
    torch.manual_seed(0)
    model = Capturing().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(4):
        x = torch.randn(8, 16)
        out, ref = sm(x), model(x)
        assert len(out[1]) == len(ref[1]) == 2
        assert_close(out, ref)
    assert all("forward" not in b.__dict__ for b in model.blocks)


def test_nested_plans_inside_a_threads_plan_run_without_deadlock():
    """The root's threads executor runs its opaque task on the calling thread (lane 0),
    holding the lane pool; the nested plans called from there run serially, as plans
    called from a lane thread do."""
    import threading

    torch.manual_seed(0)
    model = OpaqueInside().eval()
    sm = ss.StreamScheduledModule(model, executor="threads")
    pairs = []

    def calls() -> None:
        for _ in range(4):
            x = torch.randn(8, 16)
            pairs.append((sm(x), model(x)))

    # A deadlock fails the test instead of hanging the suite.
    worker = threading.Thread(target=calls, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), "the nested plan's threads executor waited for the pool its caller holds"
    assert len(pairs) == 4
    for out, ref in pairs:
        assert_close(out, ref)
    assert_path(sm, "plan:threads")
    mid = _site(sm, "mid").wrapper
    assert_path(_site(mid, "blocks.0").wrapper, "plan:threads")


def test_the_nested_plans_example_runs_and_matches_eager():
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parent.parent / "examples" / "nested_plans.py"
    args = ["--blocks", "2", "--heads", "4", "--width", "16", "--batch", "4", "--rounds", "1", "--device", "cpu"]
    done = subprocess.run([sys.executable, str(example), *args], capture_output=True, text=True, timeout=300)
    # The example exits non-zero when its outputs differ from eager's by more than 1e-4.
    assert done.returncode == 0, done.stdout + done.stderr
    assert "nested plan of blocks.0" in done.stdout and "fused: Linear x4" in done.stdout, done.stdout
    assert "max abs error vs eager" in done.stdout, done.stdout


def test_too_many_children_are_not_nested(monkeypatch):
    """An ensemble behind an untraceable forward: each child nested apart would pay its own
    trace, plan and trial, and siblings nested apart are never batched together."""
    monkeypatch.setattr(nesting, "MAX_SITES", 3)
    torch.manual_seed(0)
    model = Untraceable(blocks=4).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x = torch.randn(8, 16)
        assert_close(sm(x), model(x))
    assert sm._ss.nested.sites() == [] and sm.nested_plans == {}
    monkeypatch.setattr(nesting, "MAX_SITES", 4)
    sm.invalidate()
    sm(torch.randn(8, 16))
    assert len(sm._ss.nested.sites()) == 4


class Batch:
    """A plain object holding tensors: a trace would bake it in."""

    def __init__(self, x: torch.Tensor, scale: torch.Tensor):
        self.x = x
        self.scale = scale


class TakesObject(nn.Module):
    """A traceable forward that is passed an object: it runs as written, its branchy
    children get plans of their own."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.out = nn.Linear(d, 3)

    def forward(self, batch: Batch) -> torch.Tensor:
        x = batch.x * batch.scale
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def test_a_forward_passed_an_object_nests_its_children():
    torch.manual_seed(0)
    model = TakesObject().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for step in range(5):
        batch = Batch(torch.randn(8, 16), torch.rand(16))
        assert_close(sm(batch), model(batch))
        assert_path(sm, "as-written")
        # Every call goes through the children's wrappers, the settled path's (the
        # signature of the previous call) included.
        for path in ("blocks.0", "blocks.1"):
            wrapper = _site(sm, path).wrapper
            assert wrapper._ss.calls == step + 1, (step, path)
            assert_path(wrapper, "recorded" if step == 0 else "plan:serial")
    assert sorted(sm.nested_plans) == ["blocks.0", "blocks.1"]
    assert all("forward" not in b.__dict__ for b in model.blocks)
    # Coverage: 9 leaf calls (two blocks of four heads, and out); the blocks' plans
    # schedule their 8.
    plan = sm.plan
    assert plan.mode == "as-written"
    assert plan.nested_leaf_calls == {"blocks.0": 4, "blocks.1": 4}
    assert plan.coverage_calls == (8, 9)
    assert plan.coverage == pytest.approx(8 / 9)
    # Gradients through the nested plans equal eager's.
    ref = TakesObject()
    ref.load_state_dict(model.state_dict())
    model.train()
    ref.train()
    for step in range(2):
        x, scale = torch.randn(8, 16), torch.rand(16)
        sm(Batch(x, scale)).square().sum().backward()
        ref(Batch(x, scale)).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"step {step}: {name}")


def test_a_child_of_an_object_call_that_settles_as_written_is_handed_back_at_once(monkeypatch):
    """Every call passes the object (a decoding step): a child whose trial decides for the
    model as written stops being nested on that call, not :data:`nesting._QUIET_CALLS`
    calls later, and so does the object call's parent chain above it."""
    from streamsched.planning.choice import Trial

    decide = Trial.decide

    def as_written(self, plan):
        plan, _ = decide(self, plan)
        return plan.model_copy(update={"executor": "eager"}), True

    monkeypatch.setattr(Trial, "decide", as_written)
    torch.manual_seed(0)
    model = TakesObject().eval()
    sm = ss.StreamScheduledModule(model)
    settled_at = None
    for call in range(nesting._QUIET_CALLS + 4):
        batch = Batch(torch.randn(8, 16), torch.rand(16))
        assert_close(sm(batch), model(batch))
        site = _site(sm, "blocks.0")
        last = site.wrapper._ss.last
        if settled_at is None and getattr(last, "program", None) is not None and last.as_written and last.trial is None:
            settled_at = call
        if settled_at is not None:
            assert not site.active, (call, settled_at)
    assert settled_at is not None and settled_at < nesting._QUIET_CALLS
    assert all(not s.active for s in sm._ss.nested.sites())
    # The root's calls skip the nesting block now, and still match eager.
    calls = site.wrapper._ss.calls
    batch = Batch(torch.randn(8, 16), torch.rand(16))
    assert_close(sm(batch), model(batch))
    assert site.wrapper._ss.calls == calls


class _Clock:
    """The trials' clock (``runner.time``): it moves only where a test says a call costs.
    (Its time is a list's item: an attribute assigned on an object a trace has read moves
    the wrappers' generation, and every call would check the model again.)"""

    def __init__(self) -> None:
        self.now = [0.0]

    def perf_counter(self) -> float:
        return self.now[0]


def _priced(monkeypatch, nested_call: float) -> None:
    """Prices on the trials' clock, whatever the machine's load: a ``Linear``'s forward
    costs 0.25 (a block as written 1; a block's schedule, its heads fused, nothing), and
    each call through a nested child's wrapper ``nested_call`` (the wrapper's own work,
    and its parents' down to it). (Leaf calls, which no trace reads.)"""
    from streamsched import runner as runner_module

    clock = _Clock()
    monkeypatch.setattr(runner_module, "time", clock)
    linear = nn.Linear.forward

    def linear_forward(self, x):
        clock.now[0] += 0.25
        return linear(self, x)

    monkeypatch.setattr(nn.Linear, "forward", linear_forward)
    call = nesting._NestedForward.__call__

    def nested_forward(self, *args, **kwargs):
        clock.now[0] += nested_call
        return call(self, *args, **kwargs)

    monkeypatch.setattr(nesting._NestedForward, "__call__", nested_forward)


class TakesObjectAndMask(TakesObject):
    """Passed a mask that grows by one on every call, as a decoding step's attention mask
    does; its children's arguments keep their sizes."""

    def forward(self, batch: Batch, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(batch) * mask.mean()


def _calls_until_verdict(sm, model, limit: int = 120) -> int:
    masked = isinstance(model, TakesObjectAndMask)
    with torch.no_grad():
        for call in range(limit):
            batch = Batch(torch.randn(8, 16), torch.rand(16))
            args = (batch, torch.ones(1, 6 + call)) if masked else (batch,)
            assert_close(sm(*args), model(*args))
            if sm._ss.nested.trial.verdict is not None:
                return call
    raise AssertionError(f"no verdict in {limit} calls")


def _wrapped_until_verdict(model_class: type = TakesObject) -> tuple:
    """A wrapper of a fresh ``model_class``, called until the trial of nesting decided;
    returns it and the model."""
    torch.manual_seed(0)
    model = model_class().eval()
    sm = ss.StreamScheduledModule(model)
    _calls_until_verdict(sm, model)
    return sm, model


def _nested_calls(sm) -> list:
    return [_site(sm, path).wrapper._ss.calls for path in ("blocks.0", "blocks.1")]


def test_nesting_that_costs_the_call_more_than_the_childrens_plans_save_is_turned_off(monkeypatch):
    """Each child's own trial finds its plan faster than its forward (1 a call), but the
    calls through the children's wrappers cost the parent's call more (3 each): the
    outermost wrapper's trial of the whole call (nesting_trial.py) runs the children as
    written, until the retry nests them again and measures anew; each such verdict in a
    row puts the next retry twice as far."""
    _priced(monkeypatch, nested_call=3.0)
    monkeypatch.setattr(nesting, "_RETRY_EVERY", 64)
    sm, model = _wrapped_until_verdict()
    nested = sm._ss.nested
    trial = nested.trial
    assert trial.verdict == "plain", trial.reason
    assert nested.spacing == 2
    for path in ("blocks.0", "blocks.1"):
        plan = _site(sm, path).wrapper.plan
        assert plan.executor != "eager", plan.reason  # the child's own trial kept its schedule
    assert not any(s.active for s in sm._ss.nested.sites())
    assert "no faster than the forward as written" in sm.plan.notes[-1], sm.plan.notes
    before = _nested_calls(sm)
    with torch.no_grad():
        for _ in range(5):
            batch = Batch(torch.randn(8, 16), torch.rand(16))
            assert_close(sm(batch), model(batch))
            assert_path(sm, "as-written")
    assert _nested_calls(sm) == before  # nothing goes through the children's wrappers
    # The retry nests the children again (their plans kept) at the parent's 128th call,
    # not its 64th, and the trial measures again.
    with torch.no_grad():
        for _ in range(128):
            batch = Batch(torch.randn(8, 16), torch.rand(16))
            assert_close(sm(batch), model(batch))
            if _nested_calls(sm) != before:
                break
    assert _nested_calls(sm) != before, "the children were not nested again"
    assert nested.calls == 128
    assert trial.verdict is None
    _calls_until_verdict(sm, model)
    assert trial.verdict == "plain"
    assert nested.spacing == 4


def test_nesting_that_pays_on_the_whole_call_is_kept(monkeypatch):
    _priced(monkeypatch, nested_call=0.0)
    sm, model = _wrapped_until_verdict()
    trial = sm._ss.nested.trial
    assert trial.verdict == "nested", trial.reason
    assert sm._ss.nested.spacing == 1
    assert "kept" in sm.plan.notes[-1], sm.plan.notes
    before = _nested_calls(sm)
    with torch.no_grad():
        batch = Batch(torch.randn(8, 16), torch.rand(16))
        assert_close(sm(batch), model(batch))
    assert [n - b for n, b in zip(_nested_calls(sm), before)] == [1, 1]
    for path in ("blocks.0", "blocks.1"):
        assert_path(_site(sm, path).wrapper, "plan:serial")


def test_a_nested_childs_wrapper_runs_no_trial_of_nesting_of_its_own():
    """Only the outermost wrapper measures nesting: a nested child's calls are part of its
    parent's, which the outermost trial times whole."""
    torch.manual_seed(0)
    model = Deep().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 16)
            assert_close(sm(x), model(x))
    assert sm._ss.nested.trial is not None
    inner = _site(sm, "inner").wrapper
    assert inner._ss.nested is not None and inner._ss.nested.trial is None
    for options in ({"executor": "serial"}, {"grad_handoff": "direct"}):
        # An executor asked for: no trial of any kind. Direct gradient hand-off: the
        # schedule's gain is in a backward that forward timings do not see.
        fixed = ss.StreamScheduledModule(Deep().eval(), **options)
        with torch.no_grad():
            fixed(torch.randn(8, 16))
        assert fixed._ss.nested.trial is None, options


def test_the_trial_of_nesting_decides_when_the_mask_grows_on_every_call(monkeypatch):
    _priced(monkeypatch, nested_call=3.0)
    sm, model = _wrapped_until_verdict(TakesObjectAndMask)
    assert sm._ss.nested.trial.verdict == "plain", sm._ss.nested.trial.reason


def test_the_trial_of_nesting_leaves_out_calls_in_which_a_child_planned(monkeypatch):
    """Timing starts at once here; the children's first calls (recording, their own trial
    calls, each priced 5) are not the nesting's cost and are left out: nesting, which
    pays once they settle, is kept."""
    from streamsched import runner as runner_module

    monkeypatch.setattr(nesting_trial, "SETTLE_CALLS", 0)
    _priced(monkeypatch, nested_call=0.0)
    clock = runner_module.time
    timed = runner_module.Runner._timed

    def child_trial_call(self, *args, **kwargs):
        clock.now[0] += 5.0  # outside the child's own timing: only its parent's sees it
        return timed(self, *args, **kwargs)

    monkeypatch.setattr(runner_module.Runner, "_timed", child_trial_call)
    record = runner_module.new_signature

    def child_planning(runner, *args, **kwargs):
        clock.now[0] += 5.0
        return record(runner, *args, **kwargs)

    monkeypatch.setattr(runner_module, "new_signature", child_planning)
    sm, model = _wrapped_until_verdict()
    trial = sm._ss.nested.trial
    assert trial.verdict == "nested", trial.reason
    assert trial.skipped > 0


def test_a_call_that_raises_during_the_trial_of_nesting_leaves_nothing_behind(monkeypatch):
    import gc

    _priced(monkeypatch, nested_call=3.0)
    linear = nn.Linear.forward
    failing = {"on": False}

    def maybe_failing(self, x):
        if failing["on"]:
            raise RuntimeError("planted failure")
        return linear(self, x)

    monkeypatch.setattr(nn.Linear, "forward", maybe_failing)
    torch.manual_seed(0)
    model = TakesObject().eval()
    sm = ss.StreamScheduledModule(model)
    trial = sm._ss.nested.trial if sm._ss.nested is not None else None
    raised = 0
    with torch.no_grad():
        for call in range(120):
            batch = Batch(torch.randn(8, 16), torch.rand(16))
            trial = sm._ss.nested.trial if sm._ss.nested is not None else None
            timing = trial is not None and trial.verdict is None and trial.calls >= nesting_trial.SETTLE_CALLS
            failing["on"] = timing and call % 3 == 0
            if failing["on"]:
                with pytest.raises(RuntimeError, match="planted failure"):
                    sm(batch)
                raised += 1
                failing["on"] = False
                assert gc.isenabled()
                assert all("forward" not in b.__dict__ for b in model.blocks)
                continue
            assert_close(sm(batch), model(batch))
            if trial is not None and trial.verdict is not None:
                break
    assert raised >= 2
    assert trial.verdict == "plain", trial.reason


@pytest.mark.cuda
def test_the_trial_of_nesting_times_a_call_passing_only_objects_on_the_models_device(emulated_cuda, monkeypatch):
    """A call whose tensors all sit in an object (a KV cache) has no tensor argument to
    say where its work runs: timed on the CPU clock alone, a CUDA model's queued work
    would land in the next call's span. The model's device is synchronised."""
    from streamsched import runner as runner_module

    devices = []
    clocked = runner_module.Runner._clocked

    def recording(self, run, device):
        if not self.nested_child:  # the outermost wrapper's: the trial of nesting
            devices.append(device)
        return clocked(self, run, device)

    monkeypatch.setattr(runner_module.Runner, "_clocked", recording)
    torch.manual_seed(0)
    model = TakesObject().eval().to("cuda")
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        for _ in range(nesting_trial.SETTLE_CALLS + 8):
            batch = Batch(torch.randn(8, 16, device="cuda"), torch.rand(16, device="cuda"))
            assert_close(sm(batch).cpu(), model(batch).cpu())
    assert devices, "no call of the trial of nesting was timed"
    assert all(d.startswith("cuda") for d in devices), devices


def test_a_chain_around_an_opaque_call_runs_as_written_with_its_children_nested(monkeypatch):
    """Under ``auto``, a traced forward that is a chain around an untraceable module (a
    language model's head around its decoder) records and tries nothing at its own level,
    at any size or grad mode: it runs as written, and the opaque module's children are
    nested with plans of their own, as an untraceable forward's are."""
    recorded = []
    compile_signature = new_signatures.compile_signature

    def counted(runner, *args, **kwargs):
        recorded.append(type(runner.module).__name__)
        return compile_signature(runner, *args, **kwargs)

    monkeypatch.setattr(new_signatures, "compile_signature", counted)
    torch.manual_seed(0)
    model = OpaqueInside().eval()
    sm = ss.StreamScheduledModule(model)
    for i in range(24):
        x = torch.randn((8, 12, 8, 20)[i % 4], 16)
        grad = i % 3 == 0
        with torch.set_grad_enabled(grad):
            out, expected = sm(x), model(x)
        assert_close(out, expected)
        assert last_path(sm) == "as-written"
        if grad:
            got = torch.autograd.grad(out.sum(), list(model.parameters()))
            want = torch.autograd.grad(expected.sum(), list(model.parameters()))
            for g, w in zip(got, want):
                assert_close(g, w)
    model.train()  # in training too
    for n in (8, 12, 8):
        x = torch.randn(n, 16)
        out, expected = sm(x), model(x)
        assert_close(out, expected)
        assert last_path(sm) == "as-written"
        got = torch.autograd.grad(out.sum(), list(model.parameters()))
        want = torch.autograd.grad(expected.sum(), list(model.parameters()))
        for g, w in zip(got, want):
            assert_close(g, w)
    model.eval()
    assert "OpaqueInside" not in recorded, recorded  # the root: no recording call
    assert "Block" in recorded  # the nested blocks were planned
    assert "chain around modules that cannot be traced" in sm.plan.reason, sm.plan.reason
    assert "Untraceable: TraceError" in sm.plan.reason, sm.plan.reason  # which, and why
    assert {"mid", "mid.blocks.0", "mid.blocks.1"} <= set(sm.nested_plans), sorted(sm.nested_plans)
    # The untraceable module replaced by a traceable one: traced afresh, a plain chain.
    model.mid = nn.Linear(16, 3)
    for _ in range(3):
        x = torch.randn(8, 16)
        with torch.no_grad():
            assert_close(sm(x), model(x))
    assert "the traced forward is a chain (each operation" in sm.plan.reason, sm.plan.reason
