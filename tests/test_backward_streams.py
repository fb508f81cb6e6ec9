"""Backward on the streams of the forward: autograd's stream semantics on the emulated device.

On CUDA each backward node runs on the stream its forward op ran on, the engine makes a
node's stream wait for gradients readied on other streams, and the caller's stream waits
for the leaf streams before ``backward()`` returns (streamsched.emulated_cuda._autograd).
These tests check that the emulated device does the same (kernels on several streams,
gradients equal eager on the CPU, each of the engine's synchronisations necessary), and
that a synchronisation streamsched issues in the forward for the sake of the backward is
needed there.
"""

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import ParallelFCN
from streamsched._native import native
from streamsched.emulated_cuda import UnsynchronizedAccess
from streamsched.emulated_cuda._autograd import BackwardStreams
from streamsched.runtime.backends import CudaBackend
from streamsched.testing import assert_path

from .helpers import Towers, assert_close

pytestmark = pytest.mark.cuda


def _side_kernels(cuda, before):
    """Backward kernels per stream since ``before`` (a copy of ``cuda.backward_kernels``)."""
    return {k: n - before.get(k, 0) for k, n in cuda.backward_kernels.items() if n > before.get(k, 0)}


# --- the engine's stream semantics, by hand --------------------------------------------------


def _two_branches(device, w, x, streams):
    """A trunk on the caller's stream, two branches on two streams that both read the
    trunk's output (its gradient is summed from two streams) and the trunk's weight (its
    AccumulateGrad receives gradients from three streams), joined on the caller's stream.
    The weights hold a ``.grad`` already: every AccumulateGrad adds on its stream."""
    w0, w1, w2 = (t.detach().clone().to(device).requires_grad_() for t in w)
    for p in (w0, w1, w2):
        p.grad = torch.full_like(p, 0.5)
    x = x.to(device)
    h = torch.sigmoid(x @ w0)
    if streams:
        main = torch.cuda.current_stream()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        s1.wait_stream(main)
        s2.wait_stream(main)
        with torch.cuda.stream(s1):
            a = torch.relu(h @ w1) * w0.sum()
        with torch.cuda.stream(s2):
            b = torch.tanh(h @ w2) + w0.mean()
        main.wait_stream(s1)
        main.wait_stream(s2)
    else:
        a = torch.relu(h @ w1) * w0.sum()
        b = torch.tanh(h @ w2) + w0.mean()
    return (a * b).sum(), (w0, w1, w2)


def test_backward_runs_on_the_forward_streams_and_equals_eager(emulated_cuda):
    w = [torch.randn(6, 6) for _ in range(3)]
    x = torch.randn(5, 6)
    loss, expected = _two_branches("cpu", w, x, streams=False)
    loss.backward()
    before = dict(emulated_cuda.backward_kernels)
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):  # a caller on a stream of its own
        loss, params = _two_branches("cuda", w, x, streams=True)
        loss.backward()
        assert torch.cuda.current_stream() == caller, "backward() leaves the caller's stream current"
        # Read on the caller's stream with no wait of ours: the engine ordered it after the leaves.
        got = [(p.grad * 1).cpu() for p in params]
    ran = _side_kernels(emulated_cuda, before)
    assert len(ran) == 3, f"backward kernels ran on {sorted(ran)}: the trunk's stream and the two branches'"
    assert "default stream of cuda:0" not in ran, "nothing of the backward ran on the default stream"
    for g, p in zip(got, expected):
        assert_close(g, p.grad, atol=1e-5)
    assert emulated_cuda.reports == []


def _drop_pre_waits(self, tag, grads):
    self._task()
    if tag.stream is not None:
        self.emu.set_current_stream(tag.stream)


def _drop_leaf_sync(self, tid):
    task = self._tasks.get(tid)
    if task is not None:
        task.leaves.clear()
    _FINISH(self, tid)


def _drop_accumulation_waits(self, args):
    task = self._tasks.get(torch._C._current_graph_task_id())
    if task is None or not task.pending:
        return None
    task.pending.clear()
    return None  # the add runs on the producer's stream, with no wait


