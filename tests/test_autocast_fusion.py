"""Fused kernels under autocast: every kernel kind returns the dtype its members return
and their values, under CPU bfloat16 autocast and (emulated, or real) CUDA float16
autocast; a kind that cannot match stays unfused and says why.

A fused kernel runs other ops than its members (``baddbmm`` for N ``linear`` calls, one
``layer_norm`` and a stacked affine for N LayerNorms, ``vmap`` for anything), and
autocast casts per op: each comparison asserts that the compared call ran the compiled
plan with the group fused (``executor="serial"`` keeps the model's own forward out of the
running), on fresh inputs, against the eager model."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.passes.fusion.kernels import FusedDtypeError, FusedKernel
from streamsched.testing import assert_path

from .helpers import assert_close

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")


class Members(nn.Module):
    """``n`` copies of ``make()`` on slices of the input (``shared``: all on the input),
    concatenated along dim 1."""

    def __init__(self, make, n: int = 4, shared: bool = False, width: int = 8):
        super().__init__()
        self.members = nn.ModuleList(make() for _ in range(n))
        self.shared, self.width = shared, width

    def forward(self, x):
        w = self.width
        parts = [x if self.shared else x[:, w * i : w * (i + 1)] for i in range(len(self.members))]
        return torch.cat([m(p) for m, p in zip(self.members, parts)], 1)


class Heads(nn.Module):
    """Heads of different widths reading one tensor: one wide kernel on concatenated weights."""

    def __init__(self, make):
        super().__init__()
        self.heads = nn.ModuleList(make(w) for w in (3, 5, 7))

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], 1)


class LinearSigmoid(nn.Module):
    """Traced through: its ``torch.sigmoid`` calls are fused as a function group."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 6)

    def forward(self, x):
        return torch.sigmoid(self.lin(x)) * 2.0


@ss.branch
class Gated(nn.Module):
    """A module with no kernel of its own: fused by ``vmap`` (without autocast)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sigmoid(self.a(x)) * self.b(x)


class BatchNormSub(nn.BatchNorm2d):
    """A BatchNorm2d subclass (as timm's BatchNormAct2d): not the exact type, so vmap."""

    def forward(self, x):
        return torch.relu(super().forward(x))


_FLAT = (5, 32)
_IMAGE = (2, 32, 6, 6)

# name -> (model, input shape, the fused group's kernel, what it is)
CASES = {
    "linear-baddbmm": (lambda: Members(lambda: nn.Linear(8, 6)), _FLAT, "baddbmm"),
    "linear-wide": (lambda: Members(lambda: nn.Linear(8, 6), shared=True), (5, 8), "wide linear"),
    "linear-concatenated": (
        lambda: Heads(lambda w: nn.Linear(8, w)),
        (5, 8),
        "wide Linear (concatenated weights)",
    ),
    "conv-grouped": (lambda: Members(lambda: nn.Conv2d(8, 4, 3)), _IMAGE, "grouped conv2d"),
    "conv-wide": (lambda: Members(lambda: nn.Conv2d(8, 4, 1), shared=True), (2, 8, 5, 5), "wide conv2d"),
    "conv-concatenated": (
        lambda: Heads(lambda w: nn.Conv2d(8, w, 1)),
        (2, 8, 5, 5),
        "wide Conv2d (concatenated weights)",
    ),
    # A reduced-precision activation (the conv's) meets float32 statistics.
    "batchnorm": (
        lambda: Members(lambda: nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4))),
        _IMAGE,
        "batch_norm over N*C channels",
    ),
    # A reduced-precision activation (the Linear's) meets float32 affine parameters: the
    # group returned float32 where eager returns the activation's dtype.
    "layernorm": (
        lambda: Members(lambda: nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6))),
        _FLAT,
        "layer_norm + stacked affine",
    ),
    "layernorm-float32-input": (lambda: Members(lambda: nn.LayerNorm(8)), _FLAT, "layer_norm + stacked affine"),
    "elementwise-module": (lambda: Members(lambda: nn.Sequential(nn.Linear(8, 6), nn.GELU())), _FLAT, "GELU once"),
    "function": (lambda: Members(LinearSigmoid), _FLAT, "sigmoid once"),
}

# Kinds that cannot match the members under autocast: they stay unfused, and say why.
REFUSED = {
    "vmap": (lambda: Members(Gated), (3, 32), "vmap under autocast"),
    "vmap-batchnorm-subclass": (
        lambda: Members(lambda: nn.Sequential(nn.Conv2d(8, 4, 1), BatchNormSub(4))),
        _IMAGE,
        "vmap under autocast",
    ),
}

# Half a unit in the last place at 1.0, and a little more: the kernels may sum in another
# order than the members' ops, and round once more where they do.
_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _run(make, shape, device, dtype, train):
    """Calls the wrapped and the eager model three times in lockstep under autocast on
    fresh inputs, forward and backward; returns the wrapped module after the last call,
    whose output dtype, values and gradients were compared."""
    torch.manual_seed(0)
    model = make().to(device).train(train)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    tol = _TOL[dtype]
    for call in range(3):
        x = torch.randn(shape, device=device)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        with torch.autocast(device, dtype=dtype):
            out = sm(x)
            expected = ref(x)
        if call > 0:
            assert_path(sm, "plan:serial")
        assert out.dtype == expected.dtype, f"call {call}: {out.dtype} vs eager's {expected.dtype}"
        assert_close(out, expected, atol=tol, rtol=tol, what=f"output (call {call})")
        out.float().pow(2).mean().backward()
        expected.float().pow(2).mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad.dtype == q.grad.dtype
            assert_close(p.grad, q.grad, atol=tol, rtol=tol, what=f"grad {name} (call {call})")
    for (name, b), c in zip(model.named_buffers(), ref.buffers()):
        assert_close(b, c, atol=tol, rtol=tol, what=f"buffer {name}")
    return sm


