"""The edges of the stream protocol, each a test that fails when one synchronisation call
of the runtime is missing or misplaced (``make mutation`` removes them one at a time).

Plans run under both runtimes: the Python executor (``streamsched/runtime/streams.py``)
and the native runtime (``csrc/runtime.cpp``), which on the emulated device issues its
stream operations through ``NativeStreamOps``. Every compared call asserts which path it
ran and which runtime ran it, and is compared with eager PyTorch on fresh inputs.

Concurrency is checked in simulated time (``EmulatedCuda.timeline``): kernels take the
cost model's duration and streams overlap where nothing orders them. The figures are
simulated, not measured.
"""

import gc

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import _native
from streamsched.emulated_cuda import UnsynchronizedAccess
from streamsched.testing import assert_path

from .helpers import Towers, assert_close

pytestmark = pytest.mark.cuda

RUNTIMES = ["python", "native"]


@pytest.fixture(params=RUNTIMES)
def runtime(request):
    if request.param == "native" and _native.native() is None:
        pytest.skip("streamsched._C is not built")
    return request.param


def wrap(model, runtime, **config):
    """A wrapped model whose stream plans run under ``runtime``."""
    config = {"executor": "streams", "num_streams": 4, "min_task_cost": 0.0, "fuse": False, **config}
    sm = ss.StreamScheduledModule(model, **config)
    if runtime == "python":
        sm._ss.executors.native = None  # before the first call makes the streams executor
    return sm


def assert_ran(sm, runtime):
    """The last call ran the plan on streams, under ``runtime``."""
    assert_path(sm, "plan:streams")
    executor = sm._ss.executors.streams[sm.plan.device]
    assert (executor.native is not None) == (runtime == "native"), runtime


def side_streams(sm):
    return {t.stream for t in sm.plan.tasks} - {0}


class Heads(nn.Module):
    """Independent towers whose outputs are the model's outputs: each made on its own
    stream and read by the caller only after the join."""

    def __init__(self, n: int = 4, d: int = 64):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d)) for _ in range(n))

    def forward(self, x):
        return tuple(t(x) for t in self.towers)


def planned_heads(runtime, **config):
    model = Heads().cuda().eval()
    sm = wrap(model, runtime, **config)
    with torch.no_grad():
        sm(torch.randn(16, 64, device="cuda"))  # the first call plans
    assert len(side_streams(sm)) >= 2, sm.plan.summary()
    return model, sm


# --- the join and the outputs -----------------------------------------------------------------


def test_every_side_stream_is_joined_before_the_caller_reads(emulated_cuda, runtime):
    """A join of only some side streams leaves the others' outputs racing the caller."""
    model, sm = planned_heads(runtime)
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        outs = sm(x)
        assert_ran(sm, runtime)
        assert sm._ss.last.program.side_outputs  # outputs made on side streams
        assert_close(outs, model(x), atol=1e-5)  # every output read on the caller's stream
    assert emulated_cuda.take_reports() == []


def test_side_stream_outputs_are_recorded_on_the_caller_that_switches_streams(emulated_cuda, runtime):
    """Outputs made on a side stream belong to the caller's stream: after the caller used
    and dropped them on its stream, the next call (issued from another stream, which that
    use is not ordered before) must not get their memory back on the side stream."""
    model, sm = planned_heads(runtime)
    default = torch.cuda.current_stream()
    mine = torch.cuda.Stream()
    inputs, results = [], []  # inputs kept: freeing one the side streams read is the caller's to order
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(16, 64, device="cuda")
            inputs.append(x)
            expected = model(x)
            caller = mine if call % 2 == 0 else default
            caller.wait_stream(default)
            with torch.cuda.stream(caller):
                outs = sm(x)
                assert_ran(sm, runtime)
                assert torch.cuda.current_stream() == caller
                results.append(([o * 2 for o in outs], expected))  # used on the caller's stream
                del outs  # freed there: the side stream's pool may hand the memory out again
            # Nothing orders the next caller after this one (no host read either: that
            # would synchronise): only record_stream(caller) keeps the next call's side
            # streams off the memory this caller may still be reading.
    torch.cuda.synchronize()
    for doubled, expected in results:
        assert_close(doubled, [2 * e for e in expected], atol=1e-5)
    assert emulated_cuda.take_reports() == []


