"""Fused Linear chains held transposed on the CPU (``layout.TRANSPOSED``: each member's
``[rows, features]`` value stored ``[N, features, rows]``, so the batched matmuls read
no transposed operand), in plans that run without autograd. Which kernels choose it,
and that everything around them is eager's: outputs, the strides of what the caller and
the model's own code get, in-place writes by the caller, weights updated between calls;
plans with autograd on keep the stacked layouts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion.kernels import LinearKernel, _stacked_linear
from streamsched.passes.fusion.layout import TRANSPOSED, eager_strides, member_copy, unstack

from .helpers import assert_close
from .test_fused_fast_path import _Ops

ROWS = 16  # builders.TRANSPOSED_MIN_ROWS: fewer rows keep the stacked layouts


class Tower(nn.Module):
    def __init__(self, fin: int, hidden: int, fout: int, bias: bool = True):
        super().__init__()
        self.l1 = nn.Linear(fin, hidden, bias=bias)
        self.a1 = nn.ReLU()
        self.l2 = nn.Linear(hidden, hidden, bias=bias)
        self.a2 = nn.Tanh()
        self.l3 = nn.Linear(hidden, fout, bias=bias)

    def forward(self, x):
        return self.l3(self.a2(self.l2(self.a1(self.l1(x)))))


class Ensemble(nn.Module):
    """``n`` towers reading one input; ``out``: how the caller gets their outputs."""

    def __init__(self, n: int = 5, fin: int = 7, hidden: int = 6, fout: int = 1, out: str = "stack", bias=True):
        super().__init__()
        self.towers = nn.ModuleList(Tower(fin, hidden, fout, bias) for _ in range(n))
        self.out = out

    def forward(self, x):
        outs = [t(x) for t in self.towers]
        if self.out == "stack":
            return torch.stack(outs)
        if self.out == "list":
            return outs
        if self.out == "sigmoid":  # an activation after the last layer, fused too
            return torch.stack([torch.sigmoid(o) for o in outs])
        if self.out == "viewed":  # the model's own code views each output, as eager's allows
            return torch.cat([(o * 2).view(-1) for o in outs])
        raise AssertionError(self.out)


def _linears(sm: ss.StreamScheduledModule) -> list[LinearKernel]:
    return [n.target for n in sm._ss.last.graph.nodes if isinstance(n.target, LinearKernel)]


def _same(out, expected, what: str) -> None:
    if isinstance(expected, torch.Tensor):
        out, expected = [out], [expected]
    for i, (o, e) in enumerate(zip(out, expected)):
        assert_close(o, e, what=f"{what} [{i}]")
        # The caller's value has eager's strides: a view of it works where eager's does.
        assert o.is_contiguous() and o.stride() == e.stride(), (what, i, o.stride(), e.stride())


def _train_calls(sm, ref, calls: int = 4, rows: int = 16, fin: int = 7) -> None:
    """Calls with gradients: outputs, the input's and every parameter's gradient eager's."""
    for call in range(calls):
        for m in (sm.module, ref):
            m.zero_grad(set_to_none=True)
        x = torch.randn(rows, fin, requires_grad=True)
        xr = x.detach().clone().requires_grad_()
        out, expected = sm(x), ref(xr)
        _same(out, expected, f"call {call}")
        flat = torch.cat([o.reshape(-1) for o in (out if isinstance(out, list) else [out])])
        flat_ref = torch.cat([o.reshape(-1) for o in (expected if isinstance(expected, list) else [expected])])
        weights = torch.linspace(-1, 1, flat.numel())  # every output's gradient its own
        (flat.pow(2) * weights).sum().backward()
        (flat_ref.pow(2) * weights).sum().backward()
        assert_close(x.grad, xr.grad, what=f"call {call}: input grad")
        for (name, p), q in zip(sm.module.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"call {call}: grad {name}")


def _no_grad_calls(sm, ref, shape: tuple, calls: int = 3) -> None:
    """Calls without autograd, each on a fresh input: eager's values and strides, and
    every call after the recording one runs the plan."""
    with torch.no_grad():
        for call in range(calls):
            x = torch.randn(shape)
            _same(sm(x), ref(x), f"no_grad call {call}")
            ss.testing.assert_path(sm, "recorded" if call == 0 else "plan:serial")


@pytest.mark.parametrize("fout", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_a_chain_from_a_shared_input_runs_transposed_with_eager_results(fout, bias):
    """Shared input -> Linear -> ReLU -> Linear -> Tanh -> Linear, stacked: every Linear
    reads and writes the transposed layout (the last one writes a stack for the
    ``torch.stack`` of several features; of one, the transposed layout is the stack's
    memory); the values are eager's."""
    torch.manual_seed(0)
    model = Ensemble(fout=fout, bias=bias)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS, 7))
    kernels = _linears(sm)
    last = TRANSPOSED if fout == 1 else ("stack", 0)
    assert [k.out_layout for k in kernels] == [TRANSPOSED, TRANSPOSED, last], [k.kernel for k in kernels]
    assert kernels[2].in_layout == TRANSPOSED
    assert [k.kernel for k in kernels] == ["wide linear (transposed)", "baddbmm (transposed)", "baddbmm (transposed)"]