_FINISH = BackwardStreams._finish


@pytest.mark.parametrize(
    "planted",
    [
        ("_before", _drop_pre_waits),  # a node's stream does not wait for its incoming gradients
        ("_finish", _drop_leaf_sync),  # the caller's stream does not wait for the leaves
        ("accumulation", _drop_accumulation_waits),  # a second gradient added on its producer's stream
    ],
    ids=["node-waits", "leaf-sync", "accumulation"],
)
def test_each_synchronisation_of_the_engine_is_needed(emulated_cuda, monkeypatch, planted):
    name, fn = planted
    w = [torch.randn(6, 6) for _ in range(3)]
    x = torch.randn(5, 6)
    monkeypatch.setattr(BackwardStreams, name, fn)
    with pytest.raises(UnsynchronizedAccess):
        loss, params = _two_branches("cuda", w, x, streams=True)
        loss.backward()
        for p in params:
            p.grad.sum()  # on the caller's stream
    assert "race" in {r.kind for r in emulated_cuda.take_reports()}
    torch.cuda.synchronize()


def test_a_reentrant_backward_and_a_failing_backward_restore_the_callers_stream(emulated_cuda):
    w = torch.randn(4, 4, device="cuda", requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(t @ t), w, use_reentrant=True)
    torch.cuda.current_stream().wait_stream(side)
    y.sum().backward()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    expected = torch.autograd.grad(torch.tanh(w @ w).sum(), w)[0]
    assert_close(w.grad, expected, atol=1e-5)

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            raise ValueError("planted")

    with torch.cuda.stream(side):
        z = Fails.apply(w)
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(ValueError, match="planted"):
        z.sum().backward()
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    assert emulated_cuda.reports == []


# --- streamsched: training on a multi-stream plan -------------------------------------------------


def _loss(out):
    return (out[0] if isinstance(out, tuple) else out).square().sum()


def _sgd_steps(sm, model, ref, make_input, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for _ in range(steps):
        x = make_input()
        opt.zero_grad()
        opt_ref.zero_grad()
        _loss(sm(x.clone())).backward()
        _loss(ref(x)).backward()
        assert_path(sm, "plan:streams")
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, atol=1e-4, what=f"grad {name}")
        opt.step()
        opt_ref.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-4, what=name)


def test_training_a_multi_stream_plan_runs_backward_on_its_streams(emulated_cuda):
    model = Towers(4, 64).cuda()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, fuse=False)
    sm(torch.randn(16, 64, device="cuda")).sum().backward()  # the first call runs as written
    model.zero_grad()
    before = dict(emulated_cuda.backward_kernels)
    _sgd_steps(sm, model, ref, lambda: torch.randn(16, 64, device="cuda"))
    assert sm.plan.num_streams > 1
    ran = _side_kernels(emulated_cuda, before)
    side = [name for name in ran if name != "default stream of cuda:0"]
    assert len(side) >= 2, f"backward kernels ran on {sorted(ran)}"
    assert emulated_cuda.reports == []


