"""The emulated CUDA device itself: what it presents, what it reports, the capture rules.

Runs only where the device is emulated (no GPU); on a GPU the `cuda`-marked suite runs on
the real thing."""

import gc
import threading

import pytest
import torch
from torch import nn

from streamsched.emulated_cuda import CudaError, UnsynchronizedAccess

pytestmark = pytest.mark.cuda


# --- what it presents -------------------------------------------------------------------------


def test_tensors_report_their_emulated_device(emulated_cuda):
    assert torch.cuda.is_available() and torch.cuda.device_count() == 2
    a = torch.randn(3, device="cuda")
    b = torch.ones(2).cuda(1)
    c = torch.zeros(2, device=torch.device("cuda", 1))
    assert a.device == torch.device("cuda", 0) and a.is_cuda and a.get_device() == 0
    assert b.device == c.device == torch.device("cuda", 1)
    assert a.cpu().device.type == "cpu" and not a.cpu().is_cuda
    assert (a * 2).device == a.device and a[1:].device == a.device  # results and views
    assert a.to("cuda") is a and a.to("cuda:1").device.index == 1
    assert torch.tensor([1.0, 2.0], device="cuda").is_cuda
    assert a.new_zeros(4).device == a.device
    with pytest.raises(RuntimeError, match="same device"):
        a[:2] + b
    with pytest.raises(RuntimeError, match="same device"):
        a + torch.ones(3)  # a non-scalar host tensor
    assert (a + torch.tensor(1.0)).is_cuda  # a host scalar is fine
    with pytest.raises(TypeError, match="numpy"):
        a.numpy()
    assert a.tolist() == a.cpu().tolist()


def test_in_place_foreach_ops_move_version_counters_as_on_the_cpu(emulated_cuda):
    """``_foreach_add_`` and its kin (SGD's and Adam's default step for CUDA parameters)
    move the version counter of every tensor they write, once, as on the CPU and on CUDA;
    run under the emulator's dispatch mode they moved none (a host tensor's neither, inside
    the emulator), so a guard reading a counter (a kept view of a weight an optimizer
    steps) saw nothing change."""
    ops = [
        lambda ts, others: torch._foreach_add_(ts, others),
        lambda ts, others: torch._foreach_add_(ts, others, alpha=-0.5),
        lambda ts, others: torch._foreach_mul_(ts, 2.0),
        lambda ts, others: torch._foreach_zero_(ts),
        lambda ts, others: torch._foreach_copy_(ts, others),
    ]
    for i, op in enumerate(ops):
        versions = {}
        for device in ("cpu", "cuda"):
            ts = [torch.zeros(3, device=device), torch.zeros(2, 2, device=device)]
            others = [torch.ones(3, device=device), torch.ones(2, 2, device=device)]
            op(ts, others)
            versions[device] = [t._version for t in ts]
        assert versions["cuda"] == versions["cpu"] == [1, 1], (i, versions)
    weight = nn.Parameter(torch.randn(4, device="cuda"))
    kept = weight.detach()[:2]
    before = kept._version
    weight.grad = torch.ones(4, device="cuda")
    torch.optim.SGD([weight], lr=0.1, foreach=True).step()
    assert kept._version > before, "the step moved no version counter of a view of the weight"


def test_modules_move_to_the_emulated_device(emulated_cuda):
    lin = torch.nn.Linear(4, 2).cuda()
    assert all(p.is_cuda for p in lin.parameters())
    out = lin(torch.randn(3, 4, device="cuda"))
    out.sum().backward()
    assert lin.weight.grad.is_cuda and out.is_cuda
    lin.to("cpu")
    assert not lin.weight.is_cuda


def test_current_stream_and_device_are_per_thread_and_set_stream_switches_device(emulated_cuda):
    s1 = torch.cuda.Stream(device=1)
    assert torch.cuda.current_device() == 0
    torch.cuda.set_stream(s1)  # as PyTorch does: the stream's device becomes current
    assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() == s1
    torch.cuda.set_device(0)
    with torch.cuda.stream(s1):
        assert torch.cuda.current_stream(1) == s1
    assert torch.cuda.current_device() == 0
    seen = []
    t = threading.Thread(target=lambda: seen.append((torch.cuda.current_device(), torch.cuda.current_stream(1))))
    t.start()
    t.join()
    assert seen == [(0, torch.cuda.default_stream(1))]


