import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import streamsched as ss

from .helpers import ConvTowers, Towers, assert_close, called_on


def test_state_dict_and_parameters_are_the_models_own():
    model = ConvTowers()
    sm = ss.StreamScheduledModule(model)
    assert list(sm.state_dict()) == list(model.state_dict())
    assert [n for n, _ in sm.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(a is b for a, b in zip(sm.parameters(), model.parameters()))
    assert sm.module is model
    sm(torch.randn(2, 8, 6, 6))
    assert list(sm.state_dict()) == list(model.state_dict())


def test_load_state_dict_is_used_by_the_next_call():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="threads")
    x = torch.randn(4, 16)
    sm(x)
    other = Towers(3, 16)
    sm.load_state_dict(other.state_dict())
    assert_close(sm(x), other(x))
    sm.load_state_dict(Towers(3, 16).state_dict(), assign=True)
    assert_close(sm(x), model(x))


def test_train_eval_passes_through_and_selects_other_plans():
    model = ConvTowers()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 8, 6, 6)
    sm.eval()
    assert not model.training and all(not m.training for m in model.modules())
    assert_close(sm(x), model(x))
    sm.train()
    assert model.training
    ref = copy.deepcopy(model)
    assert_close(sm(x), ref(x))
    assert len(sm.plans) == 2


def test_the_wrappers_mode_is_the_models_also_when_the_model_is_switched_directly():
    model = ConvTowers()
    sm = ss.StreamScheduledModule(model)
    assert sm.training and "training" not in sm.__dict__
    model.eval()
    assert not sm.training
    model.train()
    assert sm.training
    sm.eval()
    assert not model.training and not sm.training
    assert not copy.deepcopy(sm).training and not pickle.loads(pickle.dumps(sm)).training
    x = torch.randn(2, 8, 6, 6)
    assert_close(sm(x), model(x))
    assert sm._ss.last_path == "recorded"


class WithMethods(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.num_classes = 3

    def forward_features(self, x):
        return x * 2

    def forward(self, x):
        return self.fc(self.forward_features(x))


def test_model_values_read_through_the_wrapper_and_methods_name_sm_module():
    model = WithMethods()
    sm = ss.StreamScheduledModule(model)
    assert isinstance(sm.fc, nn.Linear)  # submodules, parameters and buffers are shared
    assert sm.num_classes == 3  # a plain value: read through (a parent may read it)
    model.num_classes = 5
    assert sm.num_classes == 5
    with pytest.raises(AttributeError, match=r"method of the wrapped WithMethods; call sm\.module\.forward_features"):
        sm.forward_features
    with pytest.raises(AttributeError) as info:
        sm.not_an_attribute
    assert "method" not in str(info.value)
    assert not hasattr(sm, "forward_featurez")
    x = torch.randn(2, 4)
    assert_close(sm(x), sm.module(x))


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_to_dtype_invalidates_plans(executor):
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for path in ("recorded", "plan"):
        x = torch.randn(4, 16)
        assert_close(called_on(sm, path, x), model(x))
    sm.double()
    assert next(model.parameters()).dtype == torch.float64
    # The float32 plan is gone: the first float64 call records, the next runs its own plan.
    for path in ("recorded", "plan"):
        x = torch.randn(4, 16, dtype=torch.float64)
        out = called_on(sm, path, x)
        assert out.dtype == torch.float64
        assert_close(out, model(x))


def test_plan_cache_is_bounded():
    model = Towers(2, 16)
    sm = ss.StreamScheduledModule(model, plan_cache_size=2)
    for batch in range(1, 6):
        for _ in range(2):  # a new size is planned when it comes back
            x = torch.randn(batch, 16)
            assert_close(sm(x), model(x))
    assert len(sm.plans) == 2 and len(sm._ss.traces) <= 2


@pytest.mark.parametrize("executor", ["serial", "threads", "streams"])
def test_bad_inputs_raise_like_eager_with_the_module_path_and_the_wrapper_survives(executor):
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor=executor)
    good = torch.randn(4, 16)
    sm(good)
    sm(good)
    cases = [torch.randn(4, 15), torch.randn(4, 16, dtype=torch.float64), torch.randn(4, 16).to(torch.int64)]
    for bad in cases:
        with pytest.raises(Exception) as eager:
            model(bad)
        with pytest.raises(type(eager.value)) as ours:
            sm(bad)
        assert "towers.0.0" in str(ours.value) or "towers" in str(ours.value)
        assert_close(sm(good), model(good))


