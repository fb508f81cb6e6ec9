"""CUDA tests: streams really used, events, record_stream, graph capture. On a GPU machine
`make gpu-check` runs them (also under TORCH_CUDA_SANITIZER=1); elsewhere they run on the
emulated device (streamsched.emulated_cuda), which fails a test on any unordered access,
unsafe memory reuse or broken capture rule, except the `gpu`-marked ones (timings, peak
memory, the native CUDA backend).

Every plan here that can use several streams is checked to (conftest gives `cuda` tests a
cost model under which their small shapes are worth spreading)."""

import copy
import threading
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, Inception3, NASNetCells, ParallelFCN
from streamsched.runtime.graphs import CaptureError
from streamsched.testing import check_happens_before

from .helpers import ConvTowers, Towers, assert_close, check_against_eager

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda")


def cuda_models():
    return {
        "towers": (Towers(4, 256).to(DEV), (torch.randn(64, 256, device=DEV),)),
        "conv_towers": (ConvTowers().to(DEV), (torch.randn(4, 8, 32, 32, device=DEV),)),
        "nasnet": (NASNetCells(32, 2, num_classes=10).to(DEV), (torch.randn(2, 3, 64, 64, device=DEV),)),
        "pfcn": (ParallelFCN(256).to(DEV), (torch.randn(128, 256 * 20, device=DEV),)),
    }


def emulated(request):
    """The emulated device this test runs on, or None on a real GPU."""
    return request.getfixturevalue("_cuda_device")


@pytest.mark.gpu
def test_native_runtime_drives_cuda():
    info = ss.runtime_info()
    assert info["native"] and info["native_cuda"], info


@pytest.mark.parametrize("name", ["towers", "conv_towers", "nasnet", "pfcn"])
@pytest.mark.parametrize("fuse", [True, False])
def test_streams_outputs_and_grads_equal_eager(name, fuse):
    model, inputs = cuda_models()[name]
    sm = check_against_eager(model, inputs, executor="streams", fuse=fuse, num_streams=4, min_task_cost=0.0, atol=1e-4)
    assert sm.plan.executor == "streams" and sm.plan.device.startswith("cuda")
    if not (name == "pfcn" and fuse):  # fused, the 256 MLPs are one chain of batched kernels
        assert sm.plan.num_streams > 1


def test_inception_streams_use_several_streams_and_match_eager():
    model = Inception3().eval().to(DEV)
    sm = check_against_eager(
        model, (torch.randn(1, 3, 299, 299, device=DEV),), backward=False, atol=1e-3, executor="streams"
    )
    assert sm.plan.num_streams > 1


def test_caller_stream_is_respected_and_restored():
    model = Towers(4, 256).to(DEV)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0)
    x = torch.randn(64, 256, device=DEV)
    expected = model(x)
    sm(x)
    assert sm.plan.num_streams > 1
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(caller):
        torch.cuda._sleep(10_000_000)  # the caller's stream is busy: the fork must wait for it
        y = x * 1.0  # produced on the caller stream, after the sleep
        out = sm(y)
        assert torch.cuda.current_stream() == caller
        checksum = out.sum()  # consumed on the caller stream: must see the finished result
    torch.cuda.synchronize()
    assert_close(out, expected, atol=1e-4)
    assert_close(checksum, expected.sum(), atol=1e-2)


@pytest.mark.parametrize("seed", range(5))
def test_chaos_delays_never_change_results(seed):
    model = ConvTowers().to(DEV).eval()
    sm = ss.StreamScheduledModule(
        model, executor="streams", num_streams=4, min_task_cost=0.0, chaos=seed, sync_log=True
    )
    for _ in range(20):
        x = torch.randn(4, 8, 32, 32, device=DEV)
        assert_close(sm(x), model(x), atol=1e-4)
    assert sm.plan.num_streams > 1
    assert check_happens_before(sm.last_sync_log) == []


def test_memory_of_values_crossing_streams_is_not_reused_early():
    """Values produced on one stream, read on another and then dropped: with the reader
    delayed by a spin kernel, a missing record_stream would let the next allocation reuse
    the block and corrupt the result."""
    model = Towers(6, 512).to(DEV)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=6, min_task_cost=0.0, chaos=3, fuse=False)
    for _ in range(30):
        x = torch.randn(128, 512, device=DEV)
        assert_close(sm(x), model(x), atol=1e-4)
    assert sm.plan.num_streams > 1