# --- ordering ---------------------------------------------------------------------------------


def test_a_read_on_another_stream_without_a_wait_is_a_race(emulated_cuda):
    x = torch.ones(16, device="cuda") * 3  # written on the default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(UnsynchronizedAccess, match="no event"):
        x + 1
    assert [r.kind for r in emulated_cuda.take_reports()] == ["race"]


@pytest.mark.parametrize("order", ["wait_stream", "event", "synchronize", "stream_sync"])
def test_waits_and_synchronisations_order_the_read(emulated_cuda, order):
    x = torch.ones(16, device="cuda") * 3
    side = torch.cuda.Stream()
    if order == "wait_stream":
        side.wait_stream(torch.cuda.current_stream())
    elif order == "event":
        ev = torch.cuda.Event()
        ev.record()
        side.wait_event(ev)
    elif order == "synchronize":
        torch.cuda.synchronize()
    else:
        torch.cuda.current_stream().synchronize()
    with torch.cuda.stream(side):
        y = x + 1
    torch.cuda.current_stream().wait_stream(side)
    assert float(y.sum()) == 64.0


def test_write_after_read_on_another_stream_is_a_race(emulated_cuda):
    x = torch.ones(8, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x.sum()
    with pytest.raises(UnsynchronizedAccess):
        x.add_(1)  # the default stream overwrites what side may still be reading
    emulated_cuda.take_reports()


def test_freed_memory_another_stream_used_without_record_stream_is_reported(emulated_cuda):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    x = torch.randn(256, device="cuda")  # allocated on the default stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2  # read on side
    del x  # freed: its block returns to the default stream's pool at once
    z = torch.empty(256, device="cuda").fill_(1)  # the default stream may get that block now  # noqa: F841
    reports = emulated_cuda.take_reports()
    assert [r.kind for r in reports] == ["reuse"] and "record_stream" in reports[0].message
    torch.cuda.current_stream().wait_stream(side)
    del y


@pytest.mark.parametrize("how", ["record_stream", "wait"])
def test_record_stream_or_a_wait_makes_the_reuse_safe(emulated_cuda, how):
    side = torch.cuda.Stream()
    x = torch.randn(256, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x * 2
    if how == "record_stream":
        x.record_stream(side)
    else:
        torch.cuda.current_stream().wait_stream(side)
    del x
    torch.empty(256, device="cuda").fill_(1)
    assert emulated_cuda.take_reports() == []
    torch.cuda.current_stream().wait_stream(side)
    del y


# --- simulated time ---------------------------------------------------------------------------


def _two_streams(emulated_cuda, ordered):
    """The same matmul on the default stream and on a side stream, the side stream
    waiting for the first one's event when ``ordered``."""
    a = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with emulated_cuda.timeline() as tl:
        x = a @ a
        done = torch.cuda.Event()
        done.record()
        if ordered:
            side.wait_event(done)
        with torch.cuda.stream(side):
            y = a @ a
    torch.cuda.current_stream().wait_stream(side)
    return tl, x, y


def test_independent_streams_overlap_in_simulated_time_and_a_wait_serialises_them(emulated_cuda):
    free, _, _ = _two_streams(emulated_cuda, ordered=False)
    assert len(free.streams) == 2 and free.max_concurrency() == 2
    assert free.makespan == pytest.approx(free.serial_time / 2)
    assert free.overlap(*free.streams) == pytest.approx(free.makespan)
    waited, _, _ = _two_streams(emulated_cuda, ordered=True)
    first, second = waited.spans
    assert second.start >= first.end  # the side stream's matmul waited for the event
    assert waited.max_concurrency() == 1 and waited.makespan == pytest.approx(waited.serial_time)
    assert "simulated" in waited.summary()


def test_a_host_synchronisation_delays_later_work_in_simulated_time(emulated_cuda):
    a = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with emulated_cuda.timeline() as tl:
        (a @ a).sum().item()  # the host waits for the default stream
        with torch.cuda.stream(side):
            a @ a  # issued after: cannot start before the host got there
    torch.cuda.current_stream().wait_stream(side)
    first, second = [s for s in tl.spans if "mm" in s.name]
    assert second.start >= first.end and tl.max_concurrency() == 1


def test_a_replay_takes_the_captured_critical_path(emulated_cuda):
    x = torch.randn(64, 64, device="cuda")
    side = torch.cuda.Stream()

    def body():
        side.wait_stream(torch.cuda.current_stream())
        a = x @ x
        with torch.cuda.stream(side):
            b = x @ x
        torch.cuda.current_stream().wait_stream(side)
        return a + b

    g, _ = _capture(body)
    with emulated_cuda.timeline() as eager:
        x @ x
    with emulated_cuda.timeline() as replay:
        g.replay()
    (launch,) = replay.spans
    # The two matmuls overlap inside the graph: one matmul, then the add.
    assert eager.makespan < launch.end - launch.start < 2 * eager.makespan


# --- capture ----------------------------------------------------------------------------------


def _capture(fn, stream=None, **kw):
    g = torch.cuda.CUDAGraph()
    stream = stream or torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(g, stream=stream, **kw):
        out = fn()
    return g, out


def test_capture_records_and_replay_reruns_across_forked_streams(emulated_cuda):
    x = torch.randn(8, 8, device="cuda")
    w = torch.randn(8, 8, device="cuda")
    side = torch.cuda.Stream()

    def body():
        side.wait_stream(torch.cuda.current_stream())  # fork into the capture
        a = x @ w
        with torch.cuda.stream(side):
            b = torch.relu(x) * 2
        torch.cuda.current_stream().wait_stream(side)  # join
        return a + b

    g, out = _capture(body)
    assert torch.isnan(out).all()  # captured, not run: graph memory holds nothing yet
    for _ in range(3):
        x.copy_(torch.randn(8, 8, device="cuda"))
        g.replay()
        torch.testing.assert_close(out, x @ w + torch.relu(x) * 2)


def test_capture_does_not_run_writes_to_outside_memory(emulated_cuda):
    x = torch.zeros(4, device="cuda")
    g, _ = _capture(lambda: x.add_(1))
    assert x.tolist() == [0.0] * 4
    g.replay()
    g.replay()
    assert x.tolist() == [2.0] * 4


def test_a_sync_inside_capture_fails_like_cuda_and_leaks_the_pool_unless_released(emulated_cuda):
    x = torch.ones(4, device="cuda")
    s = torch.cuda.Stream()
    pool = torch.cuda.graph_pool_handle()
    with pytest.raises(CudaError, match="previous error during capture") as info:
        _capture(lambda: (x * 2).sum().item(), stream=s, pool=pool)
    # As with CUDA: the sync raised, then cudaStreamEndCapture's error replaced it, and the
    # capture stream is still current (torch.cuda.graph's __exit__ never restored it).
    assert "not permitted when stream is capturing" in str(info.value.__context__)
    assert torch.cuda.current_stream() == s
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert emulated_cuda.leaks()
    with pytest.raises(RuntimeError, match="already recording"):
        _capture(lambda: x * 2, pool=pool)  # the pool is still recording for the dead capture
    torch._C._cuda_endAllocateToPool(0, pool)
    torch._C._cuda_releasePool(0, pool)
    # Released by every capture that used it, the pool stays in the allocator and a capture
    # into it asserts (seen on an H200 with PyTorch 2.11); a new pool works.
    with pytest.raises(RuntimeError, match=r"use_count > 0 INTERNAL ASSERT"):
        _capture(lambda: x * 2, pool=pool)
    torch.cuda.set_stream(torch.cuda.default_stream())
    # Each failed capture left the CUDA generator in capture mode: random kernels raise
    # until a capture ends successfully.
    assert emulated_cuda.leaks() == [_GENERATOR_LEFT_CAPTURING]
    with pytest.raises(RuntimeError, match="Offset increment outside graph capture"):
        torch.randn(2, device="cuda")
    _capture(lambda: x * 2, pool=torch.cuda.graph_pool_handle())
    assert emulated_cuda.leaks() == []
    assert torch.randn(2, device="cuda").shape == (2,)


def test_an_unjoined_fork_fails_the_capture(emulated_cuda):
    x = torch.ones(4, device="cuda")
    side = torch.cuda.Stream()

    def body():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            return x * 2  # never joined back

    with pytest.raises(CudaError, match="unjoined"):
        _capture(body)
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert _pool_and_generator_left(emulated_cuda.take_leaks())


def test_waiting_on_an_event_recorded_outside_the_capture_fails(emulated_cuda):
    x = torch.ones(4, device="cuda")
    before = torch.cuda.Event()
    before.record()

    def body():
        torch.cuda.current_stream().wait_event(before)
        return x * 2

    with pytest.raises(CudaError, match="previous error during capture") as info:
        _capture(body)
    assert "outside the capture" in str(info.value.__context__)
    torch.cuda.set_stream(torch.cuda.default_stream())
    assert _pool_and_generator_left(emulated_cuda.take_leaks())


def test_capture_on_the_default_stream_is_refused(emulated_cuda):
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    # As in CUDAGraph::capture_begin, the generator entered capture mode before the check.
    assert emulated_cuda.take_leaks() == [_GENERATOR_LEFT_CAPTURING]


_GENERATOR_LEFT_CAPTURING = (
    "the CUDA generator of cuda:0 is still in capture mode after a capture that failed: "
    "every random kernel outside a capture now raises"
)


def _pool_and_generator_left(leaks: list[str]) -> bool:
    """What a capture that failed at its end leaves: its pool recording, the generator capturing."""
    return len(leaks) == 2 and "still recording" in leaks[0] and leaks[1] == _GENERATOR_LEFT_CAPTURING


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_pinning_host_memory_in_another_thread_during_capture(emulated_cuda, mode):
    x = torch.ones(4, device="cuda")
    started, pinned = threading.Event(), threading.Event()
    errors = []

    def pin_thread():
        started.wait()
        try:
            torch.ones(16).pin_memory()
        except RuntimeError as exc:
            errors.append(exc)
        pinned.set()

    def body():
        started.set()
        pinned.wait()
        return x * 2

    t = threading.Thread(target=pin_thread)
    t.start()
    if mode == "global":
        with pytest.raises(CudaError, match="previous error during capture"):
            _capture(body, capture_error_mode=mode)
        torch.cuda.set_stream(torch.cuda.default_stream())
        assert errors and "cudaHostAlloc" in str(errors[0])
        assert _pool_and_generator_left(emulated_cuda.take_leaks())
    else:
        g, out = _capture(body, capture_error_mode=mode)
        g.replay()
        assert errors == [] and out.tolist() == [2.0] * 4
    t.join()


def test_replay_reads_outside_memory_by_address_and_reports_it_freed(emulated_cuda):
    held = [torch.ones(4, device="cuda")]
    g, out = _capture(lambda: held[0] * 2)
    g.replay()
    held.clear()
    gc.collect()
    with pytest.raises(UnsynchronizedAccess, match="freed after the capture"):
        g.replay()
    assert [r.kind for r in emulated_cuda.take_reports()] == ["replay-freed"]


def test_a_missing_wait_inside_a_capture_gives_wrong_replays(emulated_cuda):
    """Replay runs captured work in a random order the captured dependencies allow: with
    the race report off, a missing wait shows up as a wrong answer."""
    emulated_cuda.emulator.raise_on_race = False
    x = torch.randn(64, device="cuda")
    side = torch.cuda.Stream()

    def body():
        side.wait_stream(torch.cuda.current_stream())
        a = x * 2  # on the capturing stream
        with torch.cuda.stream(side):
            b = a + 1  # reads a with no wait after it was written
        torch.cuda.current_stream().wait_stream(side)
        return b

    g, out = _capture(body)
    wrong = 0
    for _ in range(12):
        x.copy_(torch.randn(64, device="cuda"))
        g.replay()
        wrong += not torch.allclose(out, x * 2 + 1)
    assert wrong > 0
    assert {r.kind for r in emulated_cuda.take_reports()} == {"race"}


# --- planted defects in streamsched's CUDA paths ----------------------------------------------
# Each removes one synchronisation from the real code (CudaBackend, the eager-dispatch
# streams, the prefetcher) and checks that the emulated device catches it.

import streamsched as ss  # noqa: E402
from streamsched.prefetch import CudaCopier, Prefetcher  # noqa: E402
from streamsched.runtime.backends import CudaBackend  # noqa: E402
from streamsched.runtime.graphs import CaptureError  # noqa: E402

from .helpers import Towers, assert_close  # noqa: E402


class Heads(torch.nn.Module):
    """Independent towers whose outputs are the model's outputs: produced on side streams,
    read by the caller only after the join."""

    def __init__(self, n: int = 3, d: int = 64):
        super().__init__()
        self.towers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, d), torch.nn.Tanh(), torch.nn.Linear(d, d)) for _ in range(n)
        )

    def forward(self, x):
        return tuple(t(x) for t in self.towers)


