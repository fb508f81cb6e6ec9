"""What the caller does with the outputs after the call, compared with eager PyTorch on
fresh inputs: outputs of fused branches returned directly (one batched kernel's members,
one wide matmul's columns, a view of one) written in place before the backward, as eager
allows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close, grads

D = 8


class BatchedHeads(nn.Module):
    """Two heads on two inputs: one batched kernel (an unbind of its result)."""

    def __init__(self):
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Linear(D, D)

    def forward(self, x, y):
        return self.left(x), self.right(y)


class WideHeads(nn.Module):
    """Heads of different widths on one input: one wide matmul (a split of its result),
    one of them returned through a view."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 3)
        self.b = nn.Linear(D, 5)

    def forward(self, x, y):
        return {"a": self.a(x), "b": self.b(x).view(-1)}


def _write_and_loss(out) -> torch.Tensor:
    first, second = out if isinstance(out, tuple) else (out["a"], out["b"])
    first.mul_(2)
    second.add_(1)
    return (first.sum() * 3 + (second * second).sum()).float()


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("make", [BatchedHeads, WideHeads], ids=["batched", "wide"])
def test_fused_outputs_may_be_written_in_place_by_the_caller(make, executor):
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for call in range(4):
        x, y = torch.randn(4, D), torch.randn(4, D)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = sm(x, y)
        path = assert_path(sm, "recorded", "plan")
        expected = ref(x, y)
        loss, loss_ref = _write_and_loss(out), _write_and_loss(expected)
        loss.backward()
        loss_ref.backward()
        assert_close(out, expected, what=f"call {call} ({path}): outputs")
        assert_close(list(grads(model).values()), list(grads(ref).values()), what=f"call {call} ({path}): grads")
        if call > 0:
            assert sm.plan.fused_groups, "the heads were meant to be fused"


class ViewsWideHeads(nn.Module):
    """Heads that one wide kernel computes (a Linear pair, a Conv2d pair), their values
    viewed inside the forward and returned for the caller to view."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, 3)
        self.b = nn.Linear(D, 5)
        self.c = nn.Conv2d(3, 4, 1)
        self.d = nn.Conv2d(3, 6, 1)

        self.view_conv = True  # eager cannot view a channels_last result so

    def forward(self, x, img):
        c = self.c(img)
        c = c.view(img.shape[0], -1) if self.view_conv else c.flatten(1)
        return self.a(x).view(-1), self.b(x), c, self.d(img)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
def test_parts_of_a_wide_kernel_have_eagers_strides(grad, channels_last):
    torch.manual_seed(0)
    model = ViewsWideHeads()
    model.view_conv = not channels_last
    sm = ss.StreamScheduledModule(model, executor="serial")
    for call in range(3):
        x, img = torch.randn(4, D), torch.randn(2, 3, 5, 5)
        if channels_last:
            img = img.contiguous(memory_format=torch.channels_last)
        with torch.set_grad_enabled(grad):
            out = sm(x, img)
            expected = model(x, img)
        path = assert_path(sm, "recorded", "plan")
        assert_close(out, expected, what=f"call {call} ({path})")
        assert [t.stride() for t in out] == [t.stride() for t in expected], f"call {call} ({path}): strides"
        out[1].view(-1)  # the caller's view of a returned part works as on eager's value
        if call > 0:
            assert len(sm.plan.fused_groups) == 2, "the heads were meant to be fused"


class TanhEnsemble(nn.Module):
    """Members ending in ``Tanh`` (whose backward reads its own output), stacked: the
    stack is the batched kernel's output (the second layer's, a ``baddbmm``), or a view
    of it for inputs with more than one batch dimension."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh()) for _ in range(n)
        )

    def forward(self, x):
        return torch.stack([m(x) for m in self.members])


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("batch", [(5,), (2, 3)], ids=["rows", "sequence"])
def test_a_stack_of_members_may_be_written_in_place_by_the_caller(batch, executor):
    """Eager's ``torch.stack`` is a fresh tensor; the caller may write it before the
    backward. The fused kernel's output (or a view of it) in its place is the tensor the
    members' ``Tanh`` saved for the backward: written, the backward failed."""
    torch.manual_seed(0)
    model, ref = TanhEnsemble(), TanhEnsemble()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(4):
        x = torch.randn(*batch, D)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        out = sm(x)
        path = assert_path(sm, "recorded", "plan")
        expected = ref(x)
        assert out._is_view() == expected._is_view(), f"call {call} ({path}): a view where eager's is not"
        out.mul_(2).sum().backward()
        expected.mul_(2).sum().backward()
        assert_close(out, expected, what=f"call {call} ({path}): outputs")
        assert_close(list(grads(model).values()), list(grads(ref).values()), what=f"call {call} ({path}): grads")
        if call > 0:
            assert any(g.kernel.startswith("baddbmm") for g in sm.plan.fused_groups), (
                "the members were meant to be batched"
            )


