"""The asynchronous mode of the emulated CUDA device (``EmulatedCuda(asynchronous=True)``):
kernels queued per stream and run at synchronisation points in a random order the waits
allow, so a missing wait gives a wrong value, not only a race report.

Runs only where the device is emulated (no GPU): the `emulated_async` marker makes
tests/conftest.py enter the device in its asynchronous mode. Tests that plant a missing
wait turn ``raise_on_race`` off so that the kernels run and the value shows.
"""

import copy
import threading

import pytest
import torch
import torch.nn as nn

import streamsched as ss
from streamsched.emulated_cuda import CudaError
from streamsched.runtime.backends import CudaBackend
from streamsched.testing import assert_path

from .helpers import Towers, assert_close

pytestmark = [pytest.mark.cuda, pytest.mark.emulated_async]


@pytest.fixture
def reports_only(emulated_cuda, monkeypatch):
    """Races are recorded but do not raise: the kernels run, and a wrong value shows."""
    monkeypatch.setattr(emulated_cuda.emulator, "raise_on_race", False)
    return emulated_cuda


def _produce_and_consume(wait: bool):
    """``x.exp().sum()`` made on a side stream, read on the default stream (after a wait
    on the side stream, or not)."""
    x = torch.randn(1000, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x.exp().sum()
    if wait:
        torch.cuda.current_stream().wait_stream(side)
    z = y + 1
    return z.item(), x.cpu().exp().sum().item() + 1


def test_the_mode_is_on(emulated_cuda):
    assert emulated_cuda.asynchronous
    x = torch.ones(4, device="cuda")
    y = x * 2
    assert emulated_cuda.pending() == 2  # the fill and the multiplication, queued
    assert y.sum().item() == 8.0
    assert emulated_cuda.pending() == 0


def test_a_missing_wait_gives_a_wrong_value(reports_only):
    got, expected = _produce_and_consume(wait=False)
    assert got != pytest.approx(expected, rel=1e-4)  # the sum had not run: its memory held garbage
    assert [r.kind for r in reports_only.take_reports()] == ["race"]


def test_a_wait_gives_the_right_value(emulated_cuda):
    got, expected = _produce_and_consume(wait=True)
    assert got == pytest.approx(expected, rel=1e-4)
    assert emulated_cuda.take_reports() == []


@pytest.mark.parametrize("seed", range(4))
def test_work_on_two_streams_runs_in_a_random_order_the_waits_allow(emulated_cuda, seed):
    """Each stream keeps its order, and a consumer runs after the producer it waited on,
    whatever order the flush draws."""
    emulated_cuda.emulator.work.rng.seed(seed)
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    log = torch.zeros(8, device="cuda")
    ev = torch.cuda.Event()
    for s in (a, b):
        s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(a):
        for k in range(4):
            log[k] = log[k - 1] + 1 if k else 1  # a chain on one stream
        ev.record()
    with torch.cuda.stream(b):
        ev.wait()
        log[4:] = log[3] * 10
    torch.cuda.current_stream().wait_stream(b)
    torch.cuda.current_stream().wait_stream(a)
    assert log.tolist() == [1, 2, 3, 4, 40, 40, 40, 40]


def test_query_is_false_while_work_is_queued_and_true_after_synchronize(emulated_cuda):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    for sync in ("stream", "event"):
        with torch.cuda.stream(side):
            y = torch.randn(64, 64, device="cuda") @ torch.randn(64, 64, device="cuda")
            ev = torch.cuda.Event()
            ev.record()
        assert emulated_cuda.pending() > 0
        if sync == "stream":
            assert side.query() is False
            side.synchronize()
            assert side.query() is True
        else:
            assert ev.query() is False
            ev.synchronize()
            assert ev.query() is True
        assert emulated_cuda.pending() == 0
        # A query that said True orders the host after that work, as a synchronisation does.
        y.add_(1)
        torch.cuda.synchronize()
    assert emulated_cuda.take_reports() == []


def test_a_poll_loop_terminates(emulated_cuda):
    """A device that is polled makes progress: ``while not query()`` ends."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = torch.ones(16, device="cuda") * 3
    polls = 0
    while not s.query():
        polls += 1
        assert polls < 10
    assert polls >= 1
    torch.cuda.current_stream().wait_stream(s)
    assert y.sum().item() == 48.0


def test_a_pinned_non_blocking_copy_to_the_host_is_stale_until_synchronised(emulated_cuda):
    x = torch.randn(256, device="cuda")
    expected = x.cpu() * 3
    host = (x * 3).to("cpu", non_blocking=True)
    assert host.is_pinned()
    assert torch.isnan(host).all()  # read before the copy ran: uninitialised pinned memory
    torch.cuda.current_stream().synchronize()
    assert torch.equal(host, expected)
    # Into a pinned buffer: the buffer keeps its old contents until the copy runs.
    buf = torch.zeros(256).pin_memory()
    buf.copy_(x * 5, non_blocking=True)
    assert (buf == 0).all()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    assert torch.allclose(buf, expected / 3 * 5)


def test_a_non_blocking_copy_to_pageable_memory_completes_before_it_returns(emulated_cuda):
    x = torch.randn(64, device="cuda")
    buf = torch.zeros(64)
    buf.copy_(x * 2, non_blocking=True)  # CUDA stages it: done when copy_ returns
    assert torch.equal(buf, x.cpu() * 2)


def test_a_non_blocking_copy_from_pinned_memory_reads_it_when_it_runs(emulated_cuda):
    """Host memory written after a non-blocking copy was issued and before it ran: pinned
    memory is read by the copy when it runs (the new value, a bug on a GPU too); pageable
    memory is staged at the call (the old value)."""
    pinned = torch.full((32,), 1.0).pin_memory()
    pageable = torch.full((32,), 1.0)
    d_pinned = pinned.to("cuda", non_blocking=True)
    d_pageable = pageable.to("cuda", non_blocking=True)
    pinned.fill_(2.0)
    pageable.fill_(2.0)
    assert d_pinned.sum().item() == 64.0
    assert d_pageable.sum().item() == 32.0


def test_work_from_another_thread_joins_the_same_queues(reports_only):
    """A second thread issues kernels on a stream and records an event; the main thread
    waits on the event (right value) or does not (garbage)."""
    x = torch.randn(500, device="cuda")
    expected = (x.cpu() * 2).sum().item() + 1
    results = {}
    for wait in (True, False):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        done = torch.cuda.Event()
        box = {}

        def worker(side, done, box):
            with reports_only.attach(), torch.cuda.stream(side):
                box["y"] = (x * 2).sum()
                done.record()

        t = threading.Thread(target=worker, args=(side, done, box))
        t.start()
        t.join()
        assert reports_only.pending() > 0  # the worker's kernels are queued, not run
        if wait:
            torch.cuda.current_stream().wait_event(done)
        results[wait] = (box["y"] + 1).item()
        torch.cuda.synchronize()
    assert results[True] == pytest.approx(expected, rel=1e-4)
    assert results[False] != pytest.approx(expected, rel=1e-4)
    assert [r.kind for r in reports_only.take_reports()] == ["race"]


def test_random_kernels_draw_in_issue_order(emulated_cuda):
    """Random kernels draw from the host generator when issued, as in the default mode:
    the same seed gives the same numbers on the host and on the device, interleaved with
    draws on the host."""
    torch.manual_seed(3)
    on_host = torch.randn(16), torch.rand(8), torch.randn(4)
    torch.manual_seed(3)
    on_device = torch.randn(16, device="cuda"), torch.rand(8, device="cuda")
    between = torch.randn(4)  # drawn on the host after the device's draws were issued
    assert all(torch.equal(h, d.cpu()) for h, d in zip(on_host, on_device))
    assert torch.equal(between, on_host[2])
    assert {"aten.randn.default", "aten.rand.default"} <= set(emulated_cuda.emulator.work.immediate)


def test_a_kernel_failing_in_the_queue_is_reported_at_the_synchronisation(emulated_cuda):
    table = torch.randn(4, 8, device="cuda")
    idx = torch.tensor([0, 9], device="cuda")
    rows = table[idx]  # queued: the index is out of range, found when it runs
    with pytest.raises(CudaError, match="failed asynchronously"):
        torch.cuda.synchronize()
    del rows


def test_graph_replay_is_queued_on_the_replaying_stream(emulated_cuda):
    static_in = torch.randn(32, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static_out = static_in * 2 + 1  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        static_out = static_in * 2 + 1
    new = torch.randn(32, device="cuda")
    static_in.copy_(new)
    g.replay()
    assert emulated_cuda.pending() > 0
    assert torch.allclose(static_out.cpu(), new.cpu() * 2 + 1)


def test_deepcopy_sees_the_queued_work(emulated_cuda):
    import copy

    x = torch.ones(8, device="cuda")
    x.mul_(2)  # queued
    assert torch.equal(copy.deepcopy(x).cpu(), torch.full((8,), 2.0))
    model = nn.Linear(8, 8).cuda()
    with torch.no_grad():
        model.weight.mul_(2)  # queued
    clone = copy.deepcopy(model)
    assert torch.equal(clone.weight.cpu(), model.weight.cpu())


def test_backward_across_streams_matches_the_host(emulated_cuda):
    torch.manual_seed(0)
    host = Towers(3, 32)
    x = torch.randn(8, 32)
    model = Towers(3, 32)
    model.load_state_dict(host.state_dict())
    model = model.cuda()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=3, min_task_cost=0.0, fuse=False)
    xd = x.cuda()
    sm(xd)  # the first call plans
    sm(xd).square().sum().backward()
    assert_path(sm, "plan:streams")
    host(x).square().sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), host.named_parameters()):
        assert_close(p.grad, q.grad, atol=1e-4, what=name)
    assert emulated_cuda.take_reports() == []


# --- the streams executor --------------------------------------------------------------------


def _towers_on_streams():
    model = Towers(4, 64).cuda().eval()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0, fuse=False)
    with torch.no_grad():
        sm(torch.randn(16, 64, device="cuda"))  # the first call plans
    assert len({t.stream for t in sm.plan.tasks}) >= 3, sm.plan.summary()
    assert any(t.waits for t in sm.plan.tasks), "the plan's merges wait on other streams"
    return model, sm


def test_a_stream_plan_equals_eager_in_the_asynchronous_mode(emulated_cuda):
    model, sm = _towers_on_streams()
    for _ in range(3):
        x = torch.randn(16, 64, device="cuda")
        with torch.no_grad():
            out = sm(x)
            assert_path(sm, "plan:streams")
            assert_close(out, model(x), atol=1e-5)
    assert emulated_cuda.take_reports() == []


def test_a_planted_missing_wait_in_the_streams_executor_gives_a_wrong_value(reports_only, monkeypatch):
    model, sm = _towers_on_streams()
    real_wait = CudaBackend.wait
    skipped = []

    def wait_but_the_first(self, stream, event):
        if not skipped:
            skipped.append(event)  # the first wait of the call is not issued
            return
        real_wait(self, stream, event)

    monkeypatch.setattr(CudaBackend, "wait", wait_but_the_first)
    wrong = 0
    for _ in range(4):
        skipped.clear()
        x = torch.randn(16, 64, device="cuda")
        with torch.no_grad():
            out = sm(x)
            assert_path(sm, "plan:streams")
            expected = model(x)
        assert skipped
        wrong += not torch.allclose(out.cpu(), expected.cpu(), atol=1e-5)
    assert wrong >= 1, "a consumer that misses its wait runs before its producer in some order"
    assert {r.kind for r in reports_only.take_reports()} == {"race"}


# --- the runtime's CUDA tests, again in the asynchronous mode ---------------------------------
# Collected here, they run under this module's marks: a plan must still equal eager, and
# every protocol edge hold, when kernels run late and in a random order; memory the host
# frees while queued work still reads it is reported as in the default mode.

from .test_backward_streams import (  # noqa: E402, F401
    test_a_reentrant_backward_and_a_failing_backward_restore_the_callers_stream,
    test_an_input_a_side_stream_saves_for_backward_is_not_reused_early,
    test_backward_runs_on_the_forward_streams_and_equals_eager,
    test_direct_gradient_hand_off_on_a_side_stream_matches_the_loop,
    test_each_synchronisation_of_the_engine_is_needed,
    test_memory_a_side_stream_reads_in_backward_is_not_reused_early,
    test_planted_missing_record_stream_is_an_unsafe_reuse_in_backward_only,
    test_training_a_multi_stream_plan_runs_backward_on_its_streams,
)
from .test_cuda_protocol import (  # noqa: E402, F401
    runtime,
    test_a_branch_input_released_before_the_join_is_an_unsafe_reuse,
    test_a_planted_missing_eager_join_is_a_race,
    test_eager_dispatch_joins_a_branch_whose_result_is_unused,
    test_eager_dispatch_keeps_a_dropped_branch_input_until_the_join,
    test_eager_dispatch_outputs_are_recorded_on_a_caller_that_switches_streams,
    test_every_side_stream_is_joined_before_the_caller_reads,
    test_multi_stream_plans_overlap_where_the_plan_says,
    test_side_stream_outputs_are_recorded_on_the_caller_that_switches_streams,
    test_the_callers_stream_is_current_again_after_a_task_raises,
    test_values_read_on_other_streams_are_not_reused_early,
)
from .test_eager_dispatch import (  # noqa: E402, F401
    test_cuda_branch_exception_propagates_and_next_call_works,
    test_cuda_branches_run_on_pool_streams_beside_the_caller,
    test_cuda_forward_write_waits_for_the_branch,
    test_cuda_outputs_and_gradients_equal_eager,
    test_cuda_pending_values_behave_like_the_results,
)
from .test_emulated_cuda import (  # noqa: E402, F401
    test_freed_memory_another_stream_used_without_record_stream_is_reported,
    test_planted_missing_record_stream_is_an_unsafe_reuse,
    test_planted_prefetcher_defects,
    test_record_stream_or_a_wait_makes_the_reuse_safe,
    test_replay_reads_outside_memory_by_address_and_reports_it_freed,
)


@pytest.mark.parametrize(
    "options",
    [
        {"executor": "streams", "num_streams": 3, "min_task_cost": 0.0},
        {"executor": "serial", "cuda_graph": True},
    ],
    ids=["streams", "serial-graph"],
)
def test_alike_heads_reading_their_part_of_a_wide_kernel_on_streams(emulated_cuda, options):
    # The heads' activations read a narrow of the wide kernel's output, their values
    # dropped after their last use inside the generated functions: with kernels run out
    # of issue order, outputs and gradients as eager's and no race reported.
    from .test_fused_grads import MixedHeads

    torch.manual_seed(0)
    model = MixedHeads(other_first=True).cuda()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, **options)
    for _ in range(4):
        x = torch.randn(6, 8, device="cuda")
        out, expected = sm(x), reference(x)
        assert_close([o.cpu() for o in out], [e.cpu() for e in expected])
        loss = out[0].square().mean() + out[4].square().mean()
        loss_ref = expected[0].square().mean() + expected[4].square().mean()
        loss.backward()
        loss_ref.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if q.grad is not None:
                assert_close(p.grad.cpu(), q.grad.cpu(), what=name)
            p.grad = q.grad = None
    assert_path(sm, "plan")
    assert ("ReLU", 4) in [(g.kind, g.size) for g in sm.plan.fused_groups]
    assert emulated_cuda.take_reports() == []