class StemTowers(torch.nn.Module):
    """A stem on the caller's stream feeding towers of different depths: the stem's output
    is read by side streams and freed while the caller's stream goes on."""

    def __init__(self, n: int = 4, d: int = 128):
        super().__init__()
        self.stem = torch.nn.Linear(d, d)
        self.towers = Towers(n, d)

    def forward(self, x):
        return self.towers(torch.tanh(self.stem(x)))


def _planned(model, x, **config):
    config = {"executor": "streams", "num_streams": 4, "min_task_cost": 0.0, "fuse": False, **config}
    sm = ss.StreamScheduledModule(model, **config)
    with torch.no_grad():
        sm(x)  # the first call plans
    assert sm.plan.num_streams > 1
    return sm


def _waits(sm):
    return sum(len(t.waits) for t in sm.plan.tasks)


def test_planted_each_missing_wait_is_a_race(emulated_cuda, monkeypatch):
    model = Towers(4, 64).cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    sm = _planned(model, x)
    n = _waits(sm)
    assert n >= 2
    real = CudaBackend.wait
    for dropped in range(n):
        seen = []

        def wait(self, stream, event, dropped=dropped, seen=seen):
            seen.append(None)
            if len(seen) - 1 != dropped:
                real(self, stream, event)

        monkeypatch.setattr(CudaBackend, "wait", wait)
        with torch.no_grad(), pytest.raises(UnsynchronizedAccess):
            sm(x)
        assert {r.kind for r in emulated_cuda.take_reports()} == {"race"}, f"wait {dropped}"
    monkeypatch.setattr(CudaBackend, "wait", real)
    with torch.no_grad():
        assert_close(sm(x), model(x), atol=1e-5)


