"""The fused kernels' specialised functions, as a compiled plan calls them: kept weight
and bias views that follow every re-stack and in-place update, ReLU written in place
only on a kernel's own result that nothing else reads, activation modules called
through their functional, and the layout gathers at the end of a plan."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, ParallelFCN
from streamsched.passes.fusion.kernels import ElementwiseKernel, FusedKernel, LinearKernel

from .helpers import assert_close


class _Ops(TorchDispatchMode):
    """Records the ATen ops a call runs."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _kernels(sm: ss.StreamScheduledModule) -> list[FusedKernel]:
    return [n.target for n in sm._ss.last.graph.nodes if isinstance(n.target, FusedKernel)]


def _train_step(sm: ss.StreamScheduledModule, ref: nn.Module, x: torch.Tensor) -> None:
    """One forward and backward of both; outputs and every gradient equal."""
    for m in (sm.module, ref):
        m.zero_grad(set_to_none=True)
    out, expected = sm(x), ref(x)
    assert_close(out, expected)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for (name, p), q in zip(sm.module.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, what=f"grad {name}")


def test_relu_after_a_fused_linear_runs_in_place_with_the_same_outputs_and_gradients():
    """The critics' ReLUs read a fused Linear's own result and nothing else does: the
    plan writes it in place (as ``nn.ReLU(inplace=True)`` would); values and gradients
    are eager's."""
    torch.manual_seed(0)
    model = CriticEnsemble(6, obs=7, hidden=5)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        _train_step(sm, ref, torch.randn(4, 7))
    ss.testing.assert_path(sm, "plan:serial")
    assert sum(isinstance(k, ElementwiseKernel) for k in _kernels(sm)) == 2
    with _Ops() as ops:
        out = sm(x := torch.randn(4, 7))
    ss.testing.assert_path(sm, "plan:serial")
    assert ops.ops.count("aten.relu_.default") == 2 and "aten.relu.default" not in ops.ops, ops.ops
    assert_close(out, ref(x))


def test_relu_after_a_stacked_linear_runs_in_place_with_autograd_too():
    """MLPs reading slices of one input (stacked layouts): with autograd on, the fused
    ReLU writes the first Linear's own result in place too; gradients are eager's."""
    torch.manual_seed(0)
    model = ParallelFCN(6, d_in=4, hidden=5)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        _train_step(sm, ref, torch.randn(3, 24))
    with _Ops() as ops:
        out = sm(x := torch.randn(3, 24))
    ss.testing.assert_path(sm, "plan:serial")
    assert ops.ops.count("aten.relu_.default") == 1 and "aten.relu.default" not in ops.ops, ops.ops
    assert_close(out, ref(x))