def test_plans_with_autograd_keep_the_stacked_layouts():
    """With autograd on the kernels compute stacked and a transposed layout would only add
    views: the training plan of the same chain keeps the stacked layouts; values and
    gradients eager's; the plan without autograd, made after it, is transposed."""
    torch.manual_seed(0)
    model = Ensemble(fout=1)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_calls(sm, ref)
    ss.testing.assert_path(sm, "plan:serial")
    kernels = _linears(sm)
    assert kernels and all(TRANSPOSED not in (k.in_layout, k.out_layout) for k in kernels)
    _no_grad_calls(sm, ref, (ROWS, 7))
    assert all(k.out_layout == TRANSPOSED for k in _linears(sm))


def test_an_activation_after_the_last_layer_keeps_the_layout_to_the_stack():
    """``stack(sigmoid(tower(x)))``: the fused sigmoid runs on the transposed one-feature
    output, and the stack is a view of its result; eager's values."""
    torch.manual_seed(0)
    model = Ensemble(fout=1, out="sigmoid")
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS, 7))
    assert [k.out_layout for k in _linears(sm)] == [TRANSPOSED] * 3


def test_a_transposed_part_copied_or_handed_out_gets_eager_strides():
    """A member's part of a transposed group is dense but transposed: where the plan
    hands it out with eager's strides (``eager_strides``) or copies it for a writer
    (``member_copy``), the copy is contiguous, as eager's value is."""
    n, shape = 3, (5, 4)
    x = torch.randn(n, shape[1], shape[0])
    parts = unstack(x, TRANSPOSED, n, shape)
    assert_close(torch.stack(parts), x.transpose(1, 2))
    assert not parts[1].is_contiguous()
    for value in (eager_strides(parts[1]), member_copy(parts, 1)):
        assert value.is_contiguous() and value.stride() == (4, 1)
        assert_close(value, x[1].t())


def test_the_caller_may_write_the_stacked_output_and_weights_updated_in_place_show():
    """The stack the caller gets is its own (written in place, the next call is still
    eager's); an optimizer's in-place steps on the members (training calls, stacked)
    reach the transposed kernels of the plan without autograd."""
    torch.manual_seed(0)
    model = Ensemble(fout=1)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.01)
    for step in range(4):
        x = torch.randn(ROWS, 7)
        for o, m in ((opt, sm), (opt_ref, ref)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
            o.step()
        with torch.no_grad():
            x = torch.randn(ROWS, 7)
            out = sm(x)
            expected = ref(x)
            _same(out, expected, f"step {step}")
            out.mul_(3)  # the caller's own tensor
            _same(sm(x), expected, f"step {step}, after the caller wrote the last output")
    ss.testing.assert_path(sm, "plan:serial")
    assert all(k.out_layout == TRANSPOSED for k in _linears(sm))


def test_outputs_read_by_the_models_code_or_the_caller_one_by_one_are_stacks():
    """Several output features read one by one (returned as a list, or viewed by the
    model's own code): the chain runs transposed up to its last Linear, which writes a
    stack; every value has eager's strides (``view`` works on it)."""
    torch.manual_seed(0)
    for out in ("list", "viewed"):
        model = Ensemble(fout=3, out=out)
        sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
        _no_grad_calls(sm, model, (ROWS, 7))
        kernels = _linears(sm)
        assert [k.out_layout for k in kernels] == [TRANSPOSED, TRANSPOSED, ("stack", 0)], out
        assert kernels[2].in_layout == TRANSPOSED


class _ReadsHidden(nn.Module):
    """A tower whose first layer's value is read besides the chain (the chain's layout
    would reach code that is not a fused Linear)."""

    def __init__(self):
        super().__init__()
        self.l1 = nn.Linear(7, 6)
        self.act = nn.ReLU()
        self.l2 = nn.Linear(6, 2)

    def forward(self, x):
        h = self.l1(x)
        return self.l2(self.act(h)) + h.sum(1, keepdim=True)


class _ReadsHiddenGroup(nn.Module):
    def __init__(self, n: int = 4):
        super().__init__()
        self.towers = nn.ModuleList(_ReadsHidden() for _ in range(n))

    def forward(self, x):
        return torch.stack([t(x) for t in self.towers])


def test_a_value_read_outside_the_chain_keeps_the_stacked_layouts():
    """The first layer's value has a reader that is no fused Linear: it stays a wide
    linear (folded); eager's values."""
    torch.manual_seed(0)
    model = _ReadsHiddenGroup()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS, 7))
    kernels = _linears(sm)
    assert kernels and all(k.out_layout != TRANSPOSED for k in kernels), [k.kernel for k in kernels]