def test_planted_missing_record_stream_is_an_unsafe_reuse(emulated_cuda, monkeypatch):
    model = StemTowers().cuda().eval()
    x = torch.randn(32, 128, device="cuda")
    sm = _planned(model, x)
    assert any(t.cross_reads for t in sm._ss.last.program.tasks)
    with torch.no_grad():
        sm(x)
    assert emulated_cuda.take_reports() == []
    monkeypatch.setattr(CudaBackend, "record_stream", lambda self, tensor, stream: None)
    with torch.no_grad():
        sm(x)
        sm(x)
    reports = emulated_cuda.take_reports()
    assert reports and {r.kind for r in reports} == {"reuse"}


def test_planted_missing_join_is_a_race_for_the_caller(emulated_cuda, monkeypatch):
    model = Heads().cuda().eval()
    x = torch.randn(16, 64, device="cuda")
    sm = _planned(model, x)
    assert sm.plan.num_streams > 1
    monkeypatch.setattr(CudaBackend, "join", lambda self, caller, side: None)
    with torch.no_grad():
        outs = sm(x)
    with pytest.raises(UnsynchronizedAccess):
        for o in outs:
            o.sum()  # read on the caller's stream
    assert {r.kind for r in emulated_cuda.take_reports()} == {"race"}


def test_planted_missing_join_fails_the_capture(emulated_cuda, monkeypatch):
    model = Heads().cuda().eval()
    x = torch.randn(16, 64, device="cuda")
    sm = _planned(model, x, cuda_graph=True)
    monkeypatch.setattr(CudaBackend, "join", lambda self, caller, side: None)
    with torch.no_grad(), pytest.raises(CaptureError, match="unjoined"):
        sm(x)
    emulated_cuda.take_reports()
    emulated_cuda.take_leaks()