class StemTowers(nn.Module):
    """A stem on the caller's stream feeding towers of different depths: values made on
    one stream, read on another and released while the call goes on."""

    def __init__(self, n: int = 4, d: int = 128):
        super().__init__()
        self.stem = nn.Linear(d, d)
        self.towers = Towers(n, d)

    def forward(self, x):
        return self.towers(torch.tanh(self.stem(x)))


def test_values_read_on_other_streams_are_not_reused_early(emulated_cuda, runtime):
    model = StemTowers().cuda().eval()
    sm = wrap(model, runtime)
    with torch.no_grad():
        sm(torch.randn(32, 128, device="cuda"))  # plans
        for _ in range(3):
            x = torch.randn(32, 128, device="cuda")
            out = sm(x)
            assert_ran(sm, runtime)
            assert_close(out, model(x), atol=1e-5)
    assert any(t.cross_reads for t in sm._ss.last.program.tasks)
    assert emulated_cuda.take_reports() == []


# --- failures ----------------------------------------------------------------------------------


class Fuse(nn.Module):
    """Raises on a side stream while armed (a leaf: its forward runs as written)."""

    armed = [False]

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        if self.armed[0] and torch.cuda.current_stream() != torch.cuda.default_stream():
            raise RuntimeError("fuse blown on a side stream")
        return self.lin(x)


class FusedTowers(nn.Module):
    def __init__(self, n: int = 4, d: int = 64):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh(), Fuse(d)) for _ in range(n))

    def forward(self, x):
        return sum(t(x) for t in self.towers)


def test_the_callers_stream_is_current_again_after_a_task_raises(emulated_cuda, runtime):
    model = FusedTowers().cuda().eval()
    sm = wrap(model, runtime, leaf_modules=[Fuse])
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    try:
        with torch.no_grad(), torch.cuda.stream(caller):
            sm(torch.randn(16, 64, device="cuda"))  # plans
            assert len(side_streams(sm)) >= 2
            Fuse.armed[0] = True
            with pytest.raises(RuntimeError, match="fuse blown"):
                sm(torch.randn(16, 64, device="cuda"))
            assert_ran(sm, runtime)
            assert torch.cuda.current_stream() == caller  # not the side stream that raised
            Fuse.armed[0] = False
            x = torch.randn(16, 64, device="cuda")
            assert_close(sm(x), model(x), atol=1e-5)
            assert_ran(sm, runtime)
    finally:
        Fuse.armed[0] = False
    torch.cuda.current_stream().wait_stream(caller)
    assert emulated_cuda.take_reports() == []


# --- concurrency, in simulated time --------------------------------------------------------------


def stream_labels(sm):
    """The emulator's name of each stream of the plan (0: the caller's, the default)."""
    backend = sm._ss.executors.streams[sm.plan.device].backend
    labels = {0: "default stream of cuda:0"}
    for s in side_streams(sm):
        labels[s] = f"stream {backend.stream(s).stream_id} of cuda:0"
    return labels


def test_multi_stream_plans_overlap_where_the_plan_says(emulated_cuda, runtime):
    """Towers on different streams overlap in simulated time: collapsing the side streams
    onto the caller's, or onto one stream, fails here (every figure is simulated)."""
    model = Towers(4, 256).cuda().eval()
    sm = wrap(model, runtime)
    with torch.no_grad():
        sm(torch.randn(64, 256, device="cuda"))
        x = torch.randn(64, 256, device="cuda")
        with emulated_cuda.timeline() as planned:
            out = sm(x)
        assert_ran(sm, runtime)
        with emulated_cuda.timeline() as eager:
            expected = model(x)
        assert_close(out, expected, atol=1e-4)
    print(f"\nstreams plan  {planned.summary()}\neager         {eager.summary()}")
    labels = stream_labels(sm)
    assert len(labels) >= 3, sm.plan.summary()
    assert set(planned.streams) == set(labels.values())  # the plan's streams, each one its own
    # Each pair of streams the plan gives independent towers runs at the same time.
    towers = {s for s in labels if s != 0}
    for a in towers:
        for b in towers:
            if a < b:
                assert planned.overlap(labels[a], labels[b]) > 0, (a, b, planned.summary())
    assert planned.max_concurrency() >= len(labels) - 1
    assert planned.makespan < 0.7 * eager.makespan, (planned.summary(), eager.summary())


# --- eager dispatch ----------------------------------------------------------------------------


