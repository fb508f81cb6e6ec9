"""The fused Linear's backward adding a stacked parameter's gradient into its buffer itself.

With ``fused_parameters()`` the fused Linear (``StackedLinear``) reads the stacked
parameter ``S`` as is. In a plain CPU backward it adds ``S``'s gradient straight into the
persistent buffer ``S.grad`` is (``stacked.grad_sink``), and ``S`` carries no Python
accumulation hooks: the backward does their work. Every test compares the members'
``.grad`` with the plain model's on the same weights and inputs, and asserts which way
the gradient went.
"""

import copy

import pytest
import torch

import streamsched as ss
from benchmarks.zoo import CriticEnsemble
from streamsched.passes.fusion import StackedParameter
from streamsched.passes.fusion import kernels as fused_kernels
from streamsched.testing import last_path

from .helpers import assert_close


def loss_of(out):
    return out.square().mean()


def setup():
    """Critics whose two hidden-to-output layers run as StackedLinear (the first, a wide
    linear, through autograd's own accumulation), on the plan."""
    torch.manual_seed(0)
    model = CriticEnsemble(6, obs=7, hidden=9)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        sm(torch.randn(4, 7))
    params = sm.fused_parameters()
    for _ in range(3):  # past the first calls of the grad signature
        loss_of(sm(torch.randn(4, 7))).backward()
    assert last_path(sm).startswith("plan"), last_path(sm)
    linear = [p for p in params if isinstance(p, StackedParameter) and ".net.0." not in p.member_names[0]]
    assert len(linear) == 4, [p.member_names[0] for p in params]
    for p in params:
        p.grad = None
    ref.zero_grad(set_to_none=True)
    return sm, model, ref, params, linear


@pytest.fixture
def sinks(monkeypatch):
    """What each call of grad_sink returned: True where the backward added the gradient
    in place."""
    got = []
    real = fused_kernels._grad_sink

    def spy(t, node):
        out = real(t, node)
        got.append(out is not None)
        return out

    monkeypatch.setattr(fused_kernels, "_grad_sink", spy)
    return got


def assert_member_grads(model, ref, factor=1.0, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, f"{what}{name}.grad is None"
        assert_close(p.grad, q.grad * factor, atol=1e-6, what=f"{what}{name}.grad")


def test_added_in_place_over_steps_and_accumulated(sinks):
    sm, model, ref, params, linear = setup()
    opt = torch.optim.SGD(params, lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 7)
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        sinks.clear()
        loss_of(sm(x)).backward()
        loss_of(ref(x)).backward()
        assert sinks == [True] * 4, f"step {step}: grad_sink returned {sinks}"
        assert_member_grads(model, ref, what=f"step {step}: ")
        # Two backwards without zero_grad: the second adds onto the first, as eager's.
        loss_of(sm(x)).backward()
        loss_of(ref(x)).backward()
        assert_member_grads(model, ref, what=f"step {step}, accumulated: ")
        for s in linear:
            link = s._stack
            assert not link.hooks, "StackedLinear's parameters need no accumulation hooks"
            assert s.grad is link.buf, "the gradient stays in the persistent buffer"
            assert all(m.grad._base is link.buf for m in s.members)
        opt.step()
        opt_ref.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-6)


def test_members_cleared_between_forward_and_backward_are_folded_in_first(sinks):
    sm, model, ref, _, _ = setup()
    x = torch.randn(4, 7)
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    out = sm(x)
    model.zero_grad(set_to_none=True)  # per member, after the forward
    ref.zero_grad(set_to_none=True)
    sinks.clear()
    loss_of(out).backward()
    loss_of(ref(x)).backward()
    assert sinks == [True] * 4
    assert_member_grads(model, ref)


def test_create_graph_goes_through_autograd_and_members_follow(sinks):
    sm, model, ref, _, linear = setup()
    x = torch.randn(4, 7)
    sinks.clear()
    loss_of(sm(x)).backward(create_graph=True)
    loss_of(ref(x)).backward(create_graph=True)
    assert sinks == [False] * 4
    assert_member_grads(model, ref)
    for s in linear:
        assert s.grad.requires_grad
        assert all(m.grad.requires_grad for m in s.members), "members' .grad carry the graph"
    # A gradient penalty through the members' gradients, as eager's.
    penalty = sum(p.grad.square().sum() for p in model.parameters())
    penalty_ref = sum(q.grad.square().sum() for q in ref.parameters())
    assert_close(penalty, penalty_ref, atol=1e-6)


def test_autograd_grad_and_backward_inputs_leave_other_gradients_alone(sinks):
    sm, model, ref, params, linear = setup()
    x = torch.randn(4, 7)
    sinks.clear()
    got = torch.autograd.grad(loss_of(sm(x)), linear)
    assert sinks == [False] * 4
    want = torch.autograd.grad(loss_of(ref(x)), list(ref.parameters()))
    by_name = dict(zip((n for n, _ in ref.named_parameters()), want))
    for s, g in zip(linear, got):
        for i, name in enumerate(s.member_names):
            assert_close(s.member_slice(g, i), by_name[name], atol=1e-6, what=name)
        assert not s.grad.any(), "autograd.grad must not accumulate into .grad"
    # backward(inputs=...) naming one stacked parameter: only it accumulates.
    first, rest = linear[0], linear[1:]
    sinks.clear()
    loss_of(sm(x)).backward(inputs=[first])
    assert first.grad.any()
    for s in rest:
        assert not s.grad.any(), f"{s.member_names[0]}: not among the inputs"


def test_a_hook_on_the_stacked_parameter_sees_its_gradient(sinks):
    sm, model, ref, _, linear = setup()
    hidden = linear[0]
    hidden.register_hook(lambda g: g * 2)
    x = torch.randn(4, 7)
    sinks.clear()
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    assert sinks.count(False) == 1 and sinks.count(True) == 3, sinks
    names = set(hidden.member_names)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad * (2 if name in names else 1), atol=1e-6, what=name)


def test_a_post_accumulate_hook_on_the_stacked_parameter_fires_after_it(sinks):
    sm, model, ref, _, linear = setup()
    hidden = linear[0]
    fired = []
    hidden.register_post_accumulate_grad_hook(lambda t: fired.append(t.grad.clone()))
    x = torch.randn(4, 7)
    sinks.clear()
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    assert sinks.count(False) == 1 and sinks.count(True) == 3, sinks
    assert_member_grads(model, ref)
    assert len(fired) == 1, "the hook fires once, after the accumulation"
    assert_close(fired[0], hidden.grad, atol=0)