def test_planted_missing_fork_is_a_race(emulated_cuda, monkeypatch):
    model = Towers(4, 64).cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    sm = _planned(model, x)
    monkeypatch.setattr(CudaBackend, "fork", lambda self, caller, side: None)
    with torch.no_grad(), pytest.raises(UnsynchronizedAccess):
        sm(torch.randn(32, 64, device="cuda"))  # made on the caller's stream, read on side streams
    emulated_cuda.take_reports()


def test_planted_fork_from_before_the_capture_fails_the_capture(emulated_cuda, monkeypatch):
    """Side streams that join the capture through an event recorded before it began (a fork
    event recorded once and reused) are not forked from the capture: CUDA refuses the wait."""
    model = Towers(4, 64).cuda().eval()
    x = torch.randn(32, 64, device="cuda")
    sm = _planned(model, x, cuda_graph=True)
    real = CudaBackend.fork

    def fork_once(self, caller, side):
        if self._fork_event is None:
            return real(self, caller, side)
        for s in side:
            s.wait_event(self._fork_event)

    monkeypatch.setattr(CudaBackend, "fork", fork_once)
    with torch.no_grad(), pytest.raises(CaptureError, match="outside the capture"):
        sm(x)
    emulated_cuda.take_reports()
    emulated_cuda.take_leaks()


