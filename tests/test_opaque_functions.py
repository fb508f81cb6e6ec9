"""A plain function fx cannot trace, called from a traced forward, runs as one opaque call
(``frontend.opaque_functions``) instead of making its caller's class opaque; and a traced
shape of known rank can be iterated (``frontend.ranks``): ``(*x.shape[:-1], -1, d)``."""

from __future__ import annotations

import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close


def padding_mask(x, mask):
    """Branches on tensor values (fx cannot trace it); ``None`` when nothing is masked,
    as transformers' mask builders return ``None`` for SDPA's causal fast path."""
    if mask is None or bool(mask.all()):
        return None
    return (mask[:, :, None] * mask[:, None, :]).to(x.dtype)


class MaskedMixer(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, mask):
        m = padding_mask(x, mask)
        h = self.proj(x)
        if m is not None:
            h = torch.bmm(m, h)
        return x + self.ff(h)


class MaskedModel(nn.Module):
    def __init__(self, layers: int = 2, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(MaskedMixer(d) for _ in range(layers))
        self.head = nn.Linear(d, 3)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def _calls(model, make, calls=3):
    sm = ss.StreamScheduledModule(model, executor="serial")
    for seed in range(calls):
        args = make(seed)
        with torch.no_grad():
            assert_close(sm(*args), model(*args))
        assert_path(sm, "recorded", "plan")
    return sm


def test_untraceable_helper_function_runs_as_one_opaque_call():
    torch.manual_seed(0)
    model = MaskedModel().eval()

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        mask = torch.ones(2, 5)
        mask[1, 3:] = 0
        return torch.randn(2, 5, 8, generator=g), mask

    sm = _calls(model, make)
    plan = sm.plan
    # The mixers are traced (before: their class was opaque, the whole layer one task).
    assert plan.opaque == []
    assert [f.function for f in plan.opaque_functions] == [f"{__name__}.padding_mask"]
    assert "control flow" in plan.opaque_functions[0].reason
    assert plan.coverage_calls == (9, 9)
    assert "opaque functions: 1" in plan.summary()


def test_opaque_function_none_is_learned():
    """The helper returns ``None`` (no padding): the trace learns it, as for a leaf
    call, and skips ``bmm``, as eager does."""
    torch.manual_seed(0)
    model = MaskedModel().eval()

    def make(seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(2, 5, 8, generator=g), torch.ones(2, 5)

    sm = _calls(model, make)
    assert sm.plan.opaque == []
    assert [f.function for f in sm.plan.opaque_functions] == [f"{__name__}.padding_mask"]


class Box:
    def __init__(self):
        self.seen = []


def count_and_scale(x, box):
    box.seen.append(1)  # a method call: not an attribute store
    if x.sum() > 1e9:
        x = x * 0
    return x * len(box.seen)


class MadeInForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        box = Box()  # made on every call: a node may not hold it
        return self.b(count_and_scale(self.a(x), box))


class Root(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.inner(x))


def test_object_made_during_the_forward_is_never_baked_in():
    """An object the forward makes on every call would be shared by every call of a node
    holding it (here, the scale would grow with each call): the function is refused, its
    caller's class runs opaque, as before."""
    torch.manual_seed(0)
    model = Root(MadeInForward()).eval()
    sm = _calls(model, lambda seed: (torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)),), calls=4)
    assert [o.path for o in sm.plan.opaque] == ["inner"]
    assert sm.plan.opaque_functions == []


def remember(module, x):
    module.last_norm = float(x.norm())  # assigns a module attribute
    return x * 2


class Remembers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.last_norm = 0.0

    def forward(self, x):
        y = remember(self, self.a(x))
        return y * self.last_norm if self.last_norm > 1e9 else y


def test_function_assigning_attributes_is_never_wrapped():
    torch.manual_seed(0)
    model = Root(Remembers()).eval()
    sm = _calls(model, lambda seed: (torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)),))
    assert [o.path for o in sm.plan.opaque] == ["inner"]
    assert sm.plan.opaque_functions == []


