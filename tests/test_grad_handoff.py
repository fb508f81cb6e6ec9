"""grad_handoff="direct": fused members' .grad written in one native call.

Every test compares against the plain model (the loop) on fresh random inputs: the
values of every .grad, how they accumulate, what zero_grad and clip_grad_norm_ see, and
where the direct path must step aside (hooks, frozen members, create_graph).
"""

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, ParallelFCN
from streamsched._native import native

from .helpers import assert_close, assert_sgd_steps_match_the_loop, flatten

pytestmark = pytest.mark.skipif(native() is None, reason="the direct hand-off needs streamsched._C")


def stacks(sm):
    return list(sm._ss.fusion._stacks.values())


def pair(model, example, **config):
    """The wrapped model past its first call (which runs the model as written), and a
    copy of the plain model with the same weights."""
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, grad_handoff="direct", **config)
    total(sm(example)).backward()
    model.zero_grad(set_to_none=True)
    return sm, ref


def total(out):
    return sum(t.square().sum() for t in flatten(out))


def assert_grads_equal(model, ref, atol=1e-5):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{name} has a .grad the loop does not"
            continue
        assert p.grad is not None, f"no .grad for {name}"
        assert p.grad.shape == p.shape and p.grad.stride() == p.stride(), name
        assert_close(p.grad, q.grad, atol=atol, what=name)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_steps_match_the_loop_with_zero_grad_and_clipping(set_to_none):
    model = ParallelFCN(24)
    x = torch.randn(6, 20 * 24)
    sm, ref = pair(model, x)
    inputs = [torch.randn(6, 20 * 24) for _ in range(4)]
    assert_sgd_steps_match_the_loop(
        sm, model, ref, inputs, set_to_none, assert_grads_equal, clip_atol=1e-6, momentum=0.9
    )
    x = inputs[-1]
    assert {s.grad_handoff for s in stacks(sm)} == {"direct"}
    assert any("grad_handoff='direct'" in note for note in sm.plan.notes)
    assert_close(sm(x), ref(x), atol=1e-5)


def test_gradients_accumulate_over_backwards_as_in_the_loop():
    model = ParallelFCN(12)
    sm, ref = pair(model, torch.randn(4, 240))
    for _ in range(3):  # the second and third backward take the one-add fast path
        x = torch.randn(4, 240)
        sm(x).sum().backward()
        ref(x).sum().backward()
    assert_grads_equal(model, ref)
    # A .grad replaced by the user is accumulated into member by member, not lost.
    model.mlps[3].fc1.weight.grad = torch.ones(10, 20)
    ref.mlps[3].fc1.weight.grad = torch.ones(10, 20)
    model.mlps[5].fc2.bias.grad = None
    ref.mlps[5].fc2.bias.grad = None
    x = torch.randn(4, 240)
    sm(x).sum().backward()
    ref(x).sum().backward()
    assert_grads_equal(model, ref)