# --- eager dispatch and the prefetcher --------------------------------------------------------


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    @ss.branch
    def run(self, layer, x):
        return torch.tanh(layer(x))

    def forward(self, x):
        if x.sum() > 0:  # untraceable: eager dispatch
            x = x * 1
        return self.run(self.a, x) + self.run(self.b, x)


def test_planted_missing_wait_in_eager_dispatch_is_a_race(emulated_cuda, monkeypatch):
    model = Branchy().cuda()
    sm = ss.StreamScheduledModule(model, strict=False, executor="streams", num_streams=3)
    x = torch.randn(16, 64, device="cuda").abs()
    with torch.no_grad():
        assert_close(sm(x), model(x), atol=1e-5)
        monkeypatch.setattr(CudaBackend, "wait", lambda self, stream, event: None)
        with pytest.raises(UnsynchronizedAccess):
            sm(x)
    emulated_cuda.take_reports()


def test_planted_prefetcher_defects(emulated_cuda, monkeypatch):
    batches = [torch.full((1024,), float(k)) for k in range(4)]
    sums = [float(b.sum()) for b in Prefetcher(batches, "cuda")]
    assert sums == [1024.0 * k for k in range(4)] and emulated_cuda.take_reports() == []
    # Without record_stream the copy stream may get a batch's memory back while the
    # consumer still reads it.
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    for batch in Prefetcher(batches, "cuda"):
        batch.sum()
        del batch
    assert {r.kind for r in emulated_cuda.take_reports()} == {"reuse"}
    monkeypatch.undo()
    # Without the consumer's wait the batch is read while its copy may still be running.
    monkeypatch.setattr(
        CudaCopier,
        "hand_out",
        lambda self, pending: [t.record_stream(torch.cuda.current_stream()) for t in pending.copies] and pending.batch,
    )
    with pytest.raises(UnsynchronizedAccess):
        for batch in Prefetcher(batches, "cuda"):
            batch.sum()
    emulated_cuda.take_reports()


class _Outputs(dict):
    """A dict subclass, as model outputs often are."""


class _DictHead(nn.Module):
    def forward(self, x):
        return _Outputs(a=x * 2)


class _TwoLinearsDictHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.head = nn.Linear(4, 4), nn.Linear(4, 4), _DictHead()

    def forward(self, x):
        return self.head(self.l1(x) + self.l2(x))


def test_cuda_graph_outputs_in_a_dict_subclass_are_the_callers(emulated_cuda):
    """Replayed outputs are cloned inside container subclasses too, and keep their type:
    the next replay must not overwrite what the previous call returned."""
    model = _TwoLinearsDictHead().cuda()
    sm = ss.StreamScheduledModule(model, leaf_modules=[_DictHead], executor="streams", cuda_graph=True)
    with torch.no_grad():
        for _ in range(2):
            sm(torch.randn(2, 4, device="cuda"))
        first = sm(torch.ones(2, 4, device="cuda"))
        kept = first["a"].clone()
        sm(torch.zeros(2, 4, device="cuda"))
        assert len(sm._ss.graphs[sm.plan.device]) == 1  # replayed, not run on streams
        assert type(first) is _Outputs and torch.equal(first["a"], kept)
        assert_close(first["a"], model(torch.ones(2, 4, device="cuda"))["a"])
