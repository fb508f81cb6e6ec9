"""Eager dispatch (``strict=False``): models torch.fx cannot trace run their own forward with
every ``@streamsched.branch`` call launched on a CPU lane or a stream.

Every model here is untraceable on purpose (``if x.sum() > 0:``, ``.item()``, lists whose
length depends on data) and is compared against eager PyTorch on fresh random inputs.
"""

from __future__ import annotations

import copy
import multiprocessing
import operator
import os
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.planning.choice import LaneHistory
from streamsched.runtime.dispatch import EagerDispatchError, PendingValue
from streamsched.runtime.dispatch.launch import _Launch
from streamsched.testing import check_happens_before

from .helpers import Towers, assert_close, check_against_eager, flatten, grads, saving

CPU_EXECUTORS = ["threads", "streams", "serial", "auto"]
# Long enough for a broken schedule to fail loudly rather than hang the suite.
BARRIER_TIMEOUT_S = 20.0


def positive(*shape: int) -> torch.Tensor:
    return torch.rand(*shape) + 0.05


def negative(*shape: int) -> torch.Tensor:
    return -(torch.rand(*shape) + 0.05)


class Tower(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))

    @ss.branch
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Gated(nn.Module):
    """Picks a set of towers by the sign of the input's sum and the number of extra heads by
    a value read with ``.item()``: three things fx cannot trace."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.pos = nn.ModuleList(Tower(d) for _ in range(2))
        self.neg = nn.ModuleList(Tower(d) for _ in range(3))
        self.extras = nn.ModuleList(nn.Linear(d, d) for _ in range(3))
        self.head = nn.Linear(d, 4)

    @ss.branch
    def extra(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.extras[i](x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        towers = self.pos if x.sum() > 0 else self.neg
        outs = [t(x) for t in towers]
        k = 1 + int(x.abs().mean().item() * 10) % len(self.extras)
        outs += [self.extra(i, x) for i in range(k)]
        return self.head(torch.stack(outs).mean(0))


def wrap(model: nn.Module, **config) -> ss.StreamScheduledModule:
    return ss.StreamScheduledModule(model, strict=False, **config)


# --- results equal eager ---------------------------------------------------------------------


@pytest.mark.parametrize("executor", CPU_EXECUTORS)
@pytest.mark.parametrize("make_input", [positive, negative], ids=["positive-path", "negative-path"])
def test_outputs_and_gradients_equal_eager_on_each_path(executor, make_input):
    # Three calls: under "auto" the first two run inline and the third decides.
    sm = check_against_eager(Gated(), (make_input(8, 16).requires_grad_(),), calls=3, executor=executor, strict=False)
    assert sm.plan.mode == "eager-dispatch"


def test_both_paths_through_one_wrapper_equal_eager():
    model = Gated()
    sm = wrap(copy.deepcopy(model), executor="threads")
    for make_input in (positive, negative, positive, negative):
        x = make_input(5, 16)
        assert_close(sm(x), model(x), what=make_input.__name__)
    assert {t.name for t in sm.plan.tasks} >= {"neg.0.forward", "neg.1.forward", "neg.2.forward", "extra"}


class ListModel(nn.Module):
    """Takes a Python list of any length; reads a value with ``.item()``."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.tower = Tower(d)
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, xs: list[torch.Tensor]) -> tuple[torch.Tensor, int]:
        outs = [self.tower(x) for x in xs]
        total = sum(outs)
        if total.abs().max().item() > 100.0:
            total = total / 100.0
        return total * self.scale, len(outs)


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_list_of_varying_length_equals_eager_with_gradients(executor):
    model = ListModel()
    sm = wrap(copy.deepcopy(model), executor=executor)
    for n in (1, 3, 2, 3):
        xs = [torch.randn(4, 8, requires_grad=True) for _ in range(n)]
        xs_ref = [x.detach().clone().requires_grad_() for x in xs]
        for p in list(model.parameters()) + list(sm.parameters()):
            p.grad = None
        out, count = sm(xs)
        ref, ref_count = model(xs_ref)
        assert type(out) is torch.Tensor and count == ref_count == n
        assert_close(out, ref, what=f"{n} inputs")
        (out**2).sum().backward()
        (ref**2).sum().backward()
        g, g_ref = grads(sm.module), grads(model)
        assert g.keys() == g_ref.keys()
        for name in g:
            assert_close(g[name], g_ref[name], what=f"grad {name}")
        for x, x_ref in zip(xs, xs_ref):
            assert_close(x.grad, x_ref.grad, what="input grad")
        assert len(sm.plan.tasks) == n


