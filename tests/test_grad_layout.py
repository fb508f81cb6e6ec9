"""The fused Linear's gradients come out in the layout eager's do, so that training a
fused group costs no per-member copy.

Every member's ``.grad`` must be the tensor autograd made (``AccumulateGrad`` keeps a dense
gradient that nothing else references, and copies one that breaks the layout contract):
for a stacked weight that is a slice of one ``[N, out, in]`` gradient, so the members'
``.grad`` of one fused group share one storage. The input's gradient has eager's strides.
Values are compared with the plain model on fresh random inputs, for each input layout
the Linear kernel specialises (wide, folded, stacked, 3-d members' inputs), with and
without bias, and through ``create_graph=True``.
"""

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, ParallelFCN
from streamsched.testing import assert_path

from .helpers import assert_close, flatten


class SequenceEnsemble(nn.Module):
    """MLPs over a ``[B, T, d]`` input (3-d members' inputs: the general Linear path)."""

    def __init__(self, n: int = 6, d: int = 12, hidden: int = 16, bias: bool = True):
        super().__init__()
        self.members = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d, hidden, bias=bias),
                nn.ReLU(),
                nn.Linear(hidden, hidden, bias=bias),
                nn.Tanh(),
                nn.Linear(hidden, 3, bias=bias),
            )
            for _ in range(n)
        )

    def forward(self, x):
        return torch.stack([m(x) for m in self.members])


CASES = {
    "critics": (lambda: CriticEnsemble(8, obs=10, hidden=24), (5, 10)),
    # narrow members over a larger batch (10 and 1 outputs, 32 rows): the CPU forward
    # runs as W @ xs^T (see StackedLinear)
    "parallel-fcn": (lambda: ParallelFCN(6), (32, 120)),
    "sequence": (lambda: SequenceEnsemble(), (4, 7, 12)),
    "sequence-no-bias": (lambda: SequenceEnsemble(bias=False), (4, 7, 12)),
}


def stacks(sm):
    return list(sm._ss.fusion._stacks.values())


def backward_nodes(out):
    seen, todo, names = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return names


def wrapped(case):
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = make()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(2):  # the first call runs the model as written
        sm(torch.randn(shape, requires_grad=True)).square().sum().backward()
    model.zero_grad(set_to_none=True)
    return sm, model, ref, shape


@pytest.mark.parametrize("case", sorted(CASES))
def test_member_grads_are_the_stacked_gradient_not_copies(case):
    sm, model, ref, shape = wrapped(case)
    for _ in range(2):  # a fresh .grad, then accumulation into it
        x = torch.randn(shape, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out = sm(x)
        assert_path(sm, "plan:serial")
        assert "StackedLinearBackward" in backward_nodes(out), "the fused Linear's own backward did not run"
        out.square().sum().backward()
        ref(xr).square().sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, name
            assert p.grad.stride() == p.stride() == q.grad.stride(), name
            assert_close(p.grad, q.grad, atol=1e-5, what=name)
        assert x.grad.stride() == xr.grad.stride()
        assert_close(x.grad, xr.grad, atol=1e-5, what="input")
    groups = stacks(sm)
    assert groups, "nothing was fused"
    for st in groups:
        storages = {t.grad.untyped_storage().data_ptr() for t in st.tensors}
        assert len(storages) == 1, f"{st.owners[0][1]}: {len(storages)} storages: the members' gradients were copied"


def test_frozen_weights_with_an_input_gradient_match_eager():
    sm, model, ref, shape = wrapped("critics")
    for p in list(model.parameters()) + list(ref.parameters()):
        p.requires_grad_(False)
    x = torch.randn(shape, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = sm(x)
    assert_path(sm, "plan:serial")
    assert "StackedLinearBackward" not in backward_nodes(out), "frozen weights: autograd's own baddbmm"
    out.square().sum().backward()
    ref(xr).square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert_close(x.grad, xr.grad, atol=1e-5, what="input")


def test_create_graph_differentiates_the_fused_backward_again():
    sm, model, ref, shape = wrapped("critics")
    x = torch.randn(shape, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    outs = []
    for m, xi in ((sm, x), (ref, xr)):
        (g,) = torch.autograd.grad(m(xi).square().sum(), xi, create_graph=True)
        g.square().sum().backward()
        outs.append(g)
    assert_path(sm, "plan:serial")
    assert_close(outs[0], outs[1], atol=1e-5, what="input gradient")
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, atol=1e-4, what=name)
    assert flatten(outs)


def test_torch_func_grad_through_frozen_fused_weights():
    """Frozen weights route no member gradient: the kernel keeps autograd's own ops, which
    torch.func transforms accept (a Python autograd Function without their hooks would
    be refused)."""
    sm, model, ref, shape = wrapped("critics")
    for p in list(model.parameters()) + list(ref.parameters()):
        p.requires_grad_(False)
    for _ in range(2):  # the frozen model's signature
        sm(torch.randn(shape, requires_grad=True)).sum().backward()
    x = torch.randn(shape)
    got = torch.func.grad(lambda t: sm(t).square().sum())(x)
    assert_path(sm, "plan:serial")
    expected = torch.func.grad(lambda t: ref(t).square().sum())(x)
    assert_close(got, expected, atol=1e-5, what="input gradient")


@pytest.mark.parametrize(
    "case, products",
    # ParallelFCN: both layers narrow (10, 1 outputs over 32 rows): the first as a plain
    # ``bmm`` in the stacked orientation with the bias added after it, the one-output one
    # weight-major into the output's memory. The critics' hidden layer is wide (24
    # outputs over 5 rows), their last one narrow (1 output) but over fewer than 32 rows:
    # ``baddbmm`` over the stack, as fast there.
    [("parallel-fcn", [("bmm", False), ("baddbmm", True)]), ("critics", [("baddbmm", False), ("baddbmm", False)])],
)
def test_narrow_layers_skip_baddbmms_broadcast_bias_on_the_cpu_with_eager_values_and_layout(
    case, products, monkeypatch
):
    sm, model, ref, shape = wrapped(case)
    ran = []
    baddbmm, bmm = torch.baddbmm, torch.bmm

    def weight_major(a):
        # the stacked weight [N, out, in] is the left operand
        return any(a is p or a.data_ptr() == p.data_ptr() and a.shape == p.shape for p in stacked_weights)

    def spy_baddbmm(bias, a, b, *args, **kwargs):
        ran.append(("baddbmm", weight_major(a)))
        return baddbmm(bias, a, b, *args, **kwargs)

    def spy_bmm(a, b, *args, **kwargs):
        ran.append(("bmm", weight_major(a)))
        return bmm(a, b, *args, **kwargs)

    stacked_weights = [st.stack for st in stacks(sm) if st.stack is not None and st.stack.dim() == 3]
    monkeypatch.setattr(torch, "baddbmm", spy_baddbmm)
    monkeypatch.setattr(torch, "bmm", spy_bmm)
    x = torch.randn(shape, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    out = sm(x)
    monkeypatch.undo()
    assert_path(sm, "plan:serial")
    assert ran == products
    expected = ref(xr)
    assert out.stride() == expected.stride()
    assert_close(out, expected, atol=1e-5, what="output")
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.stride() == q.grad.stride(), name
        assert_close(p.grad, q.grad, atol=1e-5, what=name)
    assert x.grad.stride() == xr.grad.stride()
    assert_close(x.grad, xr.grad, atol=1e-5, what="input")