class TrunkAndBranch(nn.Module):
    """``u`` made on the caller's stream is read by a branch the plan puts on a side
    stream, which saves it for backward; the caller's stream has backward work of its own
    (``shift``'s gradient) that does not wait for that branch's. ``u`` is an output too, so
    the call holds it to the end (only the backward reads it after the join)."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        u = x * 2.0
        h = u + self.shift
        return torch.relu(u * self.scale) + self.lin(h), u


def _trunk_and_branch():
    model = TrunkAndBranch().cuda()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, fuse=False)
    _loss(sm(torch.randn(32, 64, device="cuda"))).backward()
    model.zero_grad()
    sm(torch.randn(32, 64, device="cuda"))
    tasks = sm._ss.last.program.tasks
    assert sm.plan.num_streams > 1 and any(t.stream != 0 and t.cross_reads for t in tasks)
    return sm, model, ref


def test_memory_a_side_stream_reads_in_backward_is_not_reused_early(emulated_cuda):
    sm, model, ref = _trunk_and_branch()
    before = dict(emulated_cuda.backward_kernels)
    _sgd_steps(sm, model, ref, lambda: torch.randn(32, 64, device="cuda"))
    assert len(_side_kernels(emulated_cuda, before)) > 1
    assert emulated_cuda.take_reports() == []


def test_planted_missing_record_stream_is_an_unsafe_reuse_in_backward_only(emulated_cuda, monkeypatch):
    """streamsched ``record_stream``-s a value read on another stream than the one that
    made it. In a forward alone the end-of-call join makes that redundant; in training the
    branch's backward reads the saved value on the side stream, after the join, and frees
    it while the caller's stream goes on with work that does not wait for that branch."""
    sm, model, ref = _trunk_and_branch()
    monkeypatch.setattr(CudaBackend, "record_stream", lambda self, tensor, stream: None)
    with torch.no_grad():
        for _ in range(2):
            sm(torch.randn(32, 64, device="cuda"))
    assert emulated_cuda.take_reports() == [], "the forward alone is safe without it"
    _loss(sm(torch.randn(32, 64, device="cuda"))).backward()
    _loss(sm(torch.randn(32, 64, device="cuda"))).backward()
    reports = emulated_cuda.take_reports()
    assert reports and {r.kind for r in reports} == {"reuse"}
    assert all("may still be using it" in r.message for r in reports)


class InputOnBranch(nn.Module):
    """The module's input is read (and saved for backward) by a branch on a side stream."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(d, d), nn.Linear(d, d))
        self.scale = nn.Parameter(torch.rand(d) + 0.5)
        self.shift = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        h = x + self.shift
        return torch.relu(x * self.scale) + self.lin(h)


def test_an_input_a_side_stream_saves_for_backward_is_not_reused_early(emulated_cuda):
    """The module's inputs are no task's output: the tasks that read one on a side stream
    record_stream it there (runtime/program.py: cross_reads), since that stream's backward
    reads a saved input after the call, when the caller may have dropped it."""
    model = InputOnBranch().cuda()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, fuse=False)
    sm(torch.randn(32, 64, device="cuda")).sum().backward()
    for _ in range(2):
        sm(torch.randn(32, 64, device="cuda")).square().sum().backward()  # the input is dropped
    assert sm.plan.num_streams > 1
    assert emulated_cuda.take_reports() == []


class FusedBesideADeepBranch(nn.Module):
    """Two ensembles of small MLPs (one fused group) beside a deeper branch: the plan puts
    the fused group on a side stream, so its backward (and with ``grad_handoff="direct"``
    the native hand-off writing every member's ``.grad``) runs there."""

    def __init__(self):
        super().__init__()
        self.a = ParallelFCN(8, 16, 32, 4)
        self.b = ParallelFCN(8, 16, 32, 4)
        self.c = nn.Sequential(nn.Linear(128, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 32))

    def forward(self, x):
        return torch.cat([self.a(x), self.b(x), self.c(x)], 1)


@pytest.mark.skipif(native() is None, reason="the direct hand-off needs streamsched._C")
def test_direct_gradient_hand_off_on_a_side_stream_matches_the_loop(emulated_cuda):
    model = FusedBesideADeepBranch().cuda()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, grad_handoff="direct")
    _loss(sm(torch.randn(8, 128, device="cuda"))).backward()  # the first call runs as written
    model.zero_grad()
    before = dict(emulated_cuda.backward_kernels)
    _sgd_steps(sm, model, ref, lambda: torch.randn(8, 128, device="cuda"))
    assert {s.grad_handoff for s in sm._ss.fusion._stacks.values()} == {"direct"}
    fused = [t for t in sm._ss.last.program.tasks if any(n.startswith("fused") for n in t.node_names)]
    assert fused and all(t.stream != 0 for t in fused), "the fused group runs on a side stream"
    ran = _side_kernels(emulated_cuda, before)
    assert len(ran) > 1, f"backward kernels ran on {sorted(ran)}"
    assert emulated_cuda.reports == []
