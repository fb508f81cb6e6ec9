import copy
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, Inception3, MultiTaskHeads, NASNetCells, ParallelFCN, RandWire
from streamsched import _native
from streamsched.runtime import SimulatedBackend, StreamExecutor, SyncLog, check_happens_before
from streamsched.testing import assert_path

from .helpers import (
    ConvTowers,
    RandomDag,
    Towers,
    assert_close,
    called_on,
    check_against_eager,
    random_dag_spec,
    saving,
)

EXECUTORS = ["serial", "threads", "streams"]

MODELS = {
    "towers": lambda: (Towers(4, 64), (torch.randn(16, 64),)),
    "conv_towers": lambda: (ConvTowers(), (torch.randn(2, 8, 12, 12),)),
    "nasnet": lambda: (NASNetCells(16, 2, num_classes=10), (torch.randn(2, 3, 16, 16),)),
    "randwire": lambda: (RandWire(12, 1, 10, num_classes=10), (torch.randn(2, 3, 16, 16),)),
    "pfcn": lambda: (ParallelFCN(64), (torch.randn(3, 64 * 20),)),
    "ensemble": lambda: (CriticEnsemble(8), (torch.randn(16, 23),)),
    "multitask": lambda: (MultiTaskHeads(), (torch.randn(8, 64),)),
}


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("fuse", [True, False])
def test_outputs_and_gradients_equal_eager(name, executor, fuse):
    model, inputs = MODELS[name]()
    sm = check_against_eager(model, inputs, executor=executor, fuse=fuse, num_streams=4, atol=1e-4)
    assert sm.plan.executor == executor


@pytest.mark.parametrize("executor", EXECUTORS)
def test_inception_eval_equals_eager(executor):
    model = Inception3().eval()
    sm = check_against_eager(model, (torch.randn(1, 3, 75, 75),), executor=executor, backward=False, atol=1e-4)
    if executor != "serial":
        assert sm.plan.num_streams > 1


@given(st.data())
def test_random_branchy_models_equal_eager(data):
    spec = random_dag_spec(lambda a, b: data.draw(st.integers(a, b)), data.draw(st.integers(2, 14)), 16)
    executor = data.draw(st.sampled_from(EXECUTORS))
    fuse = data.draw(st.booleans())
    model = RandomDag(16, spec)
    x = torch.randn(4, 16, requires_grad=True)
    sm = check_against_eager(
        model,
        (x,),
        executor=executor,
        fuse=fuse,
        num_streams=data.draw(st.integers(1, 6)),
        min_task_cost=0.0,
        sync_log=True,
        atol=1e-4,
    )
    assert check_happens_before(sm.last_sync_log) == []


class Failing(nn.Module):
    """Four independent towers; tower ``fail`` raises inside a branch when armed."""

    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)) for _ in range(4))
        self.fail = -1
        self.exc: type = ValueError

    @ss.branch
    def check(self, h, k: int):
        if k == self.fail:
            raise self.exc(f"boom in tower {k}")
        return h

    def forward(self, x):
        return sum(self.check(t(x), k) for k, t in enumerate(self.towers))


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("exc", [ValueError, KeyboardInterrupt])
def test_exception_in_a_branch_propagates_joins_and_next_call_works(executor, exc):
    model = Failing()
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=4, min_task_cost=0.0, fuse=False)
    x = torch.randn(8, 64)
    expected = model(x)  # eager: the wrapper is compared with the model, not with itself
    assert_close(called_on(sm, "recorded", x), expected)
    assert_close(called_on(sm, f"plan:{executor}", x), expected)
    threads = threading.active_count()  # the shared pool of lane threads made by now
    model.fail, model.exc = 2, exc
    with pytest.raises(exc, match="boom in tower 2"):
        sm(x)
    assert_path(sm, f"plan:{executor}")  # the failure was the compiled schedule's
    model.fail = -1
    assert_close(called_on(sm, f"plan:{executor}", x), expected)
    assert threading.active_count() <= threads  # a failed call leaves no thread behind
    if executor == "threads":
        assert sm.plan.num_streams > 1