@pytest.mark.cuda
def test_on_a_cuda_device_the_chain_stays_stacked(emulated_cuda):
    """cuBLAS takes a transposed operand as it is: on a CUDA device the kernels keep the
    stacked layouts (the transposed one pays on the CPU only)."""
    torch.manual_seed(0)
    model = Ensemble(fout=1).cuda()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(ROWS, 7, device="cuda")
            assert_close(sm(x), ref(x))
    ss.testing.assert_path(sm, "plan:serial")
    kernels = _linears(sm)
    assert kernels and all(k.out_layout != TRANSPOSED for k in kernels), [k.kernel for k in kernels]


@pytest.mark.parametrize("grad", [False, True])
def test_the_general_path_computes_what_the_specialised_one_does(grad):
    """``LinearKernel.run`` (the general path) and the specialised function of each
    transposed kernel agree with the members' own modules, with gradients on and off
    (a plan's kernels run under the grad mode it was made in; each is right under both)."""
    torch.manual_seed(0)
    model = Ensemble(fout=3, out="list")
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(2):
            sm(torch.randn(ROWS, 7))
    ss.testing.assert_path(sm, "plan:serial")
    kernels = _linears(sm)
    assert kernels[0].out_layout == TRANSPOSED
    layers = [[getattr(t, f"l{i}") for t in model.towers] for i in (1, 2, 3)]
    n, rows = len(model.towers), ROWS
    with torch.set_grad_enabled(grad):
        for k, members in zip(kernels, layers):
            if k.in_layout == TRANSPOSED:
                x = torch.randn(n, k.in_features, rows)
                expected = torch.stack([m(x[i].t()) for i, m in enumerate(members)])
            else:
                x = torch.randn(rows, k.in_features)
                expected = torch.stack([m(x) for m in members])
            for fn in (k.run, k.specialise()):
                out = unstack(fn(x), k.out_layout, n, k.out_shape)
                assert_close(torch.stack(out), expected, what=f"{k.kernel}: {fn}")
                assert out[0].requires_grad == grad


def test_relu_on_the_transposed_layout_is_written_in_place():
    """The fused ReLU writes the Linear's own transposed result in place (nothing else
    reads it), as on the stacked layouts."""
    torch.manual_seed(0)
    model = Ensemble(fout=1)
    model.towers.apply(lambda m: setattr(m, "a2", nn.ReLU()) if isinstance(m, Tower) else None)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS, 7))
    with torch.no_grad():
        x = torch.randn(ROWS, 7)
        with _Ops() as ops:
            out = sm(x)
        ss.testing.assert_path(sm, "plan:serial")
        assert ops.ops.count("aten.relu_.default") == 2 and "aten.relu.default" not in ops.ops, ops.ops
        _same(out, model(x), "no_grad")
    assert all(k.out_layout == TRANSPOSED for k in _linears(sm))


def test_the_transposed_chain_under_cpu_autocast_returns_eagers_dtype_and_values():
    """Under CPU autocast (bfloat16) the transposed matmuls are cast as the members'
    linears are: the plan's outputs have eager's dtype and values."""
    torch.manual_seed(0)
    model = Ensemble(fout=1)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for call in range(3):
            x = torch.randn(ROWS, 7)
            out, expected = sm(x), ref(x)
            assert out.dtype == expected.dtype == torch.bfloat16
            assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2, what=f"call {call}")
        ss.testing.assert_path(sm, "plan:serial")
    assert [k.out_layout for k in _linears(sm)] == [TRANSPOSED] * 3


def test_fewer_rows_keep_the_stacked_layouts():
    """Under ``TRANSPOSED_MIN_ROWS`` rows ``xs @ W^T`` is the faster matmul: no kernel of
    the chain is transposed, and the results are eager's."""
    torch.manual_seed(0)
    model = Ensemble(fout=1)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS // 2, 7))
    kernels = _linears(sm)
    assert kernels and all(TRANSPOSED not in (k.in_layout, k.out_layout) for k in kernels)


class _Slices(nn.Module):
    """MLPs each reading its own slice of one input (a fold of the features), concatenated."""

    def __init__(self, n: int = 5, fin: int = 4, hidden: int = 6):
        super().__init__()
        self.fin = fin
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(fin, hidden), nn.ReLU(), nn.Linear(hidden, 1)) for _ in range(n)
        )

    def forward(self, x):
        return torch.cat([m(x[:, self.fin * i : self.fin * (i + 1)]) for i, m in enumerate(self.mlps)], 1)