def test_errors_inside_a_cached_plan_name_the_module():
    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.limit = 10

        @ss.branch
        def check(self, h):
            if h.shape[0] > self.limit:
                raise RuntimeError("batch too large")
            return h

        def forward(self, x):
            return self.check(self.fc(x))

    model = Picky()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, 4)
    sm(x)
    model.limit = 1
    with pytest.raises(RuntimeError, match="batch too large") as info:
        sm(x)
    assert "check" in str(info.value) and "Picky" in str(info.value)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_nan_and_inf_propagate_like_eager(executor):
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for path in ("recorded", "plan", "plan"):
        x = torch.randn(4, 16)
        x[0, 0] = float("nan")
        x[1, 1] = float("inf")
        out = called_on(sm, path, x)
        assert out.isnan().any()
        assert_close(out, model(x))


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_empty_batch_and_non_contiguous_input(executor):
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for path in ("recorded", "plan"):
        empty = called_on(sm, path, torch.randn(0, 16))
        assert empty.shape == (0, 8)
        assert_close(empty, model(torch.randn(0, 16)))
    for path in ("recorded", "plan"):
        x = torch.randn(16, 8).t()
        assert not x.is_contiguous()
        assert_close(called_on(sm, path, x), model(x))


def test_model_mutated_after_wrapping_is_retraced():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, 16)
    sm(x)
    sm(x)
    model.towers[1] = nn.Sequential(nn.Linear(16, 16), nn.Sigmoid())
    assert_close(sm(x), model(x))
    model.head = nn.Linear(16, 3)
    assert sm(x).shape == (4, 3)
    assert_close(sm(x), model(x))


def test_model_on_the_meta_device():
    model = Towers(3, 16).to("meta")
    sm = ss.StreamScheduledModule(model)
    out = sm(torch.empty(4, 16, device="meta"))
    assert out.device.type == "meta" and out.shape == (4, 8)


def test_concurrent_callers_get_correct_results():
    model = Towers(4, 64)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=4, min_task_cost=0.0)
    inputs = [torch.randn(8, 64) for _ in range(4)]
    expected = [model(x) for x in inputs]
    errors = []

    def worker(k):
        try:
            for _ in range(20):
                assert_close(sm(inputs[k]), expected[k])
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_pickle_and_deepcopy_round_trip():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="threads")
    x = torch.randn(4, 16)
    out = sm(x)
    again = pickle.loads(pickle.dumps(sm))
    assert again.config == sm.config
    assert_close(again(x), out)
    assert_close(copy.deepcopy(sm)(x), out)


def test_repr_and_plan_before_first_call():
    sm = ss.StreamScheduledModule(Towers(2, 8), num_streams=2)
    assert sm.plan is None
    assert "model=Towers" in repr(sm) and "num_streams=2" in repr(sm)


def test_tracing_does_not_disturb_modules_running_in_other_threads():
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(2, 4)
    expected = other(x)
    stop = threading.Event()
    errors = []

    def run_other():
        while not stop.is_set():
            try:
                assert_close(other(x), expected)
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)
                return

    t = threading.Thread(target=run_other)
    t.start()
    try:
        for width in range(1, 40):  # many traces while the other thread runs
            sm = ss.StreamScheduledModule(Towers(3, width))
            sm(torch.randn(2, width))
    finally:
        stop.set()
        t.join()
    assert errors == []


class _SlowTrace(nn.Module):
    """Two branches; its forward waits on ``gate`` while being traced (the other thread's
    trace begins or ends meanwhile)."""

    def __init__(self, gate):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.gate = gate

    def forward(self, x):
        if self.gate is not None:
            self.gate()
        return self.a(x) + self.b(x)


