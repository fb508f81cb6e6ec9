"""Training through a scheduled forward: gradients, optimizer steps, autocast, grad modes,
accumulation and repeated backward equal eager PyTorch for every executor.

On CPU the "streams" executor runs a simulated stream backend that still makes (and
logs) every synchronisation decision; the CUDA tests at the end run real streams.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, NASNetCells, ParallelFCN

from .helpers import ConvTowers, Towers, assert_close

EXECUTORS = ["serial", "threads", "streams"]


@dataclass
class Case:
    """A branchy model, a batch of inputs for it, and a training loss."""

    make: Callable[[], nn.Module]
    inputs: Callable[[], torch.Tensor]
    classes: int = 0  # > 0: cross-entropy over this many classes, else mean squared error

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        out = out.float()
        if self.classes:
            return F.cross_entropy(out, target)
        return (out - target).square().mean()

    def target(self, out: torch.Tensor) -> torch.Tensor:
        if self.classes:
            return torch.randint(0, self.classes, (out.shape[0],))
        return torch.randn(out.shape, dtype=torch.float32, device=out.device)


CASES = {
    "towers": Case(lambda: Towers(4, 128), lambda: torch.randn(64, 128)),
    "conv_towers": Case(lambda: ConvTowers(), lambda: torch.randn(2, 8, 8, 8)),
    "nasnet": Case(lambda: NASNetCells(16, 2, num_classes=10), lambda: torch.randn(2, 3, 16, 16), classes=10),
    "ensemble": Case(lambda: CriticEnsemble(8), lambda: torch.randn(8, 23)),
    "pfcn": Case(lambda: ParallelFCN(64), lambda: torch.randn(128, 64 * 20)),
}


def wrap(model: nn.Module, executor: str, fuse: bool = True, **config) -> ss.StreamScheduledModule:
    # min_task_cost=0 gives every branch a stream of its own: the most cross-stream edges.
    return ss.StreamScheduledModule(model, executor=executor, fuse=fuse, num_streams=4, min_task_cost=0.0, **config)


def eager_and_wrapped(case: Case, executor: str, fuse: bool = True, **config):
    model = case.make()
    reference = copy.deepcopy(model)
    return reference, wrap(model, executor, fuse, **config)


def param_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same_grads(wrapped: nn.Module, reference: nn.Module, atol: float, what: str = "grad") -> None:
    g_w, g_e = param_grads(wrapped), param_grads(reference)
    assert g_w.keys() == g_e.keys()
    for name in g_e:
        assert_close(g_w[name], g_e[name], atol=atol, rtol=atol, what=f"{what} {name}")


def zero_grads(*models: nn.Module) -> None:
    for model in models:
        for p in model.parameters():
            p.grad = None


# --- gradients ------------------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_backward_of_the_scheduled_forward_equals_eager(name, executor, fuse):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor, fuse)
    # Call 0 records shapes and plans; calls 1 and 2 run the compiled schedule.
    for call in range(3):
        zero_grads(reference, sm)
        x = case.inputs()
        x_e, x_w = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, out_w = reference(x_e), sm(x_w)
        target = case.target(out_e)
        loss_e, loss_w = case.loss(out_e, target), case.loss(out_w, target)
        assert_close(loss_w, loss_e, atol=1e-5, rtol=1e-5, what=f"loss (call {call})")
        loss_e.backward()
        loss_w.backward()
        assert_same_grads(sm.module, reference, atol=1e-5, what=f"call {call}")
        assert_close(x_w.grad, x_e.grad, atol=1e-5, rtol=1e-5, what=f"input grad (call {call})")
    assert sm.plan.executor == executor
    if not fuse:
        assert sm.plan.fused_groups == []


# Every parameter here has a gradient well above rounding noise. ConvTowers fused is left
# out: its first conv's bias feeds a BatchNorm, so its true gradient is zero and both runs
# hold only rounding noise there, which Adam's normalisation blows up to +-lr per step.
TRACKING = [
    ("towers", True),
    ("nasnet", True),
    ("ensemble", True),
    ("pfcn", True),
    ("conv_towers", False),
]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name, fuse", TRACKING, ids=[f"{n}-{'fused' if f else 'unfused'}" for n, f in TRACKING])
def test_adamw_steps_with_the_wrapped_model_track_eager(name, fuse, executor):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor, fuse)
    initial = [p.detach().clone() for p in reference.parameters()]
    opt_e = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt_w = torch.optim.AdamW(sm.parameters(), lr=1e-3)
    for step in range(5):
        x = case.inputs()
        out_e = reference(x)
        target = case.target(out_e)
        loss_e, loss_w = case.loss(out_e, target), case.loss(sm(x), target)
        assert_close(loss_w, loss_e, atol=1e-4, rtol=1e-4, what=f"loss at step {step}")
        for opt, loss in ((opt_e, loss_e), (opt_w, loss_w)):
            opt.zero_grad()
            loss.backward()
            opt.step()
    moved = max(float((p.detach() - p0).abs().max()) for p, p0 in zip(reference.parameters(), initial))
    assert moved > 1e-3  # the steps did change the model
    for (n, p_e), p_w in zip(reference.named_parameters(), sm.module.parameters()):
        assert_close(p_w, p_e, atol=1e-5, rtol=1e-5, what=f"parameter {n} after 5 steps")
    for (n, b_e), b_w in zip(reference.named_buffers(), sm.module.buffers()):
        assert_close(b_w, b_e, atol=1e-5, rtol=1e-5, what=f"buffer {n} after 5 steps")


# --- mixed precision ------------------------------------------------------------------


def relative_error(grads: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> float:
    """||g - truth|| / ||truth|| over all parameters at once."""
    diff = torch.cat([(grads[n].double() - truth[n].double()).flatten() for n in truth])
    ref = torch.cat([truth[n].double().flatten() for n in truth])
    return float(diff.norm() / ref.norm())


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_cpu_autocast_bf16_outputs_and_grads_match_eager_under_autocast(name, executor, fuse):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor, fuse)
    full = copy.deepcopy(reference)  # float32, the yardstick for bf16 rounding noise
    for call in range(2):
        zero_grads(reference, sm, full)
        x = case.inputs()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out_e, out_w = reference(x), sm(x)
        assert out_w.dtype == out_e.dtype, "autocast must apply inside the scheduled forward"
        scale = float(out_e.detach().float().abs().max())
        assert_close(out_w.float(), out_e.float(), atol=2e-2 * scale, rtol=2e-2, what=f"bf16 output (call {call})")
        target = case.target(out_e)
        case.loss(out_e, target).backward()
        case.loss(out_w, target).backward()
        case.loss(full(x), target).backward()
    g_e, g_w, g_full = param_grads(reference), param_grads(sm.module), param_grads(full)
    noise = relative_error(g_e, g_full)  # how far bf16 eager is from float32
    assert relative_error(g_w, g_e) <= max(2.0 * noise, 1e-6), (
        f"wrapped bf16 grads differ from eager bf16 by {relative_error(g_w, g_e):.3g}, "
        f"more than twice bf16's own error {noise:.3g}"
    )
    assert relative_error(g_w, g_full) <= 2.0 * noise + 1e-6


# --- grad modes -----------------------------------------------------------------------


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["nasnet", "ensemble"])
def test_no_grad_and_inference_mode_then_back_to_training(name, executor):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor)
    x = case.inputs()
    sm(x)  # plan for grad mode first (inference mode first: the next test)
    reference(x)
    for _ in range(2):  # the second call of each mode runs its plan
        with torch.no_grad():
            out_w, out_e = sm(x), reference(x)
        assert not out_w.requires_grad and out_w.grad_fn is None
        assert_close(out_w, out_e, atol=1e-5, rtol=1e-5, what="no_grad output")
        with torch.inference_mode():
            out_w, out_e = sm(x), reference(x)
        assert out_w.is_inference() and not out_w.requires_grad
        assert_close(out_w, out_e, atol=1e-5, rtol=1e-5, what="inference_mode output")
    assert not any(p.is_inference() for p in sm.parameters())
    zero_grads(reference, sm)
    out_w, out_e = sm(x), reference(x)
    assert out_w.requires_grad and not out_w.is_inference()
    target = case.target(out_e)
    case.loss(out_w, target).backward()
    case.loss(out_e, target).backward()
    assert_same_grads(sm.module, reference, atol=1e-5)


@pytest.mark.parametrize("executor", EXECUTORS)
def test_first_call_under_inference_mode_leaves_the_model_trainable(executor):
    case = CASES["ensemble"]
    reference, sm = eager_and_wrapped(case, executor)
    x = case.inputs()
    with torch.inference_mode():
        sm(x)
        sm(x)
    assert not any(p.is_inference() for p in sm.module.parameters())
    out_w, out_e = sm(x), reference(x)
    target = case.target(out_e)
    case.loss(out_w, target).backward()
    case.loss(out_e, target).backward()
    assert_same_grads(sm.module, reference, atol=1e-5)


# --- several backward calls -------------------------------------------------------------


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["nasnet", "ensemble", "towers"])
def test_gradients_accumulate_over_two_backward_calls(name, executor, fuse):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor, fuse)
    warm = case.inputs()
    sm(warm)  # plan first, so that both accumulated calls run the schedule
    reference(warm)
    zero_grads(reference, sm)
    for micro_batch in range(2):
        x = case.inputs()
        out_e = reference(x)
        target = case.target(out_e)
        (case.loss(out_e, target) / 2).backward()
        (case.loss(sm(x), target) / 2).backward()
        if micro_batch == 0:
            first = {n: g.clone() for n, g in param_grads(sm.module).items()}
    assert_same_grads(sm.module, reference, atol=1e-5, what="accumulated grad")
    assert any(not torch.allclose(first[n], g) for n, g in param_grads(sm.module).items())


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["nasnet", "ensemble", "towers"])
def test_retain_graph_backward_twice_through_the_same_output(name, executor, fuse):
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor, fuse)
    x = case.inputs()
    sm(x)
    reference(x)
    zero_grads(reference, sm)
    out_e, out_w = reference(x), sm(x)
    target = case.target(out_e)
    loss_e, loss_w = case.loss(out_e, target), case.loss(out_w, target)
    loss_w.backward(retain_graph=True)
    once = {n: g.clone() for n, g in param_grads(sm.module).items()}
    loss_w.backward()
    loss_e.backward(retain_graph=True)
    loss_e.backward()
    assert_same_grads(sm.module, reference, atol=1e-5, what="grad after two backward calls")
    for name_, g in param_grads(sm.module).items():
        assert_close(g, 2 * once[name_], atol=1e-6, rtol=1e-5, what=f"twice the single grad {name_}")


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", ["ensemble", "pfcn", "towers"])
def test_gradient_penalty_differentiates_through_the_input_gradient(name, executor):
    # create_graph=True: the backward of the scheduled forward (fused kernels included)
    # is itself differentiated, as in WGAN-GP critics.
    case = CASES[name]
    reference, sm = eager_and_wrapped(case, executor)
    sm(case.inputs())
    reference(case.inputs())
    zero_grads(reference, sm)
    x = case.inputs()
    penalties = []
    for model in (sm, reference):
        xi = x.clone().requires_grad_()
        out = model(xi)
        (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
        penalty = (g.flatten(1).norm(dim=1) - 1).square().mean()
        (out.float().mean() + penalty).backward()
        penalties.append(penalty.detach())
    assert_close(penalties[0], penalties[1], atol=1e-5, rtol=1e-5, what="penalty")
    assert_same_grads(sm.module, reference, atol=1e-5, what="grad with penalty")


# --- CUDA -----------------------------------------------------------------------------


@pytest.fixture
def exact_float32():
    """No TF32: a fused convolution and N separate ones must agree to float32 rounding."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def cuda_pair(case: Case, **config):
    model = case.make().cuda()
    reference = copy.deepcopy(model)
    return reference, wrap(model, "streams", **config)


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_streams_backward_equals_eager(name, fuse, exact_float32):
    case = CASES[name]
    reference, sm = cuda_pair(case, fuse=fuse)
    for call in range(3):
        zero_grads(reference, sm)
        x = case.inputs().cuda()
        out_e, out_w = reference(x), sm(x)
        target = case.target(out_e).cuda()
        case.loss(out_e, target).backward()
        case.loss(out_w, target).backward()
        assert_same_grads(sm.module, reference, atol=1e-4, what=f"call {call}")
    assert sm.plan.executor == "streams"
    if not fuse:
        assert sm.plan.num_streams > 1