def test_threads_carry_grad_mode_and_inference_mode_into_lanes():
    model = Towers(4, 64)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=4, min_task_cost=0.0)
    x = torch.randn(4, 64)
    sm(x)
    with torch.no_grad():
        sm(x)
        assert not sm(x).requires_grad
    with torch.inference_mode():
        out = sm(x)
        assert out.is_inference()
    assert sm(x).requires_grad


def test_state_a_lane_cannot_carry_keeps_the_call_on_the_callers_thread():
    """Saved-tensor hooks and Python dispatch modes are the calling thread's own: under
    them the plan's tasks run where they see every saved tensor and every op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Towers(4, 64)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=4, min_task_cost=0.0, fuse=False)
    x = torch.randn(4, 64, requires_grad=True)
    sm(x)
    assert_close(called_on(sm, "plan:threads", x), model(x))
    assert sm.plan.num_streams > 1
    saved = {}
    for name, module in (("wrapped", sm), ("eager", model)):
        out, saved[name] = saving(module, x)
        out.sum().backward()
    assert saved["wrapped"] == saved["eager"] > 0, saved
    counted = {}
    for name, module in (("wrapped", sm), ("eager", model)):
        with Counting() as mode:
            out = module(x)
        counted[name] = mode.ops
        assert_close(out, model(x))
    assert counted["wrapped"] >= counted["eager"] > 0, counted  # no op ran unseen on a lane


def test_lanes_run_with_the_callers_intra_op_thread_count():
    # PyTorch keeps part of the count per thread: a lane started under one count kept
    # it after the caller changed it, and kernels split over another number of threads
    # sum in another order than the caller's own calls.
    from streamsched.runtime.lanes import LanePool

    pool = LanePool("test-lanes")
    before = torch.get_num_threads()

    def count_on_lane() -> int:
        seen = []
        done = threading.Event()
        pool.ensure(1)
        pool.submit(1, lambda: (seen.append(torch.get_num_threads()), done.set()))
        assert done.wait(10)
        return seen[0]

    try:
        torch.set_num_threads(1)
        assert count_on_lane() == 1
        torch.set_num_threads(3)
        assert count_on_lane() == 3
        torch.set_num_threads(1)
        assert count_on_lane() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(_native.native() is None, reason="native runtime not built")
@pytest.mark.parametrize("name", ["nasnet", "randwire", "towers", "conv_towers"])
def test_native_and_python_runtimes_write_identical_sync_logs(name):
    model, inputs = MODELS[name]()
    sm = ss.StreamScheduledModule(model.eval(), executor="streams", num_streams=6, min_task_cost=0.0)
    with torch.no_grad():
        sm(*inputs)
    program = sm._ss.last.program
    results = []
    for nat in (None, _native.native()):
        log = SyncLog()
        log.input_slots = program.input_slots
        with torch.no_grad():
            out = StreamExecutor(SimulatedBackend(), native=nat).run(program, list(inputs), log)
        results.append((log.actions(), out))
    (log_py, out_py), (log_c, out_c) = results
    assert log_py == log_c and len(log_py) > 10
    assert_close(out_c, out_py, atol=0, rtol=0)


def test_copies_of_a_wrapped_module_are_independent():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="threads")
    x = torch.randn(2, 16)
    out = sm(x)
    twin = copy.deepcopy(sm)
    assert twin.module is not sm.module and twin.config == sm.config
    assert_close(twin(x), out)


def test_the_streams_executor_records_every_tensor_of_a_container_subclass():
    """record_stream reaches tensors inside list, tuple and dict subclasses, as the native
    runtime's walk does: a value another stream reads may be any such container."""
    from streamsched.runtime.streams import _tensors

    class Outputs(dict):
        pass

    class Parts(list):
        pass

    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    found = list(_tensors(Outputs(x=a, rest=Parts([b, (c, None)]))))
    assert len(found) == 3 and all(any(f is t for f in found) for t in (a, b, c))