def test_sync_log_on_cuda_is_clean():
    model, inputs = cuda_models()["nasnet"]
    sm = ss.StreamScheduledModule(model.eval(), executor="streams", sync_log=True)
    with torch.no_grad():
        sm(*inputs)
        sm(*inputs)
    assert sm.plan.num_streams > 1
    assert check_happens_before(sm.last_sync_log) == []


@pytest.mark.gpu
def test_peak_memory_close_to_eager():
    model = Inception3().eval().to(DEV)
    x = torch.randn(8, 3, 299, 299, device=DEV)
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        sm(x)
        sm(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(x)
        eager_peak = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        sm(x)
        ours = torch.cuda.max_memory_allocated() - base
    assert ours <= 1.15 * eager_peak, (ours, eager_peak)


# --- CUDA graphs ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["towers", "conv_towers", "pfcn"])
def test_graph_replay_equals_eager(name):
    model, inputs = cuda_models()[name]
    model.eval()
    sm = ss.StreamScheduledModule(model, executor="streams", cuda_graph=True, num_streams=4, min_task_cost=0.0)
    with torch.no_grad():
        for _ in range(4):
            xs = tuple(torch.randn_like(x) for x in inputs)
            assert_close(sm(*xs), model(*xs), atol=1e-4)
    assert len(sm._ss.graphs[sm.plan.device]) == 1
    if name != "pfcn":  # fused, ParallelFCN is one chain: the others capture several streams
        assert sm.plan.num_streams > 1


def test_weights_updated_after_capture_are_seen():
    model = ParallelFCN(64).to(DEV)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, cuda_graph=True)
    x = torch.randn(4, 64 * 20, device=DEV)
    with torch.no_grad():
        sm(x)
        sm(x)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
        assert_close(sm(x), ref(x), atol=1e-5)
        sm.load_state_dict(ParallelFCN(64).to(DEV).state_dict())
        ref.load_state_dict(model.state_dict())
        assert_close(sm(x), ref(x), atol=1e-5)
        model.mlps[3].fc1.weight.data = torch.randn(10, 20, device=DEV)
        ref.mlps[3].fc1.weight.data = model.mlps[3].fc1.weight.data.clone()
        assert_close(sm(x), ref(x), atol=1e-5)


def _reallocate_by_data(w: torch.Tensor) -> None:
    w.data = w.detach().clone() * 0.5


def _reallocate_storage(w: torch.Tensor) -> None:
    # What FSDP does to a parameter between uses: the storage freed (resized to nothing)
    # and allocated again under the same StorageImpl, at another address.
    keep, address = w.detach().clone(), w.data_ptr()
    storage = w.untyped_storage()
    nbytes = storage.nbytes()
    holds = []  # blocks held so that the allocator does not hand the freed one back
    while w.data_ptr() == address and len(holds) < 8:
        storage.resize_(0)
        holds.append(torch.empty(nbytes, dtype=torch.uint8, device=w.device))
        storage.resize_(nbytes)
    del holds
    with torch.no_grad():
        w.copy_(keep * 0.5)


@pytest.fixture(params=["native", "python"])
def address_check(request, monkeypatch):
    """The graph executor's checks of weight addresses and requires_grad flags: the native
    runtime's ``AddressGuard`` loop, or the Python one beside it."""
    import streamsched.runtime.graphs as graphs

    if request.param == "python":
        monkeypatch.setattr(graphs, "_address_guard", lambda tensors: None)
    elif ss.runtime_info()["runtime"] != "native":
        pytest.skip("the native runtime is not built")
    return request.param


@pytest.mark.parametrize("reallocate", [_reallocate_by_data, _reallocate_storage], ids=["data", "storage-resized"])
def test_a_weight_at_a_new_address_is_captured_again(reallocate, address_check):
    """An unfused weight given new memory: the graph read the old address, so it is
    captured again (found by the weights' address check; no module registration moves)."""
    model, sm = graph_towers()
    model.eval()
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        sm(x)
        assert_close(sm(x), model(x), atol=1e-5)
        (captured,) = graphs_of(sm)._graphs.values()
        assert (captured.address_guard is not None) == (address_check == "native")
        old, address = captured.graph, model.towers[1][2].weight.data_ptr()
        reallocate(model.towers[1][2].weight)
        assert model.towers[1][2].weight.data_ptr() != address
        x = torch.randn(8, 64, device=DEV)
        assert_close(sm(x), model(x), atol=1e-5)
        assert sm._ss.last_path == "graph"
        (captured,) = graphs_of(sm)._graphs.values()
        assert captured.graph is not old
        assert_close(sm(x), model(x), atol=1e-5)
    assert sm.plan.num_streams > 1