def assert_grads_ready_on_a_caller_stream(case: Case, reference, sm) -> None:
    """Train on a caller stream of our own and read every .grad there right after
    backward(): work of other streams not joined to it would show as wrong values."""
    caller = torch.cuda.Stream()
    caller.wait_stream(torch.cuda.current_stream())  # the models were copied on the default stream
    with torch.cuda.stream(caller):
        for call in range(4):
            zero_grads(reference, sm)
            x = case.inputs().cuda()
            out_e = reference(x)
            target = case.target(out_e).cuda()
            case.loss(out_e, target).backward()
            case.loss(sm(x), target).backward()
            # Read on the caller's stream (the copy to host orders after its work only).
            g_w = {n: g.to("cpu") for n, g in param_grads(sm.module).items()}
            g_e = {n: g.to("cpu") for n, g in param_grads(reference).items()}
            assert g_w.keys() == g_e.keys()
            for n in g_e:
                assert_close(g_w[n], g_e[n], atol=1e-4, rtol=1e-4, what=f"grad {n} on the caller stream (call {call})")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["nasnet", "conv_towers", "ensemble"])
def test_cuda_grads_are_ready_on_the_caller_stream_after_backward(name, exact_float32):
    # Spin kernels (chaos) delay the side streams at random: if the backward of work issued
    # on a side stream were not joined to the caller's stream, reading .grad right after
    # backward() on the caller's stream would see unfinished values.
    case = CASES[name]
    reference, sm = cuda_pair(case, fuse=False, chaos=1)
    assert_grads_ready_on_a_caller_stream(case, reference, sm)
    assert sm.plan.num_streams > 1


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["ensemble", "pfcn"])
def test_cuda_direct_grad_handoff_is_ready_on_the_caller_stream(name, exact_float32):
    # The direct hand-off writes .grad from its own node's stream; the canary's edge must
    # make the engine join that stream to the caller's before backward() returns.
    case = CASES[name]
    reference, sm = cuda_pair(case, fuse=True, grad_handoff="direct", chaos=1)
    assert_grads_ready_on_a_caller_stream(case, reference, sm)
    assert sm.plan.fused_groups
    assert {s.grad_handoff for s in sm._ss.fusion._stacks.values()} == {"direct"}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("name", ["nasnet", "ensemble", "towers", "pfcn"])