# --- ranks -----------------------------------------------------------------------------------


class Heads(nn.Module):
    """Multi-head projections as transformers writes them (``LlamaAttention``)."""

    def __init__(self, d: int = 16, head_dim: int = 4):
        super().__init__()
        self.head_dim = head_dim
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x):
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q(x).view(hidden_shape).transpose(-2, -3)
        k = self.k(x).view(hidden_shape).transpose(-2, -3)
        a = torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ q
        out = a.transpose(-2, -3).reshape(*input_shape, -1)
        assert len(out.shape) == len(x.shape)
        return self.o(out)


class HeadsModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.heads = Heads()

    def forward(self, x):
        return self.heads(self.norm(x)) + x


def test_shape_of_known_rank_is_iterated():
    torch.manual_seed(0)
    model = HeadsModel().eval()
    sm = _calls(model, lambda seed: (torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(seed)),))
    assert sm.plan.opaque == []
    assert sm.plan.coverage_calls == (4, 4)


def test_trace_is_made_per_rank():
    """The same module called with inputs of another rank: a trace made for rank 3 holds
    two ``getitem``s of ``x.shape[:-1]``, wrong for rank 4; each rank gets its own."""
    torch.manual_seed(0)
    model = HeadsModel().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for shape in [(2, 5, 16), (3, 2, 5, 16), (5, 16), (2, 5, 16)]:
        x = torch.randn(*shape)
        with torch.no_grad():
            out = sm(x)
            assert out.shape == x.shape
            assert_close(out, model(x))
        assert_path(sm, "recorded", "plan")
        assert sm.plan.opaque == []


def apply_twice(layer, x):
    if x.sum() > 1e9:  # data-dependent: fx cannot trace it
        x = x * 0
    return layer(layer(x))


class CallsThrough(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return apply_twice(self.inner, self.a(x))


def test_opaque_function_module_calls_are_not_scheduled():
    """Module calls made inside an opaque function run as written: coverage counts them,
    unscheduled (the function is no task the user declared)."""
    torch.manual_seed(0)
    model = Root(CallsThrough()).eval()
    sm = _calls(model, lambda seed: (torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)),))
    assert sm.plan.opaque == []
    assert [f.function for f in sm.plan.opaque_functions] == [f"{__name__}.apply_twice"]
    assert sm.plan.coverage_calls == (2, 4)


_APPLY = torch.autograd.Function.__dict__["apply"]


class ScaledBackward(torch.autograd.Function):
    """Forward doubles; backward scales by ``k`` (not the forward's derivative, as a
    straight-through estimator's or a gradient reversal's is not)."""

    @staticmethod
    def forward(ctx, x, k):
        ctx.k = k
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.k, None


class CustomGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return ScaledBackward.apply(self.lin(x), -3.0)


class CustomGradModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(CustomGradBlock() for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(6, 3) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return torch.stack([h(x) for h in self.heads])


def test_an_autograd_function_keeps_its_own_backward():
    """A trace would run ``Function.apply``'s forward on proxies and record its ops, and
    the plan would differentiate those instead of calling the Function's backward: the
    module calling it runs as written (its backward in place), the rest is scheduled."""
    import copy

    model = CustomGradModel()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for call in range(3):
        x = torch.randn(4, 6)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        out, expected = sm(x), ref(x)
        assert_path(sm, "recorded" if call == 0 else "plan:serial")
        assert_close(out, expected, what=f"call {call}")
        weights = torch.randn(expected.shape)
        (out * weights).sum().backward()
        (expected * weights).sum().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, what=f"grad {name} (call {call})")
    assert any("ScaledBackward.apply" in o.reason for o in sm.plan.opaque), sm.plan
    # Outside a trace, apply is the Function's own.
    assert torch.autograd.Function.__dict__["apply"] is _APPLY