def test_static_graph_outputs_are_overwritten_when_not_cloned():
    model = Towers(3, 128).to(DEV).eval()
    sm = ss.StreamScheduledModule(model, executor="streams", cuda_graph=True, clone_outputs=False, fuse=False)
    with torch.no_grad():
        a = torch.randn(32, 128, device=DEV)
        b = torch.randn(32, 128, device=DEV)
        sm(a)
        out_a = sm(a)
        expected_b = model(b)
        out_b = sm(b)
    assert out_a.data_ptr() == out_b.data_ptr()
    assert_close(out_a, expected_b, atol=1e-5)
    assert sm.plan.num_streams > 1


def test_graph_cache_is_bounded():
    model = Towers(3, 128).to(DEV).eval()
    sm = ss.StreamScheduledModule(model, executor="streams", cuda_graph=True, graph_cache_size=2, fuse=False)
    with torch.no_grad():
        for batch in (16, 32, 48, 64):
            x = torch.randn(batch, 128, device=DEV)
            sm(x)
            assert_close(sm(x), model(x), atol=1e-5)
    assert len(sm._ss.graphs[sm.plan.device]) == 2
    assert sm.plan.num_streams > 1


class Syncing(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    @ss.branch
    def clip(self, h):
        return h * min(1.0, 10.0 / float(h.abs().max()))  # a CPU synchronisation

    def forward(self, x):
        return self.clip(self.fc(x))


def test_capture_failure_falls_back_with_one_warning_or_raises():
    model = Syncing().to(DEV).eval()
    x = torch.randn(4, 16, device=DEV)
    auto = ss.StreamScheduledModule(model, cuda_graph="auto")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(4):
            assert_close(auto(x), model(x), atol=1e-5)
    messages = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    assert len(messages) == 1 and "clip" in messages[0]
    strict = ss.StreamScheduledModule(model, cuda_graph=True)
    with torch.no_grad():
        strict(x)
        with pytest.raises(CaptureError):
            strict(x)
    # The failed captures left the device's random numbers usable: CUDAGraph.capture_begin
    # puts the CUDA generator in capture mode and only a successful capture_end takes it
    # out; left so, every later dropout of the process raised (seen on an H200).
    assert torch.nn.functional.dropout(torch.ones(64, device=DEV), 0.5, training=True).sum() > 0


def test_training_runs_on_streams_when_graphs_are_on():
    model = CriticEnsemble(8).to(DEV)
    sm = check_against_eager(model, (torch.randn(16, 23, device=DEV),), cuda_graph=True, atol=1e-4)
    assert any("CUDA graph" in note for note in sm.plan.notes)


# --- defects of the graph executor found by review: each test failed before its fix ----------


def graph_towers(n: int = 3, d: int = 64, device=DEV, **config):
    model = Towers(n, d).to(device)
    config = {
        "executor": "streams",
        "cuda_graph": True,
        "num_streams": 4,
        "min_task_cost": 0.0,
        "fuse": False,
        **config,
    }
    return model, ss.StreamScheduledModule(model, **config)


def graphs_of(sm):
    return sm._ss.graphs.get(sm.plan.device, ())


def test_training_steps_are_not_captured():
    """The parameters require grad though the inputs do not: a captured step would replay
    onto the one autograd graph recorded at capture, and the second backward would fail."""
    model, sm = graph_towers()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(16, 64, device=DEV)
        for m, o in ((sm, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_close(p, q, atol=1e-5, what="parameter after the step")
    assert sm.plan.num_streams > 1
    assert len(graphs_of(sm)) == 0
    with torch.no_grad():  # inference of the same signature is captured
        sm(x)
        assert_close(sm(x), ref(x), atol=1e-5)
    assert len(graphs_of(sm)) == 1


class SyncingTowers(nn.Module):
    """Two towers; one ends in a branch that reads a value on the host for batches of 8 or more."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))
        self.b = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))

    @ss.branch
    def clip(self, h):
        if h.shape[0] < 8:
            return h * 0.5
        return h * min(1.0, 10.0 / float(h.abs().max()))  # a CPU synchronisation

    def forward(self, x):
        return self.a(x) + self.clip(self.b(x))


def test_a_frozen_model_called_with_grad_mode_on_is_captured_until_a_parameter_trains(address_check):
    """A frozen model (no parameter requires grad) called without ``no_grad`` replays its
    graph; a parameter made trainable again leaves the next call uncaptured (run on the
    streams the graph would capture), and its gradient is autograd's."""
    model, sm = graph_towers()
    model.eval().requires_grad_(False)
    ref = copy.deepcopy(model)
    for _ in range(3):
        x = torch.randn(8, 64, device=DEV)
        assert_close(sm(x), ref(x), atol=1e-5)
    assert sm._ss.last_path == "graph" and len(graphs_of(sm)) == 1
    model.towers[2][0].weight.requires_grad_(True)
    ref.towers[2][0].weight.requires_grad_(True)
    x = torch.randn(8, 64, device=DEV)
    out, expected = sm(x), ref(x)
    assert sm._ss.last_path == "plan:streams"
    assert out.requires_grad
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_close(model.towers[2][0].weight.grad, ref.towers[2][0].weight.grad, atol=1e-4)
    model.towers[2][0].weight.requires_grad_(False)
    assert_close(sm(x), ref(x), atol=1e-5)
    assert sm._ss.last_path == "graph"
    assert sm.plan.num_streams > 1


def test_a_failed_capture_keeps_its_error_the_callers_stream_and_its_pool_usable():
    model = SyncingTowers().to(DEV).eval()
    x, small = torch.randn(8, 64, device=DEV), torch.randn(4, 64, device=DEV)
    caller = torch.cuda.current_stream()
    config = {"executor": "streams", "num_streams": 4, "min_task_cost": 0.0, "fuse": False}
    strict = ss.StreamScheduledModule(model, cuda_graph=True, **config)
    with torch.no_grad():
        strict(x)
        with pytest.raises(CaptureError) as info:
            strict(x)
    # The error that broke the capture, with the task it came from; not the one
    # cudaStreamEndCapture reports for an invalidated capture.
    assert "not permitted when stream is capturing" in str(info.value) and "clip" in str(info.value)
    assert "previous error during capture" not in str(info.value)
    assert torch.cuda.current_stream() == caller  # the capture stream is not left current
    assert strict.plan.num_streams > 1
    auto = ss.StreamScheduledModule(model, cuda_graph="auto", **config)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_close(auto(x), model(x), atol=1e-5)
        for _ in range(3):  # another signature: captured in the same pool
            assert_close(auto(small), model(small), atol=1e-5)
    messages = [str(w.message) for w in caught if "CUDA graph capture failed" in str(w.message)]
    assert len(messages) == 1 and "clip" in messages[0]
    assert len(graphs_of(auto)) == 1
    assert torch.cuda.current_stream() == caller


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_a_reassigned_parameter_is_seen_by_the_next_graph_replay(fuse):
    model, sm = graph_towers(fuse=fuse)
    model.eval()
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        sm(x)
        assert_close(sm(x), model(x), atol=1e-5)
        assert len(graphs_of(sm)) == 1
        model.head.weight = nn.Parameter(torch.randn_like(model.head.weight))
        model.towers[1][0].bias = nn.Parameter(torch.randn_like(model.towers[1][0].bias))
        assert_close(sm(x), model(x), atol=1e-5)
        assert_close(sm(x), model(x), atol=1e-5)
    assert sm.plan.num_streams > 1


def test_calls_under_autocast_are_not_captured():
    """A capture under autocast would read autocast's cached half-precision copies of the
    weights: later weight updates never reach them, and autocast frees them on exit."""
    model, sm = graph_towers()
    model.eval()
    ref = copy.deepcopy(model)
    x = torch.randn(8, 64, device=DEV)
    with torch.no_grad():
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                sm(x)
        for p, q in zip(model.parameters(), ref.parameters()):
            p.mul_(0.5)
            q.mul_(0.5)
        with torch.autocast("cuda", dtype=torch.float16):
            out, expected = sm(x), ref(x)
    assert out.dtype == expected.dtype == torch.float16
    assert_close(out.float(), expected.float(), atol=1e-2, rtol=1e-2)
    assert len(graphs_of(sm)) == 0 and sm.plan.num_streams > 1


def needs_two_devices():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["streams", "graph"])
def test_a_module_on_the_second_device_leaves_the_current_device_alone(cuda_graph):
    needs_two_devices()
    dev1 = torch.device("cuda", 1)
    model, sm = graph_towers(device=dev1, cuda_graph=cuda_graph)
    model.eval()
    assert torch.cuda.current_device() == 0
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(8, 64, device=dev1)
            out = sm(x)
            assert torch.cuda.current_device() == 0
            assert out.device == dev1
            assert_close(out, model(x), atol=1e-5)
    assert sm.plan.device == "cuda:1" and sm.plan.num_streams > 1
    assert len(graphs_of(sm)) == int(cuda_graph)


@pytest.mark.usefixtures("plan_first_calls")  # the trial begins on the first call
def test_the_executor_trial_synchronizes_the_modules_device(request):
    emu = emulated(request)
    if emu is None:
        pytest.skip("which device a trial synchronises is observed on the emulated device")
    model = Towers(3, 64).to("cuda:1").eval()
    sm = ss.StreamScheduledModule(model, num_streams=4, min_task_cost=0.0, fuse=False)  # executor "auto": a trial
    x = torch.randn(8, 64, device="cuda:1")
    with torch.no_grad():
        sm(x)
        assert sm._ss.last.trial is not None
        emu.emulator.synchronize_calls.clear()
        for _ in range(8):
            sm(x)
    assert emu.emulator.synchronize_calls and set(emu.emulator.synchronize_calls) == {1}


def test_captures_sharing_a_pool_use_one_capture_stream(request):
    model, sm = graph_towers()
    model.eval()
    with torch.no_grad():
        for batch in (4, 8, 4):
            x = torch.randn(batch, 64, device=DEV)
            sm(x)
            assert_close(sm(x), model(x), atol=1e-5)
    graphs = sm._ss.graphs[sm.plan.device]
    assert len(graphs) == 2 and len(graphs._streams) == 1
    emu = emulated(request)
    if emu is not None:
        assert emu.advisories == []


class Pausing(nn.Module):
    """Towers; while a capture runs, one branch lets another thread pin host memory."""

    def __init__(self, started: threading.Event, pinned: threading.Event):
        super().__init__()
        self.towers = Towers(3, 64)
        self.started, self.pinned = started, pinned

    @ss.branch
    def pause(self, h):
        if torch.cuda.is_current_stream_capturing() and not self.started.is_set():
            self.started.set()
            self.pinned.wait(10)
        return h * 2

    def forward(self, x):
        return self.pause(self.towers(x))


def test_a_pin_memory_thread_does_not_break_the_capture():
    """A DataLoader's pin-memory thread pins batches while the main thread captures: with
    CUDA's "global" capture mode that host allocation fails in that thread and invalidates
    the capture."""
    started, pinned = threading.Event(), threading.Event()
    errors = []

    def pin_thread():
        if started.wait(30):
            try:
                torch.empty(1 << 16).pin_memory()
            except RuntimeError as exc:
                errors.append(exc)
        pinned.set()

    model = Pausing(started, pinned).to(DEV).eval()
    sm = ss.StreamScheduledModule(
        model, executor="streams", cuda_graph=True, num_streams=4, min_task_cost=0.0, fuse=False
    )
    x = torch.randn(8, 64, device=DEV)
    thread = threading.Thread(target=pin_thread)
    thread.start()
    try:
        with torch.no_grad():
            sm(x)
            out = sm(x)
    finally:
        started.set()
        thread.join()
    assert errors == [] and len(graphs_of(sm)) == 1
    with torch.no_grad():
        assert_close(out, model(x), atol=1e-5)
    assert sm.plan.num_streams > 1


def test_task_ranges_appear_in_the_torch_profiler():
    model = Towers(3, 256).to(DEV)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=3, min_task_cost=0.0, fuse=False)
    x = torch.randn(32, 256, device=DEV)
    sm(x)
    sm(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        sm(x)
    names = {e.key for e in prof.key_averages()}
    expected = {f"{t.name} [s{t.stream}]" for t in sm.plan.tasks}
    assert expected <= names, expected - names