class _ReadTwice(nn.Module):
    """A member whose pre-activation has a second reader besides its ReLU."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(7, 5)
        self.act = nn.ReLU()

    def forward(self, x):
        h = self.lin(x)
        return self.act(h) - h


class _ReadTwiceGroup(nn.Module):
    def __init__(self, n: int = 5):
        super().__init__()
        self.members = nn.ModuleList(_ReadTwice() for _ in range(n))

    def forward(self, x):
        return torch.stack([m(x) for m in self.members])


def test_relu_whose_input_is_read_elsewhere_is_not_written_in_place():
    """``relu(h) - h``: the Linear's result has another reader, so the fused ReLU must
    leave it alone (in place, the difference would be zero everywhere)."""
    torch.manual_seed(0)
    model = _ReadTwiceGroup()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        _train_step(sm, ref, torch.randn(3, 7))
    ss.testing.assert_path(sm, "plan:serial")
    kinds = {type(k) for k in _kernels(sm)}
    assert ElementwiseKernel in kinds and LinearKernel in kinds, "the ReLUs and Linears are fused"
    x = torch.randn(3, 7)
    with torch.no_grad():
        sm(x)  # a new signature (grad mode off): recorded, then planned
        with _Ops() as ops:
            out = sm(x)
    ss.testing.assert_path(sm, "plan:serial")
    assert "aten.relu.default" in ops.ops and "aten.relu_.default" not in ops.ops, ops.ops
    assert_close(out, ref(x))
    assert bool((out != 0).any())


@pytest.mark.parametrize(
    "rows, kernel_names",
    [
        (4, ["wide linear", "baddbmm", "baddbmm"]),
        # From 16 rows the CPU runs the chain transposed (layout.TRANSPOSED).
        (16, ["wide linear (transposed)", "baddbmm (transposed)", "baddbmm (transposed)"]),
    ],
)
def test_kept_views_follow_in_place_updates_and_re_stacks_of_weight_or_bias_alone(rows, kernel_names):
    """Under no_grad the Linear kernels read weight and bias views kept between calls.
    An optimizer-like in-place update shows through them; giving one member's weight or
    bias new storage re-stacks that tensor alone, and the kernel takes new views of it."""
    torch.manual_seed(0)
    model = CriticEnsemble(6, obs=7, hidden=5).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(rows, 7)
    with torch.no_grad():
        for _ in range(3):
            sm(x)
        ss.testing.assert_path(sm, "plan:serial")
        kernels = [k for k in _kernels(sm) if isinstance(k, LinearKernel)]
        assert [k.kernel for k in kernels] == kernel_names
        for layer in (0, 2, 4):
            model.critics[3].net[layer].weight.add_(0.5)  # in place: the same stacks
            assert_close(sm(x), model(x), what=f"in-place update of layer {layer}")
            bias = model.critics[2].net[layer].bias
            bias.data = bias.data + 1.0  # new storage: the bias alone is re-stacked
            assert_close(sm(x), model(x), what=f"re-stacked bias of layer {layer}")
            weight = model.critics[4].net[layer].weight
            weight.data = weight.data * 2.0
            assert_close(sm(x), model(x), what=f"re-stacked weight of layer {layer}")
        ss.testing.assert_path(sm, "plan:serial")


class _Acts(nn.Module):
    def __init__(self, act: type, n: int = 4):
        super().__init__()
        self.lins = nn.ModuleList(nn.Linear(6, 6) for _ in range(n))
        self.acts = nn.ModuleList(act() for _ in range(n))

    def forward(self, x):
        return torch.cat([a(lin(x)) for lin, a in zip(self.lins, self.acts)], 1)


def test_activation_modules_run_as_their_functional():
    """GELU (both approximations), Tanh and Sigmoid kernels call the functional their
    forward calls, with the module's options: outputs and gradients are eager's."""
    torch.manual_seed(0)
    for act in (nn.GELU, lambda: nn.GELU(approximate="tanh"), nn.Tanh, nn.Sigmoid):
        model = _Acts(act)
        ref = copy.deepcopy(model)
        sm = ss.StreamScheduledModule(model, executor="serial")
        for _ in range(3):
            _train_step(sm, ref, torch.randn(3, 6))
        ss.testing.assert_path(sm, "plan:serial")
        assert any(isinstance(k, ElementwiseKernel) for k in _kernels(sm)), act
        with torch.no_grad():
            x = torch.randn(3, 6)
            assert_close(sm(x), ref(x), atol=0, rtol=0)


def test_the_stacked_output_is_the_last_kernels_own_result():
    """``torch.stack`` of the members' outputs, as the last kernel's own result: no copy
    and no view of it (as eager's stack, a tensor without a base)."""
    torch.manual_seed(0)
    model = CriticEnsemble(6, obs=7, hidden=5)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_step(sm, ref, torch.randn(4, 7))
    _train_step(sm, ref, torch.randn(4, 7))
    out = sm(torch.randn(4, 7))
    ss.testing.assert_path(sm, "plan:serial")
    assert out._base is None and out.is_contiguous() and out.grad_fn is not None


class _ConvTowers(nn.Module):
    """Small conv towers reading one image: a wide conv, a ReLU (in place on the conv's
    own result), then a grouped conv (reflect padding) on each tower's own channels."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.first = nn.ModuleList(nn.Conv2d(3, 4, 3, padding=1) for _ in range(n))
        self.acts = nn.ModuleList(nn.ReLU() for _ in range(n))
        self.second = nn.ModuleList(nn.Conv2d(4, 2, 3, padding=1, padding_mode="reflect") for _ in range(n))

    def forward(self, x):
        return torch.cat([b(r(a(x))) for a, r, b in zip(self.first, self.acts, self.second)], 1)


def test_conv_kernels_keep_their_reshaped_weights_and_follow_re_stacks():
    torch.manual_seed(0)
    model = _ConvTowers()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        _train_step(sm, ref, torch.randn(2, 3, 6, 6))
    ss.testing.assert_path(sm, "plan:serial")
    kinds = sorted(k.kernel for k in _kernels(sm))
    assert kinds == ["ReLU once", "grouped conv2d", "wide conv2d"], kinds
    x = torch.randn(2, 3, 6, 6)
    with torch.no_grad():
        sm(x)
        for layer in ("first", "second"):
            convs = getattr(model, layer)
            convs[1].weight.mul_(0.5)
            assert_close(sm(x), model(x), what=f"in-place update of {layer}")
            convs[2].bias.data = convs[2].bias.data - 1.0
            assert_close(sm(x), model(x), what=f"re-stacked bias of {layer}")
            convs[3].weight.data = convs[3].weight.data * 3.0
            assert_close(sm(x), model(x), what=f"re-stacked weight of {layer}")
        ss.testing.assert_path(sm, "plan:serial")


def test_folded_input_is_viewed_in_one_op_where_contiguous_and_reshaped_where_not():
    """A Linear kernel reading a folded input ``[B, N*in]`` takes it as ``[N, B, in]`` with
    one ``as_strided`` of its canonical strides when it is contiguous (at any storage
    offset), and with reshape + movedim when it is not: the same values either way."""
    from streamsched.passes.fusion.layout import fold
    from streamsched.passes.fusion.params import StackedTensors

    torch.manual_seed(0)
    n, b, fin, fout = 4, 3, 5, 6
    lins = [nn.Linear(fin, fout) for _ in range(n)]
    owners = [(lin, "weight") for lin in lins]
    kernel = LinearKernel(
        lins,
        [f"l{i}" for i in range(n)],
        StackedTensors(owners),
        StackedTensors([(lin, "bias") for lin in lins]),
        fold(1),
        (b, fin),
        (b, fout),
    )
    fn = kernel.specialise()
    big = torch.randn(b + 1, n * fin)
    inputs = {
        "contiguous": torch.randn(b, n * fin),
        "at an offset": big[1:],  # contiguous, storage_offset n*fin
        "transposed": torch.randn(n * fin, b).t(),  # not contiguous
        "strided rows": torch.randn(b, 2 * n * fin)[:, ::2],
    }
    with torch.no_grad():
        for what, x in inputs.items():
            expected = torch.stack([lin(x[:, i * fin : (i + 1) * fin]) for i, lin in enumerate(lins)])
            assert_close(fn(x), expected, what=what)


def test_folded_input_of_another_shape_is_refused_not_misread():
    """The one-op view is for the shape the kernel was planned at: an input of another
    batch size goes through reshape, which refuses it, where as_strided would read the
    wrong elements (or past the end of the storage)."""
    from streamsched.passes.fusion.layout import fold
    from streamsched.passes.fusion.params import StackedTensors

    n, b, fin, fout = 3, 4, 2, 5
    lins = [nn.Linear(fin, fout) for _ in range(n)]
    kernel = LinearKernel(
        lins,
        [f"l{i}" for i in range(n)],
        StackedTensors([(lin, "weight") for lin in lins]),
        StackedTensors([(lin, "bias") for lin in lins]),
        fold(1),
        (b, fin),
        (b, fout),
    )
    fn = kernel.specialise()
    with torch.no_grad(), pytest.raises(RuntimeError):
        fn(torch.randn(b + 1, n * fin))
