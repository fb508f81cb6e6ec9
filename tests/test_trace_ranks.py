"""Rank rules of the tracer (``frontend.ranks``) beyond shapes: ``x.dim()`` and ``x.ndim``
answered from the known rank, and the items of ``split``/``chunk``/``unbind``/``max(dim)``
given their rank (a length only where the number of pieces is a constant).

Each model here branches on a rank or builds a shape from an item's shape, as
transformers' attention and masks do; without the rule its module runs as one opaque
task. Every call is compared with eager on fresh inputs of changing sizes (a trace is
made per rank, never per size)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(model, inputs, executor="serial", whole=True):
    """Each input tuple through a fresh wrapper and eager, in order; every call after a
    rank's first runs the plan, and with ``whole`` every call's plan is traced whole (no
    module runs as one opaque task)."""
    sm = ss.StreamScheduledModule(model, executor=executor)
    for args in inputs:
        with torch.no_grad():
            assert_close(sm(*args), model(*args))
        assert_path(sm, "recorded", "plan")
        if whole:
            assert sm.plan.opaque == [], (tuple(a.shape for a in args), sm.plan.opaque)
    return sm


class RankBranch(nn.Module):
    """Branches on ranks as ``DebertaV2Encoder`` (``mask.dim() <= 2``) and ``GPT2Model``
    (``mask.ndim < 4``) do."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x, mask):
        h = self.proj(x)
        if mask.dim() <= 2:
            mask = mask[:, None, :, None]
        elif mask.ndim < 4:
            mask = mask[:, None, :, :].sum(-1, keepdim=True)
        if h.ndimension() == 3:
            h = h.unsqueeze(1)
        return self.out(h * mask).sum(1)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(8, 8)

    def forward(self, *args):
        return self.head(self.inner(*args))


def test_dim_and_ndim_are_the_known_rank():
    """Masks of rank 2 and 3 take different branches: each rank gets its own trace, both
    traced whole; sizes change within a rank."""
    torch.manual_seed(0)
    model = Outer(RankBranch()).eval()
    inputs = []
    for seed, (b, t, mask_rank) in enumerate([(2, 5, 2), (3, 4, 2), (2, 5, 3), (3, 6, 3), (4, 3, 2)]):
        x = torch.randn(b, t, 8, generator=_g(seed))
        mask = torch.rand(b, t, generator=_g(seed + 10)) if mask_rank == 2 else torch.rand(b, t, t, generator=_g(seed))
        inputs.append((x, mask))
    for executor in ("serial", "threads"):
        sm = _run(model, inputs, executor)
        assert sm.plan.opaque == [], sm.plan.opaque
        assert sm.plan.coverage_calls == (3, 3)


