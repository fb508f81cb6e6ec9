"""CUDA tests: streams really used, events, record_stream, graph capture. Skipped without a GPU
(`make gpu-check` runs them on a GPU machine, also under TORCH_CUDA_SANITIZER=1)."""

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.models import CriticEnsemble, Inception3, NASNetCells, ParallelFCN
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
        "pfcn": (ParallelFCN(256).to(DEV), (torch.randn(8, 256 * 20, device=DEV),)),
    }


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


def test_sync_log_on_cuda_is_clean():
    model, inputs = cuda_models()["nasnet"]
    sm = ss.StreamScheduledModule(model.eval(), executor="streams", sync_log=True)
    with torch.no_grad():
        sm(*inputs)
        sm(*inputs)
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
    sm = ss.StreamScheduledModule(model, cuda_graph=True, num_streams=4, min_task_cost=0.0)
    with torch.no_grad():
        for _ in range(4):
            xs = tuple(torch.randn_like(x) for x in inputs)
            assert_close(sm(*xs), model(*xs), atol=1e-4)
    assert len(sm._ss.graphs[sm.plan.device]) == 1


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


def test_static_outputs_are_overwritten_when_not_cloned():
    model = Towers(2, 64).to(DEV).eval()
    sm = ss.StreamScheduledModule(model, cuda_graph=True, clone_outputs=False)
    with torch.no_grad():
        a = torch.randn(8, 64, device=DEV)
        b = torch.randn(8, 64, device=DEV)
        sm(a)
        out_a = sm(a)
        expected_b = model(b)
        out_b = sm(b)
    assert out_a.data_ptr() == out_b.data_ptr()
    assert_close(out_a, expected_b, atol=1e-5)


def test_graph_cache_is_bounded():
    model = Towers(2, 64).to(DEV).eval()
    sm = ss.StreamScheduledModule(model, cuda_graph=True, graph_cache_size=2)
    with torch.no_grad():
        for batch in (1, 2, 3, 4):
            x = torch.randn(batch, 64, device=DEV)
            sm(x)
            assert_close(sm(x), model(x), atol=1e-5)
    assert len(sm._ss.graphs[sm.plan.device]) == 2


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


def test_training_runs_on_streams_when_graphs_are_on():
    model = CriticEnsemble(8).to(DEV)
    sm = check_against_eager(model, (torch.randn(16, 23, device=DEV),), cuda_graph=True, atol=1e-4)
    assert any("CUDA graph" in note for note in sm.plan.notes)


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