def test_traces_on_two_threads_ending_out_of_order_put_module_call_back():
    # fx patches nn.Module.__call__ and __getattr__ process-wide while it traces and puts
    # back what it found on entry. Trace A begins, trace B begins (finding A's patch),
    # A ends (putting the original back), B ends (putting A's patch back): A's patch
    # stayed installed for good, every later module call in the process went through a
    # finished trace's wrapper, and one made on A's thread (a lane of the threads
    # executor, say) was recorded into it (an opaque call returned an fx Proxy).
    orig_call, orig_getattr = nn.Module.__call__, nn.Module.__getattr__
    a_tracing, b_tracing, a_done = threading.Event(), threading.Event(), threading.Event()
    errors = []

    def gate_a():
        a_tracing.set()
        b_tracing.wait(0.5)  # B begins while A traces (where traces may overlap)

    def gate_b():
        b_tracing.set()
        a_done.wait(1.0)  # A ends before B

    def run(gate, done=None):
        try:
            sm = ss.StreamScheduledModule(_SlowTrace(gate), executor="serial")
            sm(torch.randn(2, 4))
            sm.module.gate = None
            x = torch.randn(3, 4)
            assert_close(sm(x), sm.module(x))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    a = threading.Thread(target=run, args=(gate_a, a_done))
    b = threading.Thread(target=run, args=(gate_b,))
    a.start()
    a_tracing.wait(5.0)
    b.start()
    a.join(10.0), b.join(10.0)
    assert errors == []
    assert nn.Module.__call__ is orig_call and nn.Module.__getattr__ is orig_getattr


def test_auto_keeps_a_parallel_executor_only_where_it_measures_faster(monkeypatch):
    from streamsched import runner as runner_module
    from streamsched.planning.choice import Trial as _Trial
    from streamsched.runtime.threads import ThreadExecutor

    class TrialClock:
        """The trial's clock, advanced only by the planted delay: what a loaded machine
        adds to the real work of either way does not count."""

        now = 0.0

        def perf_counter(self) -> float:
            return self.now

    clock = TrialClock()

    model = Towers(4, 512)
    x = torch.randn(256, 512)
    sm = ss.StreamScheduledModule(model)
    sm(x)
    # Force the situation whatever this machine's estimate says: the plan chose threads,
    # and the trial weighs threads against serial alone (the model's own forward, an
    # equal of serial here, would make the outcome a coin toss).
    sm._ss.last.plan = sm.plan.model_copy(update={"executor": "threads"})
    sm._ss.last.trial = _Trial("threads")
    slow = ThreadExecutor.run

    def slower(self, *args, **kwargs):
        clock.now += 0.05  # a planted slow path: the parallel executor now loses
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(ThreadExecutor, "run", slower)
    monkeypatch.setattr(runner_module, "time", clock)
    # Until the trial decides (a loaded machine can stretch it past its usual few calls).
    for _ in range(40):
        assert_close(sm(x), model(x), atol=1e-5)
        if sm.plan.trial is not None:
            break
    assert sm.plan.executor == "serial"
    assert "running serially" in sm.plan.reason and "measured" in sm.plan.reason


def test_a_decided_signature_keeps_the_planners_plan_and_runs_the_decision_beside_it(monkeypatch):
    """After the trial, the signature's one plan is the planner's; the decision sits beside
    it: ``sm.plan`` reads the plan with it applied, and the calls run what it chose."""
    import time

    from streamsched.planning.choice import Trial as _Trial
    from streamsched.runtime.threads import ThreadExecutor
    from streamsched.testing import assert_path

    model = Towers(4, 64)
    x = torch.randn(8, 64)
    sm = ss.StreamScheduledModule(model)
    sm(x)
    compiled = sm._ss.last
    compiled.plan = sm.plan.model_copy(update={"executor": "threads"})
    compiled.trial = _Trial("threads")
    slow = ThreadExecutor.run

    def slower(self, *args, **kwargs):
        time.sleep(0.02)  # the parallel executor loses the trial
        return slow(self, *args, **kwargs)

    monkeypatch.setattr(ThreadExecutor, "run", slower)
    for _ in range(40):
        assert_close(sm(x), model(x), atol=1e-5)
        if compiled.trial is None:
            break
    planned = compiled.schedule.plan
    assert planned.executor == "threads" and planned.trial is None  # the planner's, as planned
    assert compiled.verdict is not None and sm.plan == planned.model_copy(update=compiled.verdict)
    assert sm.plan.executor == "serial" and sm.plan.trial.schedule_executor == "serial"
    for _ in range(3):
        y = torch.randn(8, 64)
        assert_close(sm(y), model(y), atol=1e-5)
        assert_path(sm, "plan:serial")  # the decision, not the planner's threads


def test_parameters_read_by_the_graph_itself_are_always_current():
    model = nn.Linear(4, 3)  # traced through: its weight and bias are graph attributes
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    sm(x)
    sm(x)
    model.weight = nn.Parameter(torch.randn(3, 4))
    assert_close(sm(x), model(x))
    with torch.no_grad():
        model.bias.add_(1.0)
    assert_close(sm(x), model(x))
    model.register_buffer("unused", torch.ones(1))
    assert_close(sm(x), model(x))