class FusedQKV(nn.Module):
    """``GPT2Attention``: one projection split in three, shapes built from an item's
    shape (``(*q.shape[:-1], -1, head_dim)``)."""

    def __init__(self, d: int = 8, head_dim: int = 2):
        super().__init__()
        self.d, self.head_dim = d, head_dim
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(self.d, dim=2)
        shape = (*q.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        a = a.transpose(1, 2)
        return self.c_proj(a.reshape(*a.shape[:-2], -1))


class Pieces(nn.Module):
    """``chunk`` (as many pieces as asked, or fewer: a size decides), ``unbind`` and
    ``max(dim)``: only their items' ranks are used."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d // 2, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        lo, hi = x.chunk(2, dim=-1)
        h = self.a(lo * hi)
        first = torch.stack([h, h.flip(-1)]).unbind(0)[0]
        top = first.max(dim=-1, keepdim=True).values
        peak, _ = h.max(-1)
        return self.b(first.view(*first.shape[:-1], -1) - top) + peak[..., None]


@pytest.mark.parametrize("inner", [FusedQKV, Pieces])
def test_items_of_a_split_have_the_input_rank(inner):
    torch.manual_seed(0)
    model = Outer(inner()).eval()
    inputs = [(torch.randn(b, t, 8, generator=_g(seed)),) for seed, (b, t) in enumerate([(2, 5), (3, 4), (1, 7)])]
    sm = _run(model, inputs)
    assert sm.plan.opaque == [], sm.plan.opaque


class Loops(nn.Module):
    """Iterates pieces: ``split`` with explicit sizes has that many pieces whatever the
    input's size; ``chunk(3)`` of a batch of 2 has two, so iterating it must not trace
    (a trace of three pieces would be wrong for the next batch size)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(3, d)
        self.b = nn.Linear(5, d)
        self.c = nn.Linear(d, d)

    def forward(self, x):
        outs = [layer(piece) for layer, piece in zip([self.a, self.b], x.split([3, 5], dim=-1))]
        y = outs[0] + outs[1]
        rows = [self.c(piece).sum(0) for piece in y.chunk(3, dim=0)]
        return torch.stack(rows).sum(0)


def test_only_a_constant_number_of_pieces_is_iterated():
    torch.manual_seed(0)
    model = Outer(Loops()).eval()
    inputs = [(torch.randn(b, 4, 8, generator=_g(seed)),) for seed, b in enumerate([3, 2, 6, 3, 1])]
    sm = _run(model, inputs, whole=False)
    # The chunk loop makes Loops opaque: its calls run as written, with the batch's count.
    assert [o.path for o in sm.plan.opaque] == ["inner"]


class SplitIterated(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(3, d)
        self.b = nn.Linear(5, d)

    def forward(self, x):
        a, b = [layer(piece) for layer, piece in zip([self.a, self.b], x.split([3, 5], dim=-1))]
        return a * b


def test_split_with_explicit_sizes_is_iterated():
    torch.manual_seed(0)
    model = Outer(SplitIterated()).eval()
    inputs = [(torch.randn(b, 4, 8, generator=_g(seed)),) for seed, b in enumerate([3, 2, 5])]
    sm = _run(model, inputs)
    assert sm.plan.opaque == [], sm.plan.opaque
    assert sm.plan.coverage_calls == (3, 3)


class Conv1D(nn.Module):
    """GPT-2's projection: ``addmm`` on a flattened view, viewed back."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        assert x.ndim == 2  # read from addmm's rank
        return x.view(size_out)


class Positions(nn.Module):
    """Positions made in the forward (``arange`` of a traced size, a ``zeros`` of sizes
    read from a shape), embedded and projected, then split into heads from their shape."""

    def __init__(self, d: int = 8, head_dim: int = 2):
        super().__init__()
        self.head_dim = head_dim
        self.wpe = nn.Embedding(16, d)
        self.proj = Conv1D(d, d)
        self.mix = nn.Linear(head_dim, head_dim)

    def forward(self, x):
        positions = torch.arange(x.shape[1]).unsqueeze(0)
        bias = torch.zeros(x.shape[0], x.size(1), 1) + torch.ones(x.shape[-1])
        h = self.proj(x + self.wpe(positions)) * bias
        heads = self.mix(h.view(*h.shape[:-1], -1, self.head_dim))
        return heads.flatten(-2)


def test_factories_and_addmm_have_their_ranks():
    torch.manual_seed(0)
    model = Outer(Positions()).eval()
    inputs = [(torch.randn(b, t, 8, generator=_g(seed)),) for seed, (b, t) in enumerate([(2, 5), (3, 4), (1, 7)])]
    for executor in ("serial", "threads"):
        sm = _run(model, inputs, executor)
        assert sm.plan.opaque == [], sm.plan.opaque
        assert sm.plan.coverage_calls == (4, 4)  # Conv1D is a leaf call too


# --- dtypes fixed by a cast ------------------------------------------------------------------


class Float32Scores(nn.Module):
    """``GPTNeoSelfAttention._attn``: scores cast to float32, masked with that dtype's
    minimum (``torch.finfo(w.dtype)``), back to the values' dtype; and XLNet's masks:
    ``(m > 0).to(float)`` and a branch on the mask's dtype."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)

    def forward(self, x, m):
        q, k = self.q(x).to(torch.float32), self.k(x).to(torch.float32)
        w = torch.matmul(q, k.transpose(-1, -2))
        mask = (m > 0).to(torch.float32)
        pair = (mask[:, :, None] * mask[:, None, :]) > 0
        if pair.dtype != torch.bool:  # a comparison gives bools whatever its operands
            pair = pair > 0
        low = torch.tensor(torch.finfo(w.dtype).min, dtype=w.dtype)
        w = torch.where(pair, w, low)
        if mask.dtype == torch.float16:
            w = w - 65500 * (1 - pair.to(w))
        v = self.v(x)
        return torch.softmax(w, dim=-1).to(v.dtype) @ v


class InputDtype(nn.Module):
    """Branches on an input's dtype: never decided from the first call (a trace serves
    inputs of every dtype), so the module runs as written and each dtype takes its own
    branch."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)

    def forward(self, x, m):
        h = self.a(x.float())
        if x.dtype == torch.float64:
            return h * 2
        return h


def test_dtype_fixed_by_a_cast_is_known():
    torch.manual_seed(0)
    model = Outer(Float32Scores()).eval()
    inputs = [
        (torch.randn(b, t, 8, generator=_g(seed)), torch.randn(b, t, generator=_g(seed + 7)))
        for seed, (b, t) in enumerate([(2, 5), (3, 4), (1, 6)])
    ]
    for executor in ("serial", "threads"):
        sm = _run(model, inputs, executor)
        assert sm.plan.coverage_calls == (4, 4)


def test_an_inputs_dtype_is_never_baked_in():
    torch.manual_seed(0)
    model = Outer(InputDtype()).eval()
    inputs = []
    for seed, dtype in enumerate([torch.float32, torch.float64, torch.float32, torch.float64]):
        x = torch.randn(2, 3, 8, generator=_g(seed)).to(dtype)
        inputs.append((x, torch.randn(2, 3, generator=_g(seed))))
    sm = ss.StreamScheduledModule(model, executor="serial")
    for args in inputs:
        with torch.no_grad():
            expected = model(*args)
            assert_close(sm(*args), expected)
        assert_path(sm, "recorded", "plan")


class AutocastScores(nn.Module):
    """Under autocast a float32 matmul gives bfloat16: its dtype is not the operands'."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.q = nn.Linear(d, d)

    def forward(self, x, m):
        q = self.q(x).float()
        w = q @ q.transpose(-1, -2)
        if w.dtype == torch.float32:
            return w.sum(-1, keepdim=True) * x
        return w.float().mean(-1, keepdim=True) * x


def test_autocast_matmul_dtype_is_not_assumed():
    torch.manual_seed(0)
    model = Outer(AutocastScores()).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for seed in range(3):
        args = (torch.randn(2, 3, 8, generator=_g(seed)), torch.randn(2, 3, generator=_g(seed)))
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            expected = model(*args)
            assert_close(sm(*args), expected, atol=1e-2, rtol=1e-2)
        assert_path(sm, "recorded", "plan")


# --- indexing with a tensor; modules with a forward of their own ------------------------------


class LearnedPositions(nn.Embedding):
    """Whisper's positional embedding: an ``nn.Embedding`` whose own forward indexes the
    weight (rank 3 with position ids, 2 from a slice)."""

    def forward(self, input_ids, position_ids=None):
        if position_ids is None:
            return self.weight[: input_ids.shape[1]]
        return self.weight[position_ids]


class Decoder(nn.Module):
    def __init__(self, d: int = 8, with_ids: bool = True):
        super().__init__()
        self.with_ids = with_ids
        self.embed = nn.Embedding(16, d)
        self.positions = LearnedPositions(16, d)
        self.proj = nn.Linear(d, d)

    def forward(self, ids):
        h = self.embed(ids)
        if self.with_ids:
            position_ids = torch.arange(h.shape[1], device=h.device) + 0
            position_ids = position_ids.unsqueeze(0).repeat(h.shape[0], 1)
            p = self.positions(ids, position_ids)
            keep = (ids > 2)[..., None].expand_as(h)
            h = h + p
            picked = h[keep]  # a boolean index: one dimension
            assert picked.ndim == 1
        else:
            p = self.positions(ids)
            h = h + p.view(*p.shape[:-1], 2, -1).flatten(-2)
        heads = h.view(*h.shape[:-1], 2, -1)
        return self.proj(heads.flatten(-2))


@pytest.mark.parametrize("with_ids", [True, False], ids=["position_ids", "slice"])
@pytest.mark.parametrize("leaf", [False, True], ids=["traced", "leaf"])
def test_indexing_with_a_tensor_and_embedding_subclasses(with_ids, leaf):
    """Integer and boolean tensor indices give their ranks; an ``nn.Embedding`` subclass
    with a forward of its own, run as one call (``leaf_modules``), has no rank of
    ``nn.Embedding``'s (its slice is rank 2, not 3)."""
    torch.manual_seed(0)
    model = Outer(Decoder(with_ids=with_ids)).eval()
    sm = ss.StreamScheduledModule(model, executor="serial", leaf_modules=(LearnedPositions,) if leaf else ())
    for seed, (b, t) in enumerate([(2, 5), (3, 4), (2, 6)]):
        ids = torch.randint(0, 16, (b, t), generator=_g(seed))
        with torch.no_grad():
            assert_close(sm(ids), model(ids))
        assert_path(sm, "recorded", "plan")
        # As a leaf, the subclass's value has no known rank: the code reading its shape
        # cannot be traced, and the module calling it runs as written.
        assert [o.path for o in sm.plan.opaque] == (["inner"] if leaf else []), sm.plan.opaque


class SequenceReduction(nn.Module):
    """Segformer's efficient attention: tokens laid out as an image, reduced by a
    strided convolution, and read back as tokens from the convolution's shape."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.sr = nn.Conv2d(d, d, kernel_size=2, stride=2)
        self.norm = nn.BatchNorm2d(d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, height: int = 4):
        b, n, c = x.shape
        image = x.permute(0, 2, 1).reshape(b, c, height, -1)
        reduced = nn.functional.avg_pool2d(self.norm(self.sr(image)), 1)
        tokens = reduced.reshape(*reduced.shape[:2], -1).permute(0, 2, 1)
        return self.proj(tokens).mean(1, keepdim=True) + x


def test_convolutions_and_pooling_keep_the_rank():
    torch.manual_seed(0)
    model = Outer(SequenceReduction()).eval()
    inputs = [(torch.randn(b, 4 * w, 8, generator=_g(seed)),) for seed, (b, w) in enumerate([(2, 4), (3, 6), (1, 2)])]
    sm = _run(model, inputs)
    assert sm.plan.coverage_calls == (4, 4)


class ScaledEmbedding(nn.Embedding):
    """BART's word embedding: torch's forward scaled (``F.embedding`` inside)."""

    def forward(self, ids):
        return super().forward(ids) * 2.0


class ScaledTokens(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.embed = ScaledEmbedding(16, d)
        self.mix = nn.Linear(d // 2, d // 2)

    def forward(self, ids):
        h = self.embed(ids)
        return self.mix(h.view(*h.shape[:-1], 2, -1)).flatten(-2)


def test_functional_embedding_adds_a_dimension():
    torch.manual_seed(0)
    model = Outer(ScaledTokens()).eval()
    inputs = [(torch.randint(0, 16, (b, t), generator=_g(seed)),) for seed, (b, t) in enumerate([(2, 5), (3, 4)])]
    sm = _run(model, inputs)
    assert sm.plan.coverage_calls == (3, 3)


def test_a_hooked_torch_module_gives_no_rank_or_dtype():
    # A hook may hand back another value than the module's own (here one more dimension
    # and another dtype): neither the rank nor the dtype of torch's rank-keeping modules
    # (Linear, ReLU) is assumed for a hooked call.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU()

        def forward(self, x):
            y = self.act(self.fc(x))
            out = y.sum(0) if y.dim() == 3 else y * 2
            return out if out.dtype == torch.float64 else out + 1

    torch.manual_seed(0)
    model = Net().eval()
    model.fc.register_forward_hook(lambda m, args, out: out.unsqueeze(0))
    model.act.register_forward_hook(lambda m, args, out: out.double())
    sm = ss.StreamScheduledModule(model, executor="serial")
    for batch in (3, 5):
        x = torch.randn(batch, 4, generator=_g(batch))
        with torch.no_grad():
            y, ref = sm(x), model(x)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        assert_close(y, ref)