def test_retain_graph_second_backward_accumulates_twice():
    model = ParallelFCN(8)
    x = torch.randn(3, 160)
    sm, ref = pair(model, x)
    for m in (sm, ref):
        loss = m(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert_grads_equal(model, ref)


def test_member_grads_are_slices_of_one_buffer():
    model = ParallelFCN(16)
    sm, _ = pair(model, torch.randn(2, 320))
    sm(torch.randn(2, 320)).sum().backward()
    weights = [m.fc1.weight for m in model.mlps]
    storages = {w.grad.untyped_storage().data_ptr() for w in weights}
    assert len(storages) == 1, "the hand-off writes views of one buffer"
    base = weights[0].grad.data_ptr()
    assert [w.grad.data_ptr() - base for w in weights] == [i * 200 * 4 for i in range(16)]


def test_frozen_members_get_no_gradient():
    model = ParallelFCN(10)
    for p in model.mlps[4].parameters():
        p.requires_grad_(False)
    x = torch.randn(5, 200)
    sm, ref = pair(model, x)
    sm(x).sum().backward()
    ref(x).sum().backward()
    assert all(p.grad is None for p in model.mlps[4].parameters())
    assert_grads_equal(model, ref)


def test_hooked_members_go_through_autograd_and_their_hooks_fire():
    model = ParallelFCN(10)
    x = torch.randn(5, 200)
    sm, ref = pair(model, x)
    assert {s.grad_handoff for s in stacks(sm)} == {"direct"}
    seen = []
    model.mlps[2].fc1.weight.register_hook(lambda g: seen.append("pre") or g * 2)
    model.mlps[7].fc2.bias.register_post_accumulate_grad_hook(lambda p: seen.append("post"))
    ref.mlps[2].fc1.weight.register_hook(lambda g: g * 2)
    for m in (model, ref):
        m.zero_grad()
    x = torch.randn(5, 200)
    sm(x).sum().backward()
    ref(x).sum().backward()
    assert sorted(seen) == ["post", "pre"]
    assert_grads_equal(model, ref)
    handoffs = {s.owners[0][1]: s.grad_handoff for s in stacks(sm)}
    assert "autograd" in handoffs.values(), handoffs


@pytest.mark.filterwarnings(r"ignore:Using backward\(\) with create_graph=True")
def test_create_graph_keeps_the_graph_for_a_gradient_penalty():
    model = ParallelFCN(6)
    x = torch.randn(4, 120)
    sm, ref = pair(model, x)
    for m, inner in ((sm, model), (ref, ref)):
        m(x).square().sum().backward(create_graph=True)
        penalty = sum(p.grad.square().sum() for p in inner.parameters())
        inner.zero_grad(set_to_none=True)
        penalty.backward()
    assert_grads_equal(model, ref, atol=1e-4)


def test_concatenated_and_shared_input_groups():
    for make, shape in ((lambda: MultiTaskHeads(), (4, 64)), (lambda: CriticEnsemble(5), (7, 23))):
        torch.manual_seed(0)
        model = make()
        x = torch.randn(*shape)
        sm, ref = pair(model, x)
        total(sm(x)).backward()
        total(ref(x)).backward()
        assert sm.plan.fused_groups
        assert_grads_equal(model, ref)


def test_naming_members_in_autograd_grad_or_backward_inputs_is_refused_loudly():
    model = ParallelFCN(4)
    sm, _ = pair(model, torch.randn(2, 80))
    params = list(model.parameters())
    for ask in (
        lambda out: torch.autograd.grad(out, params),
        lambda out: torch.autograd.grad(out, params, allow_unused=True),
        lambda out: out.backward(inputs=params),
    ):
        with pytest.raises(RuntimeError, match="grad_handoff='direct'.*grad_handoff='autograd'"):
            ask(sm(torch.randn(2, 80)).sum())
    # The wrapper is fine afterwards, and asking about the input alone is not refused.
    x = torch.randn(2, 80, requires_grad=True)
    (gx,) = torch.autograd.grad(sm(x).square().sum(), x)
    x_ref = x.detach().clone().requires_grad_()
    (gx_ref,) = torch.autograd.grad(model(x_ref).square().sum(), x_ref)
    assert_close(gx, gx_ref)
    # The default hand-off answers all of them.
    exact = ss.StreamScheduledModule(ParallelFCN(4))
    exact(torch.randn(2, 80))
    grads = torch.autograd.grad(exact(torch.randn(2, 80)).sum(), list(exact.module.parameters()))
    assert all(g is not None for g in grads)


def test_grad_handoff_is_validated():
    with pytest.raises(ValueError, match="grad_handoff"):
        ss.StreamScheduledModule(nn.Linear(2, 2), grad_handoff="fast")


@torch.no_grad()  # as in a backward without create_graph
def test_native_hand_off_fills_accumulates_and_takes_the_one_add_path():
    members = [torch.zeros(3, 2, requires_grad=True) for _ in range(4)]
    handoff = native().GradHandOff(members, [])
    g1, g2 = torch.randn(4, 3, 2), torch.randn(4, 2, 3).transpose(1, 2)  # any strides in
    assert handoff.accumulate(g1) is False
    assert all(torch.equal(m.grad, g1[i]) and m.grad.is_contiguous() for i, m in enumerate(members))
    assert handoff.accumulate(g2) is True
    assert all(torch.equal(m.grad, g1[i] + g2[i]) for i, m in enumerate(members))
    members[2].grad = torch.ones(3, 2)  # no longer a slice of the buffer: member by member
    assert handoff.accumulate(g1) is False
    assert torch.equal(members[2].grad, 1 + g1[2])
    assert torch.equal(members[0].grad, 2 * g1[0] + g2[0])


def test_native_hand_off_of_concatenated_members_and_hook_detection():
    members = [torch.zeros(n, 5, requires_grad=True) for n in (2, 1, 3)]
    handoff = native().GradHandOff(members, [2, 1, 3])
    grad = torch.randn(6, 5)
    with torch.no_grad():
        assert handoff.accumulate(grad) is False
        assert handoff.accumulate(grad) is True
        assert handoff.accumulate(-grad) is True
    assert [m.grad.tolist() for m in members] == [grad[0:2].tolist(), grad[2:3].tolist(), grad[3:6].tolist()]
    assert not handoff.hooked()
    handle = members[1].register_hook(lambda g: g)
    assert handoff.hooked()
    handle.remove()
    assert not handoff.hooked()
    handle = members[2].register_post_accumulate_grad_hook(lambda p: None)
    assert handoff.hooked()
    handle.remove()
    assert not handoff.hooked()


def test_restacked_members_after_to_dtype_and_load_state_dict_keep_exact_grads():
    model = ParallelFCN(8)
    x = torch.randn(3, 160)
    sm, ref = pair(model, x)
    sm(x).sum().backward()
    model.double()
    ref.double()
    sm.load_state_dict(ParallelFCN(8).double().state_dict())
    ref.load_state_dict(model.state_dict())
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
    for _ in range(2):
        x = torch.randn(3, 160, dtype=torch.float64)
        sm(x).square().sum().backward()
        ref(x).square().sum().backward()
    assert all(p.grad.dtype == torch.float64 for p in model.parameters())
    assert_grads_equal(model, ref, atol=1e-10)
    assert {s.grad_handoff for s in stacks(sm)} == {"direct"}