def test_forward_output_structure_holds_plain_values():
    class Structured(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Tower(8), Tower(8)

        def forward(self, x):
            if x.sum() > 0:
                return {"a": self.a(x), "pair": (self.b(x), [self.a(-x)])}
            return {"a": self.b(x), "pair": (self.a(x), [self.b(-x)])}

    model = Structured()
    sm = wrap(copy.deepcopy(model), executor="threads")
    for x in (positive(3, 8), negative(3, 8)):
        out = sm(x)
        assert type(out["a"]) is torch.Tensor
        assert type(out["pair"][0]) is torch.Tensor and type(out["pair"][1][0]) is torch.Tensor
        assert_close(out, model(x))


# --- the plan --------------------------------------------------------------------------------


def test_plan_says_eager_dispatch_and_why():
    model = Gated()
    with pytest.raises(ss.TraceError) as info:
        ss.StreamScheduledModule(model, strict=True)(positive(4, 16))
    first_line = str(info.value).splitlines()[0]

    sm = wrap(model, executor="threads", num_streams=3)
    x = positive(4, 16)
    sm(x)
    plan = sm.plan
    assert plan.mode == "eager-dispatch"
    assert plan.reason.startswith(f"eager dispatch: the model cannot be traced ({first_line})")
    assert "2 CPU lanes" in plan.reason
    assert plan.executor == "threads" and plan.stream_bound == 3
    k = 1 + int(x.abs().mean().item() * 10) % 3
    assert [t.name for t in plan.tasks] == ["pos.0.forward", "pos.1.forward"] + ["extra"] * k
    assert plan.order == [t.id for t in plan.tasks]
    assert all(1 <= t.stream <= 2 for t in plan.tasks)
    assert plan.num_streams == 1 + len({t.stream for t in plan.tasks})
    text = str(plan)
    assert "eager-dispatch" in text and "pos.1.forward" in text
    assert ss.Plan.from_json(plan.to_json()) == plan


@pytest.mark.parametrize(
    ("config", "executor", "why"),
    [
        ({"executor": "serial"}, "serial", "executor='serial'"),
        ({"num_streams": 1}, "serial", "num_streams=1"),
        ({"executor": "streams"}, "streams", "simulated"),
        ({}, "serial", "first calls"),
    ],
)
def test_plan_names_the_way_branches_ran(config, executor, why):
    sm = wrap(Gated(), **config)
    sm(positive(4, 16))
    assert sm.plan.executor == executor
    assert why in sm.plan.reason
    if executor == "serial":
        assert {t.stream for t in sm.plan.tasks} == {0}


def test_auto_times_calls_inline_then_on_lanes_then_keeps_the_faster():
    class Sleepy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @ss.branch
        def nap(self, x):
            time.sleep(0.005)  # releases the GIL: a branch worth a lane
            return self.lin(x)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 2
            return sum(self.nap(x) for _ in range(4))

    model = Sleepy()
    sm = wrap(copy.deepcopy(model), num_streams=3)
    x = positive(2, 4)
    modes = []
    for _ in range(7):
        assert_close(sm(x), model(x))
        modes.append(sm.plan.executor)
    # Three timed calls inline, then three on lanes (4 x 5 ms could run side by side), then
    # the faster of the two (which one depends on the machine).
    assert modes[:6] == ["serial"] * 3 + ["threads"] * 3
    assert modes[6] in ("serial", "threads") and "measured" in sm.plan.reason


def fake_launches(costs_us):
    launches = []
    for cost in costs_us:
        launch = _Launch(None, len(launches), "branch", "inline")
        launch.cost_us = cost
        launches.append(launch)
    return launches


def test_auto_keeps_branches_inline_when_lanes_cannot_save_a_millisecond():
    history = LaneHistory()
    for _ in range(3):
        assert history.decide(lanes=2)[0] == "inline"
        history.record("inline", 500.0, fake_launches([200.0, 200.0]))
    mode, why = history.decide(lanes=2)
    assert mode == "inline" and "would not pay" in why


def timed_history(inline_ms, lanes_ms) -> LaneHistory:
    history = LaneHistory()
    for ms in inline_ms:
        assert history.decide(lanes=2)[0] == "inline"
        history.record("inline", ms * 1e3, fake_launches([4000.0, 4000.0]))
    for ms in lanes_ms:
        assert history.decide(lanes=2)[0] == "lanes"  # a trial
        history.record("lanes", ms * 1e3, fake_launches([4000.0, 4000.0]))
    return history


@pytest.mark.parametrize(
    ("inline_ms", "lanes_ms", "expected"),
    [
        ((8.0, 8.1, 8.2), (4.5, 4.4, 4.6), "lanes"),
        ((8.0, 8.1, 8.2), (7.5, 9.0, 7.8), "inline"),  # less than 10% faster
        ((9.0, 8.0, 8.5), (12.0, 7.0, 11.0), "lanes"),  # the fastest call of each mode counts
    ],
)
def test_auto_decides_by_measured_timings(inline_ms, lanes_ms, expected):
    mode, why = timed_history(inline_ms, lanes_ms).decide(lanes=2)
    assert mode == expected and "measured" in why


def test_auto_re_times_the_other_way_so_a_cold_start_does_not_stick():
    # Inline was timed cold (warm-up): lanes win at first.
    history = timed_history((200.0, 190.0, 210.0), (5.0, 5.2, 5.1))
    modes = [history.decide(lanes=2)[0] for _ in range(63)]
    assert set(modes) == {"lanes"}
    mode, why = history.decide(lanes=2)
    assert mode == "inline" and "re-timing" in why
    history.record("inline", 3.0e3, fake_launches([1500.0, 1500.0]))  # warm now: faster than lanes
    assert history.decide(lanes=2)[0] == "inline"


def test_strict_true_still_raises_trace_error():
    sm = ss.StreamScheduledModule(Gated(), strict=True)
    with pytest.raises(ss.TraceError, match="strict=False"):
        sm(positive(4, 16))


def test_an_untraceable_model_runs_by_default_with_one_warning():
    model = Gated()
    sm = ss.StreamScheduledModule(model)
    x = positive(4, 16)
    with pytest.warns(ss.UntraceableWarning, match="strict=True") as record:
        out = sm(x)
    assert len(record) == 1 and "Gated.forward" in str(record[0].message)
    assert_close(out, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        for x in (positive(4, 16), negative(4, 16)):
            assert_close(sm(x), model(x))
    assert sm.plan.mode == "eager-dispatch"


# --- concurrency -----------------------------------------------------------------------------


class Rendezvous(nn.Module):
    """Two branches that each wait for the other: they finish only if they run at once."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.barrier = None
        self.threads: list[int] = []

    @ss.branch
    def meet(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        self.threads.append(threading.get_ident())
        if self.barrier is not None:
            self.barrier.wait()
        return layer(x)

    def forward(self, x):
        if x.sum() > 0:
            x = x + 1
        return self.meet(self.a, x) * self.meet(self.b, x)


def test_branches_run_concurrently_on_lanes():
    model = Rendezvous()
    sm = wrap(model, executor="threads", num_streams=3)
    for _ in range(2):
        model.threads.clear()
        model.barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
        x = positive(3, 8)
        out = sm(x)
        model.barrier = None
        expected = model(x)
        assert_close(out, expected)
        assert len(set(model.threads[:2])) == 2
        assert threading.get_ident() not in model.threads[:2]
        assert sorted(t.stream for t in sm.plan.tasks) == [1, 2]


def test_observer_brackets_each_branch_on_its_lane():
    class Recorder:
        def __init__(self):
            self.events = []
            self.lock = threading.Lock()

        def push(self, task, stream):
            with self.lock:
                self.events.append(("push", task.id, task.name, stream, threading.get_ident()))

        def pop(self, task, stream):
            with self.lock:
                self.events.append(("pop", task.id, task.name, stream, threading.get_ident()))

    sm = wrap(Gated(), executor="threads")
    recorder = Recorder()
    with sm.observing(recorder):
        sm(positive(4, 16))
    pushes = sorted(e[1:4] for e in recorder.events if e[0] == "push")
    pops = sorted(e[1:4] for e in recorder.events if e[0] == "pop")
    assert pushes == pops == sorted((t.id, t.name, t.stream) for t in sm.plan.tasks)
    assert threading.get_ident() not in {e[4] for e in recorder.events}


def test_grad_inference_and_autocast_modes_reach_the_lanes():
    class Modes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        @ss.branch
        def probe(self, x):
            return self.lin(x), torch.is_grad_enabled(), torch.is_inference_mode_enabled()

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            return self.probe(x)

    model = Modes()
    sm = wrap(model, executor="threads")
    x = positive(2, 8)
    for context in (torch.no_grad, torch.inference_mode, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
        with context():
            out, grad_enabled, inference = sm(x)
            ref, ref_grad_enabled, ref_inference = model(x)
        assert (grad_enabled, inference) == (ref_grad_enabled, ref_inference)
        assert out.dtype == ref.dtype and out.requires_grad == ref.requires_grad
        assert_close(out, ref)


def test_saved_tensor_hooks_keep_branches_on_the_callers_thread():
    """A branch launched onto a lane would save its tensors past the caller's
    saved-tensor hooks (activation checkpointing's, save_on_cpu): under them, branches
    run inline."""

    class Saving(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        @ss.branch
        def left(self, x):
            return torch.tanh(self.a(x))

        @ss.branch
        def right(self, x):
            return torch.sigmoid(self.b(x))

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            return self.left(x) + self.right(x)

    model = Saving()
    sm = wrap(model, executor="threads")
    x = positive(4, 8)
    sm(x)
    saved = {}
    for name, module in (("wrapped", sm), ("eager", model)):
        out, saved[name] = saving(module, x)
        out.sum().backward()
    assert saved["wrapped"] == saved["eager"] > 0, saved


def run_with_timeout(fn, seconds: float = BARRIER_TIMEOUT_S):
    """Run ``fn`` in a thread and fail (instead of hanging) if it does not finish."""
    outcome = {}

    def target():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"did not finish within {seconds} s (deadlock?)"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def test_wrapped_model_called_inside_a_branch_runs_its_branches_inline():
    inner_model = Gated(8)

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = wrap(inner_model, executor="threads")
            self.other = Tower(8)

        @ss.branch
        def run_inner(self, x):
            return self.inner(x)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            return self.run_inner(x) + self.run_inner(-x) + self.other(x)[:, :4]

    outer = Outer()
    sm = wrap(outer, executor="threads", num_streams=2)  # one lane: nested launches would deadlock
    x = positive(3, 8)
    out = run_with_timeout(lambda: sm(x))
    expected = inner_model(x) + inner_model(-x) + outer.other(x)[:, :4]
    assert_close(out, expected)
    assert "inside a launched branch" in outer.inner.plan.reason


# --- exceptions ------------------------------------------------------------------------------


class Faulty(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.failing: set[str] = set()

    @ss.branch
    def tower(self, name: str, x: torch.Tensor) -> torch.Tensor:
        if name in self.failing:
            raise ValueError(f"tower {name} cannot take {tuple(x.shape)}")
        return getattr(self, name)(x)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        a = self.tower("a", x)
        b = self.tower("b", x)
        self.tower("c", x)  # launched, never used
        return a + b


@pytest.mark.parametrize("executor", ["threads", "streams", "serial"])
@pytest.mark.parametrize("failing", [{"a"}, {"c"}, {"b", "c"}, {"a", "b"}], ids=lambda f: "+".join(sorted(f)))
def test_branch_exception_propagates_as_in_eager_and_next_call_works(executor, failing):
    model = Faulty()
    sm = wrap(model, executor=executor)
    x = positive(3, 8)
    model.failing = failing
    with pytest.raises(ValueError) as eager:
        model(x)
    with pytest.raises(ValueError) as ours:
        sm(x)
    assert str(ours.value) == str(eager.value)
    assert sm.plan.mode == "eager-dispatch"
    model.failing = set()
    x = positive(3, 8)
    assert_close(sm(x), model(x))


def test_every_branch_is_joined_before_an_exception_propagates():
    finished = []

    class SlowAndFailing(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @ss.branch
        def slow(self, x):
            time.sleep(0.05)
            finished.append("slow")
            return self.lin(x)

        @ss.branch
        def fail(self, x):
            raise KeyError("boom")

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            slow = self.slow(x)
            return self.fail(x) + slow

    sm = wrap(SlowAndFailing(), executor="threads")
    with pytest.raises(KeyError, match="boom"):
        sm(positive(2, 4))
    assert finished == ["slow"]


# --- pending values --------------------------------------------------------------------------


class Chain(nn.Module):
    """Branches that take other branches' results (pending values) as arguments."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.enc, self.dec = nn.Linear(d, d), nn.Linear(d, d)

    @ss.branch
    def encode(self, x):
        return torch.tanh(self.enc(x))

    @ss.branch
    def decode(self, h, skip):
        return self.dec(h) + skip

    def forward(self, x):
        if x.sum() > 0:
            x = x * 0.5
        h = self.encode(x)
        y = self.decode(h, x)
        z = self.decode(self.encode(-x), h)
        return y * z


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_branch_taking_another_branchs_result_equals_eager(executor):
    sm = check_against_eager(Chain(), (positive(4, 8).requires_grad_(),), executor=executor, strict=False)
    tasks = {t.id: t for t in sm.plan.tasks}
    # Each decode waits for the encode it reads, unless they shared a lane or stream.
    for decode, producers in ((1, [0]), (3, [0, 2])):
        assert tasks[decode].waits == [p for p in producers if tasks[p].stream != tasks[decode].stream]


class Pairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
        self.barrier = None

    def _meet(self):
        if self.barrier is not None:
            self.barrier.wait()

    @ss.branch
    def pair(self, x) -> tuple[torch.Tensor, torch.Tensor]:
        self._meet()
        return self.a(x), self.b(x)

    @ss.branch
    def plain_pair(self, x):
        return self.b(x), self.c(x)

    @ss.branch
    def other(self, x):
        self._meet()
        return self.c(x)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1
        p, q = self.pair(x)  # annotated: stays pending
        r = self.other(x)
        s, t = self.plain_pair(x)  # not annotated: waits for the branch
        u = self.plain_pair(-x)[1]  # indexing stays pending
        return p * q + r - s * t + u


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_branch_returning_a_tuple_equals_eager(executor):
    check_against_eager(Pairs(), (positive(3, 6).requires_grad_(),), executor=executor, strict=False)


def test_unpacking_an_annotated_tuple_does_not_wait_for_the_branch():
    model = Pairs()
    sm = wrap(model, executor="threads", num_streams=3)
    x = positive(3, 6)
    model.barrier = threading.Barrier(2, timeout=BARRIER_TIMEOUT_S)
    out = sm(x)  # pair and other meet at the barrier: both must be running at once
    model.barrier = None
    assert_close(out, model(x))


def test_a_tuple_annotation_the_branch_breaks_is_an_error():
    class Liar(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        @ss.branch
        def pair(self, x) -> tuple[torch.Tensor, torch.Tensor]:
            return self.lin(x), self.lin(x), self.lin(x)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            a, b = self.pair(x)
            return a + b

    with pytest.raises(EagerDispatchError, match=r"branch 'pair' of Liar is annotated to return a tuple of 2"):
        wrap(Liar(), executor="threads")(positive(2, 4))


class Protocols(nn.Module):
    """Ordinary forward code using branch results in every way Python allows."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)

    @ss.branch
    def make(self, x):
        return self.lin(x)

    @ss.branch
    def total(self, x):
        return self.lin(x).sum()

    @ss.branch
    def index(self, x):
        return (x.abs().sum() * 100).long() % 4

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1
        v, s, i = self.make(x), self.total(x), self.index(x)
        w = self.make(-x)
        w += 1  # in place on a branch result
        out = {
            "add": v + 1,
            "radd": 1 + v,
            "rsub": 2 - v,
            "mul": v * v,
            "rtruediv": 1 / (v.abs() + 1),
            "pow": v**2,
            "rpow": 2**v,
            "matmul": v @ v.T,
            "neg": -v,
            "abs": abs(v),
            "gt": (v > 0).float(),
            "eq": (v == w).float(),
            "getitem": v[0],
            "slice": v[:, 1:3],
            "iter": torch.stack(list(v)),
            "len": torch.tensor(len(v)),
            "shape": torch.tensor(v.shape[1]),
            "method": v.relu().sum(1),
            "torch": torch.cat([v, x, w]),
            "module": self.lin(v),
            "iadd": w,
            "bool": torch.tensor(1.0 if s > 0 else -1.0),
            "float": torch.tensor(float(s)),
            "int": torch.tensor(int(i)),
            "index": torch.tensor(list(range(10, 20))[operator.index(i)]),
            "sum": sum([v, w]),
        }
        out["repr"] = repr(s)
        out["format"] = f"{s:.4f}"
        return out


def check_protocols(model: Protocols, device: str = "cpu", **config) -> None:
    sm = wrap(copy.deepcopy(model), **config)
    for _ in range(2):
        x = positive(4, 5).to(device)
        out, ref = sm(x), model(x)
        assert out.keys() == ref.keys()
        for key in ref:
            if isinstance(ref[key], str):
                assert out[key] == ref[key], key
            else:
                assert type(out[key]) is torch.Tensor, key
                assert_close(out[key], ref[key], what=key)


@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_pending_values_behave_like_the_results(executor):
    check_protocols(Protocols(), executor=executor)


def test_pending_value_resolves_on_use():
    seen = []

    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        @ss.branch
        def make(self, x):
            return self.lin(x)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            v = self.make(x)
            seen.append(type(v))
            return v.shape, v

    shape, v = wrap(Peek(), executor="threads")(positive(2, 3))
    assert seen == [PendingValue] and shape == (2, 3) and type(v) is torch.Tensor


# --- writes in place -------------------------------------------------------------------------


class WritesAfterLaunch(nn.Module):
    """The forward writes in place to a tensor a launched branch reads."""

    def __init__(self, write):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.write = write

    @ss.branch
    def slow(self, h):
        time.sleep(0.02)  # reads h late: an unguarded write would land first
        return self.lin(h)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1
        h = x * 1.0
        a = self.slow(h[1:])  # reads a view of h
        self.write(h)
        return a + h[1:]


WRITES = {
    "method": lambda h: h.mul_(2),
    "functional": lambda h: torch.nn.functional.relu(h.sub_(0.5), inplace=True),
    "setitem": lambda h: h.__setitem__((slice(None), 0), 7.0),
    "out": lambda h: torch.add(h, 1, out=h),
}


@pytest.mark.parametrize("executor", ["threads", "streams"])
@pytest.mark.parametrize("write", list(WRITES))
def test_forward_writing_a_tensor_a_branch_reads_waits_for_the_branch(executor, write):
    model = WritesAfterLaunch(WRITES[write])
    sm = wrap(model, executor=executor)
    with torch.no_grad():
        for _ in range(2):
            x = positive(4, 6)
            assert_close(sm(x), model(x))
    if executor == "threads":
        assert any("wrote in place" in note and "'slow'" in note for note in sm.plan.notes)


class WritesItsArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    @ss.branch
    def bump(self, h):
        h.add_(1)
        return self.lin(h)

    def forward(self, x):
        if x.sum() > 0:
            x = x * 1
        h = x * 1.0
        return self.bump(h) + h


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_launched_branch_writing_its_argument_is_an_error(executor):
    sm = wrap(WritesItsArgument(), executor=executor)
    with pytest.raises(EagerDispatchError, match=r"branch 'bump' of WritesItsArgument wrote in place"):
        sm(positive(2, 4))


def test_inline_branch_may_write_its_argument_as_in_eager():
    model = WritesItsArgument()
    x = positive(2, 4)
    assert_close(wrap(model, executor="serial")(x), model(x))


# --- synchronisation log ---------------------------------------------------------------------


@pytest.mark.parametrize("executor", ["threads", "streams", "serial"])
@pytest.mark.parametrize("model_type", [Gated, Chain, Pairs])
def test_sync_log_is_clean(executor, model_type):
    sm = wrap(model_type(), executor=executor, sync_log=True)
    x = positive(3, 16 if model_type is Gated else 8 if model_type is Chain else 6)
    for _ in range(2):
        sm(x)
        log = sm.last_sync_log
        assert log is not None and len(log) > 0
        assert check_happens_before(log, {t.id: t.name for t in sm.plan.tasks}) == []
    launched = {e.task for e in log.entries if e.kind == "launch" and e.task >= 0}
    assert launched == {t.id for t in sm.plan.tasks}
    if executor != "serial":
        assert {e.stream for e in log.entries if e.kind == "fork"} == {t.stream for t in sm.plan.tasks}


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_missing_wait_in_the_log_is_reported(executor):
    sm = wrap(Chain(), executor=executor, sync_log=True)
    sm(positive(3, 8))
    log = sm.last_sync_log
    assert check_happens_before(log) == []
    waits = [e for e in log.entries if e.kind == "wait" and e.task >= 0]  # waits for branch results
    assert any(e.stream == 0 for e in waits)
    for dropped in waits:
        races = check_happens_before(log.without(lambda e, d=dropped: e is d))
        assert any(r.kind == "unordered-read" and r.stream == dropped.stream for r in races), dropped


@pytest.mark.parametrize("executor", ["threads", "streams"])
def test_missing_fork_or_hand_off_in_the_log_is_reported(executor):
    sm = wrap(Chain(), executor=executor, num_streams=2, sync_log=True)  # one lane: every launch on it
    sm(positive(3, 8))
    log = sm.last_sync_log
    assert check_happens_before(log) == []
    # Launches 0 and 2 read values the caller made (x, then -x) before handing them over.
    orderings = [e for e in log.entries if e.kind == "fork" or (e.kind == "wait" and e.task < -1)]
    assert len(orderings) == 4
    for dropped in (orderings[0], orderings[2]):
        races = check_happens_before(log.without(lambda e, d=dropped: e is d))
        assert any(r.kind == "unordered-read" and r.stream == 1 for r in races), dropped


# --- forked processes ------------------------------------------------------------------------


def call_in_forked_child(sm, x, seconds: float) -> bool:
    """Call ``sm(x)`` in a forked child process; whether it finished within ``seconds``,
    with the result equal to the plain model's and every lane pool inline in the child."""
    from streamsched.runtime.dispatch.lane_pool import _LANES
    from streamsched.runtime.threads import _POOL

    context = multiprocessing.get_context("fork")
    done = context.Event()

    def child():
        torch.set_num_threads(1)  # OpenMP's own thread pool does not survive a fork either
        out = sm(x)
        if _LANES.forked_child and _POOL.forked_child and torch.allclose(out, sm.module(x), atol=1e-6):
            done.set()

    process = context.Process(target=child, daemon=True)
    process.start()
    process.join(seconds)
    if process.is_alive():
        process.kill()
        process.join()
    return done.is_set()


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@needs_fork
def test_lanes_work_in_a_forked_child():
    sm = wrap(Gated(), executor="threads")
    x = positive(3, 16)
    sm(x)  # the parent's lanes exist now; the child has none of its threads
    assert {t.stream for t in sm.plan.tasks} - {0}
    assert call_in_forked_child(sm, x, seconds=BARRIER_TIMEOUT_S)


@needs_fork
def test_thread_executor_works_in_a_forked_child():
    sm = ss.StreamScheduledModule(Towers(), executor="threads", num_streams=3, fuse=False, min_task_cost=0.0)
    x = torch.randn(2, 64)
    sm(x)
    sm(x)
    assert {t.stream for t in sm.plan.tasks} - {0}
    assert call_in_forked_child(sm, x, seconds=5.0)


# --- CUDA ------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("device", [0, 1], ids=["cuda0", "cuda1"])
@pytest.mark.parametrize("model_type", [Gated, Chain, Pairs])
def test_cuda_outputs_and_gradients_equal_eager(model_type, device):
    if device >= torch.cuda.device_count():
        pytest.skip("needs two CUDA devices")
    dim = {Gated: 16, Chain: 8, Pairs: 6}[model_type]
    model = model_type().cuda(device)  # on cuda:1, device 0 stays the current one
    x = positive(4, dim).cuda(device)
    sm = check_against_eager(model, (x.requires_grad_(),), strict=False, sync_log=True)
    assert sm.plan.executor == "streams" and sm.plan.device == f"cuda:{device}"
    assert {t.stream for t in sm.plan.tasks} - {0}
    assert check_happens_before(sm.last_sync_log) == []
    assert torch.cuda.current_device() == 0


@pytest.mark.cuda
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_cuda_pending_values_behave_like_the_results():
    check_protocols(Protocols().cuda(), device="cuda")


@pytest.mark.cuda
def test_cuda_branches_run_on_pool_streams_beside_the_caller():
    streams = []

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Tower(64), Tower(64)

        @ss.branch
        def run(self, tower, x):
            streams.append(torch.cuda.current_stream().cuda_stream)
            return tower.net(x)

        def forward(self, x):
            if x.sum() > 0:
                x = x * 1
            return self.run(self.a, x) + self.run(self.b, x)

    model = Probe().cuda()
    sm = wrap(copy.deepcopy(model))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())  # the weights were copied on the default stream
    with torch.cuda.stream(side):  # composes with the caller's own stream
        x = positive(256, 64).cuda()
        ref = model(x)  # unwrapped: its branches run where it is called
        streams.clear()
        out = sm(x)
    torch.cuda.synchronize()
    assert_close(out, ref)
    assert len(set(streams)) == 2 and side.cuda_stream not in streams


@pytest.mark.cuda
@pytest.mark.parametrize("write", list(WRITES))
def test_cuda_forward_write_waits_for_the_branch(write):
    model = WritesAfterLaunch(WRITES[write]).cuda()
    sm = wrap(model, chaos=3)  # random GPU delays on the branch's stream
    with torch.no_grad():
        for _ in range(3):
            x = positive(512, 6).cuda()
            assert_close(sm(x), model(x))


@pytest.mark.cuda
def test_cuda_branch_exception_propagates_and_next_call_works():
    model = Faulty().cuda()
    sm = wrap(model)
    model.failing = {"b"}
    with pytest.raises(ValueError, match="tower b"):
        sm(positive(3, 8).cuda())
    model.failing = set()
    x = positive(3, 8).cuda()
    assert_close(sm(x), model(x))
    assert all(isinstance(t, torch.Tensor) for t in flatten(sm(x)))