class _Separate(nn.Module):
    """Towers each reading a part of one input (``xs[i]``: stacked for the first layer)."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.towers = nn.ModuleList(Tower(7, 6, 1) for _ in range(n))

    def forward(self, xs):
        return torch.stack([t(xs[i]) for i, t in enumerate(self.towers)])


@pytest.mark.parametrize(
    "make, shape, first_in",
    [
        (lambda: _Slices(), (ROWS, 20), ("fold", 1)),
        (lambda: _Separate(), (4, ROWS, 7), ("stack", 0)),
    ],
    ids=["fold", "stack"],
)
def test_folded_and_stacked_inputs_are_read_transposed(make, shape, first_in):
    """Small MLPs reading slices of one input (a fold of their features) or parts of an
    unbound one (a stack): the first Linear reads its input as a transposed view, and the
    chain runs transposed to the last layer's one output feature; eager's values."""
    torch.manual_seed(0)
    model = make()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, shape)
    kernels = _linears(sm)
    assert kernels[0].in_layout == first_in and all(k.out_layout == TRANSPOSED for k in kernels), [
        (k.in_layout, k.out_layout) for k in kernels
    ]


def test_a_fold_of_large_members_stays_stacked_up_to_one_output_feature():
    """Members whose weight exceeds ``FOLD_TRANSPOSED_MAX_WEIGHT`` read their folded input
    stacked (the transposed view's matmul was the slower one); the one-feature layer
    after them still writes transposed (its stack's memory)."""
    torch.manual_seed(0)
    model = _Slices(n=3, fin=80, hidden=64)  # 80 * 64 > 4096
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    _no_grad_calls(sm, model, (ROWS, 240))
    assert [k.out_layout for k in _linears(sm)] == [("stack", 0), TRANSPOSED]


def test_the_stacked_kernels_backward_gives_its_matmuls_unit_strides_on_size_one_dims():
    """A gradient that comes back through views can carry any stride on a dim of size 1,
    which sends ATen's CPU batched matmul down its per-item path (4.5 ms instead of 0.3 for
    1,000 one-output members): the stacked kernel's backward hands its matmuls stride 1
    there; the gradients are those of the same product by autograd."""
    from torch.utils._python_dispatch import TorchDispatchMode

    matmuls = {"aten.bmm.default", "aten.baddbmm.default", "aten.baddbmm_.default"}

    class Strides(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.odd: list[tuple] = []
            self.seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in matmuls:
                self.seen += 1
                for a in args:
                    if isinstance(a, torch.Tensor):
                        canonical = torch.empty(a.shape, device="meta").stride()
                        pairs = zip(a.shape, a.stride(), canonical)
                        if any(n == 1 and s not in (1, c) for n, s, c in pairs):
                            self.odd.append((str(func), tuple(a.shape), a.stride()))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    n, rows, fin = 6, 16, 5
    xs = torch.randn(n, rows, fin, requires_grad=True)
    w = torch.randn(n, 1, fin, requires_grad=True)
    b = torch.randn(n, 1, requires_grad=True)
    y = _stacked_linear(xs, w, b)  # [n, rows, 1]
    # The gradient as a transposed layout's views hand it back: [n, rows, 1], its size-1
    # dim strided past the whole tensor.
    base = torch.randn(rows, n)
    grad = torch.as_strided(base, (n, rows, 1), (1, n, n * rows))
    with Strides() as mode:
        gx, gw, gb = torch.autograd.grad(y, (xs, w, b), grad)
    assert mode.seen and not mode.odd, mode.odd
    expected = torch.autograd.grad(torch.baddbmm(b.unsqueeze(1), xs, w.transpose(1, 2)), (xs, w, b), grad)
    assert_close([gx, gw, gb], list(expected))


def test_the_fresh_one_feature_gather_restrides_only_a_value_without_autograd():
    """The gather of a one-feature transposed kernel result nothing else reads restrides it
    in place (no view for the caller's copy to detach); a result that takes a gradient
    (the kernel's autograd branch) is viewed, as autograd requires."""
    from streamsched.passes.fusion.layout import specialise_gather, stack_members

    n, rows = 3, 5
    gather = specialise_gather(stack_members, (TRANSPOSED, n, (rows, 1), 0), True)
    x = torch.randn(n, 1, rows)
    expected = x.transpose(1, 2).clone()
    y = gather(x)
    assert y is x and not y._is_view()
    assert_close(y, expected)
    w = torch.randn(n, 1, rows, requires_grad=True)
    y = gather(w * 2)
    assert y._is_view()
    weights = torch.randn(n, rows, 1)
    (y * weights).sum().backward()
    assert_close(w.grad, 2 * weights.transpose(1, 2))