class UnusedBranch(nn.Module):
    """Eager dispatch (a data-dependent branch rules tracing out) with a branch whose
    result the forward drops: only the end-of-call join orders its reads of ``x``."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    @ss.branch
    def run(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > -1e9:  # untraceable
            self.run(self.a, x)  # result unused
        return self.run(self.b, x) * 2


def test_eager_dispatch_joins_a_branch_whose_result_is_unused(emulated_cuda):
    model = UnusedBranch().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(16, 64, device="cuda")
            expected = model(x.clone())
            out = sm(x)
            assert_path(sm, "eager-dispatch")
            assert {t.stream for t in sm.plan.tasks} == {1, 2}  # both branches on side streams
            x.add_(1)  # the caller writes what the unused branch read
            assert_close(out, expected, atol=1e-5)
    assert emulated_cuda.take_reports() == []


class DroppedInput(nn.Module):
    """Eager dispatch where the forward drops a branch's input while the branch may still
    read it: only ``record_stream`` keeps the caller's stream from reusing the memory."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)

    @ss.branch
    def run(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > -1e9:  # untraceable
            h = torch.sin(x)  # made on the caller's stream
        a = self.run(self.a, h)  # read on a side stream
        del h  # its memory goes back to the caller's stream's pool
        z = torch.cos(x) * 3  # the caller's stream allocates again
        return a + z


class BranchOutputs(nn.Module):
    """Eager dispatch whose outputs are branch results, made on side streams."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    @ss.branch
    def run(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > -1e9:  # untraceable
            return self.run(self.a, x), self.run(self.b, x)


def test_eager_dispatch_outputs_are_recorded_on_a_caller_that_switches_streams(emulated_cuda):
    model = BranchOutputs().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    default = torch.cuda.current_stream()
    mine = torch.cuda.Stream()
    inputs, results = [], []
    with torch.no_grad():
        for call in range(4):
            x = torch.randn(16, 64, device="cuda")
            inputs.append(x)
            expected = model(x)
            caller = mine if call % 2 == 0 else default
            caller.wait_stream(default)
            with torch.cuda.stream(caller):
                outs = sm(x)
                assert_path(sm, "eager-dispatch")
                results.append(([o * 2 for o in outs], expected))
                del outs
                gc.collect()  # a call's launches and its results form a cycle: free them now
    torch.cuda.synchronize()
    for doubled, expected in results:
        assert_close(doubled, [2 * e for e in expected], atol=1e-5)
    assert emulated_cuda.take_reports() == []


def test_eager_dispatch_keeps_a_dropped_branch_input_until_the_join(emulated_cuda):
    model = DroppedInput().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(16, 64, device="cuda")
            out = sm(x)
            assert_path(sm, "eager-dispatch")
            assert {t.stream for t in sm.plan.tasks} == {1}
            assert_close(out, model(x), atol=1e-5)
    assert emulated_cuda.take_reports() == []


def test_a_branch_input_released_before_the_join_is_an_unsafe_reuse(emulated_cuda, monkeypatch):
    """Why eager dispatch issues no ``record_stream`` for branch inputs: the call log
    holds them until after the join. Planted: a log that does not hold them, and the
    input dropped mid-forward is reported (the test above would fail)."""
    from streamsched.runtime.dispatch.calllog import _CallLog

    def slot_without_holding(self, value):
        entry = self.slots.get(id(value))
        if entry is not None:
            return entry[0], False
        self.slots[id(value)] = (len(self.slots), None)
        return len(self.slots) - 1, True

    monkeypatch.setattr(_CallLog, "slot", slot_without_holding)
    model = DroppedInput().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    with torch.no_grad():
        sm(torch.randn(16, 64, device="cuda"))
    assert_path(sm, "eager-dispatch")
    assert {r.kind for r in emulated_cuda.take_reports()} == {"reuse"}


def test_a_planted_missing_eager_join_is_a_race(emulated_cuda, monkeypatch):
    from streamsched.runtime.dispatch.launchers import _StreamLauncher

    monkeypatch.setattr(_StreamLauncher, "join", lambda self: None)
    model = UnusedBranch().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        sm(x)
        assert_path(sm, "eager-dispatch")
        with pytest.raises(UnsynchronizedAccess):
            x.add_(1)
    emulated_cuda.take_reports()
    torch.cuda.synchronize()