def _check_fused(device, dtype, case, train):
    make, shape, kernel = CASES[case]
    sm = _run(make, shape, device, dtype, train)
    assert kernel in [g.kernel for g in sm.plan.fused_groups], sm.plan.fused_groups


def _check_refused(device, dtype, case, train):
    make, shape, reason = REFUSED[case]
    sm = _run(make, shape, device, dtype, train)
    assert not any(g.kernel.startswith("vmap") for g in sm.plan.fused_groups)
    assert any(reason in u.reason for u in sm.plan.unfused), sm.plan.unfused


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kernel_kind_matches_its_members_under_cpu_bfloat16_autocast(case, train):
    _check_fused("cpu", torch.bfloat16, case, train)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_vmap_stays_unfused_under_cpu_bfloat16_autocast(case, train):
    _check_refused("cpu", torch.bfloat16, case, train)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_kernel_kind_matches_its_members_under_cuda_float16_autocast(case):
    # Emulated without a GPU: torch.autocast("cuda") also enters CPU autocast there, so the
    # casts are CPU autocast's (a real GPU runs CUDA's, where layer_norm is float32).
    _check_fused("cuda", torch.float16, case, True)


@pytest.mark.cuda
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_vmap_stays_unfused_under_cuda_float16_autocast(case):
    _check_refused("cuda", torch.float16, case, True)


def test_vmap_with_mixed_dtypes_stays_unfused_without_autocast():
    """A bfloat16 activation into float32 BatchNorm statistics, no autocast: the unbatched
    batch_norm accepts the mix, vmap's batch_norm refused it on the first planned call."""

    class Cast(nn.Module):
        def forward(self, x):
            return x.to(torch.bfloat16)

    make = lambda: nn.Sequential(Cast(), BatchNormSub(8))  # noqa: E731
    for train in (False, True):
        model = Members(make).train(train)
        ref = copy.deepcopy(model)
        sm = ss.StreamScheduledModule(model, executor="serial")
        for _ in range(3):
            x = torch.randn(_IMAGE)
            out, expected = sm(x), ref(x)
            assert out.dtype == expected.dtype == torch.bfloat16
            assert_close(out, expected, atol=0, rtol=0)
        assert_path(sm, "plan:serial")
        assert not sm.plan.fused_groups
        assert any("mixed floating dtypes (bfloat16, float32)" in u.reason for u in sm.plan.unfused)


def test_vmap_still_fuses_without_autocast():
    sm = _run_plain(lambda: Members(Gated), (3, 32))
    assert [g.kernel for g in sm.plan.fused_groups] == ["vmap(functional_call)"]


def _run_plain(make, shape, make_input=None):
    model = make()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for _ in range(3):
        x = make_input() if make_input else torch.randn(shape)
        out, expected = sm(x), ref(x)
        assert_close(out, expected)
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, what=name)
        assert_close(p.grad, q.grad, what=f"grad {name}")
    assert_path(sm, "plan:serial")
    return sm


def test_a_kernel_returning_another_dtype_than_its_members_raises():
    """The check every kernel runs on its first call (a plan's dtypes are fixed by its
    input dtypes and autocast state): a wrong dtype is an error, never a result."""
    sm = _run_plain(lambda: Members(lambda: nn.Linear(8, 6)), _FLAT)
    (kernel,) = [n.target for n in sm._ss.last.graph.nodes if isinstance(n.target, FusedKernel)]
    assert kernel.out_dtype == torch.float32 and kernel.dtype_checked  # checked on its first call
    kernel.out_dtype, kernel.dtype_checked = torch.bfloat16, False
    with pytest.raises(FusedDtypeError, match="returned torch.float32 where its members return torch.bfloat16"):
        sm(torch.randn(_FLAT))


def test_vmap_leaves_members_with_index_inputs_unfused():
    """The vmap trial runs on the members' recorded input dtypes: an Embedding's indices
    are no longer tried as floats (which failed the trial); it stays unfused on purpose,
    since one with ``max_norm`` writes its weight in place, which stacked weights refuse
    (its recording call shows that write: that reason is given first)."""

    class Lookups(nn.Module):
        def __init__(self):
            super().__init__()
            self.tables = nn.ModuleList(nn.Embedding(10, 4, max_norm=1.0) for _ in range(3))

        def forward(self, idx):
            return torch.cat([t(idx[:, i]) for i, t in enumerate(self.tables)], 1)

    sm = _run_plain(Lookups, None, lambda: torch.randint(0, 10, (5, 3)))
    assert not sm.plan.fused_groups
    assert any("writes its own parameter in place" in u.reason for u in sm.plan.unfused), sm.plan.unfused