class MembersReturned(TanhEnsemble):
    """Members returned one by one, and a stack of all of them."""

    def forward(self, x):
        ys = [m(x) for m in self.members]
        return ys[0], ys[1], torch.stack([m(x.flip(0)) for m in self.members])


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("batch", [(5,), (2, 3)], ids=["rows", "sequence"])
def test_outputs_of_a_no_grad_call_may_be_written_with_grad_later(batch, executor):
    """Outputs of a call under ``torch.no_grad()`` (a teacher's targets) written in place
    afterwards with gradients on: eager's are tensors of their own; the plan's were views
    of the batched kernel's output made under no_grad, which autograd refuses to write
    ("A view was created in no_grad mode")."""
    torch.manual_seed(1)
    model, ref = MembersReturned(), MembersReturned()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(4):
        x = torch.randn(*batch, D)
        scale, scale_ref = torch.ones(16, requires_grad=True), torch.ones(16, requires_grad=True)
        with torch.no_grad():
            outs = sm(x)
            path = assert_path(sm, "recorded", "plan")
            expected = ref(x)
        assert [t._is_view() for t in outs] == [t._is_view() for t in expected], f"call {call} ({path}): views"
        sum(t.mul_(scale).sum() for t in outs).backward()
        sum(t.mul_(scale_ref).sum() for t in expected).backward()
        assert_close(outs, expected, what=f"call {call} ({path}): outputs")
        assert_close(scale.grad, scale_ref.grad, what=f"call {call} ({path}): grad")
        if call > 0:
            assert any(g.kernel.startswith("baddbmm") for g in sm.plan.fused_groups), (
                "the members were meant to be batched"
            )


def _resize_in_place(t: torch.Tensor) -> None:
    t.resize_(2 * t.numel()).fill_(7.0)


def _out_that_resizes(t: torch.Tensor) -> None:
    torch.ones(2 * t.numel(), out=t)


def _storage_freed(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize(
    "change", [_resize_in_place, _out_that_resizes, _storage_freed], ids=["resize_", "out=", "storage freed"]
)
def test_members_returned_without_grad_have_storage_of_their_own(change, executor):
    """Members a ``no_grad`` call returns one by one are separate tensors in eager, each
    in storage of its own. The plan's were slices of the batched kernel's one output,
    each a tensor of its own over that shared storage: resizing one (``resize_``, an
    ``out=`` of another size) made it overlap the next member and its writes changed that
    member's value; freeing one's storage freed all of them."""
    torch.manual_seed(2)
    model, ref = MembersReturned(), MembersReturned()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(4):
        x = torch.randn(5, D)
        with torch.no_grad():
            outs = sm(x)
            path = assert_path(sm, "recorded", "plan")
            expected = ref(x)
        storages = {t.untyped_storage().data_ptr() for t in outs}
        assert len(storages) == len(outs), f"call {call} ({path}): outputs share storage"
        change(outs[0])
        change(expected[0])
        assert_close(outs[1:], expected[1:], what=f"call {call} ({path}): the other outputs")
        if call > 0:
            assert any(g.kernel.startswith("baddbmm") for g in sm.plan.fused_groups), (
                "the members were meant to be batched"
            )