def test_cuda_autocast_outputs_and_grads_match_eager_under_autocast(name, fuse, dtype, exact_float32):
    case = CASES[name]
    reference, sm = cuda_pair(case, fuse=fuse)
    full = copy.deepcopy(reference)
    for _ in range(2):
        zero_grads(reference, sm, full)
        x = case.inputs().cuda()
        with torch.autocast("cuda", dtype=dtype):
            out_e, out_w = reference(x), sm(x)
        assert out_w.dtype == out_e.dtype == dtype
        scale = float(out_e.detach().float().abs().max())
        assert_close(out_w.float(), out_e.float(), atol=2e-2 * scale, rtol=2e-2, what="autocast output")
        target = case.target(out_e).cuda()
        case.loss(out_e, target).backward()
        case.loss(out_w, target).backward()
        case.loss(full(x), target).backward()
    g_e, g_w, g_full = param_grads(reference), param_grads(sm.module), param_grads(full)
    noise = relative_error(g_e, g_full)
    assert relative_error(g_w, g_e) <= max(2.0 * noise, 1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_case_runs_branches_on_several_lanes(name):
    # The cases above only mean something if the planner finds independent branches.
    case = CASES[name]
    sm = wrap(case.make(), "threads", fuse=False)
    sm(case.inputs())
    assert sm.plan.num_streams > 1
