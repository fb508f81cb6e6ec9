"""Which parameters of fused members get a gradient, and what optimizers then do with it,
against eager PyTorch over several optimizer steps.

A fused group computes its members in one kernel and hands each member its slice of one
stacked gradient. Eager leaves ``.grad`` as ``None`` on a parameter whose output reaches
no loss (an unused head of a multi-task model, a detached branch) and optimizers skip such
a parameter, where a ``.grad`` of zeros is still stepped by weight decay and momentum. So
the tests compare, after every backward, *which* parameters have a gradient as well as
the values, and the parameters after every step.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import MultiTaskHeads
from streamsched.passes.fusion.member_use import gated_stack
from streamsched.testing import assert_path

from .helpers import assert_close, flatten

D = 8


class Heads(nn.Module):
    """A trunk and four identical MLP heads (fused: two batched Linears and a ReLU);
    returns every head's output."""

    def __init__(self, k: int = 4):
        super().__init__()
        self.trunk = nn.Linear(D, D)
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(k))

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        return tuple(head(h) for head in self.heads)


class HeadsSummed(Heads):
    """The heads' outputs consumed inside the forward: some of them only."""

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        outs = [head(h) for head in self.heads]
        return outs[0] + 2 * outs[2], outs[3].detach()


class WideHeads(nn.Module):
    """Heads of different widths reading one tensor: one wide Linear, split per head."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(D, D)
        self.heads = nn.ModuleList(nn.Linear(D, w) for w in (3, 5, 2, 4))

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return tuple(head(h) for head in self.heads)


class SelectedHeads(nn.Module):
    """A second fused layer reading the first one's members in another order (the first
    layer's output is read through a member selection, not unstacked)."""

    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.second = nn.ModuleList(nn.Linear(D, 2) for _ in range(3))

    def forward(self, x):
        a = [m(x[:, i * D : (i + 1) * D]) for i, m in enumerate(self.first)]
        return tuple(self.second[i](torch.relu(a[j])) for i, j in enumerate((2, 0, 1)))


class WideThenShared(nn.Module):
    """Heads of different widths, concatenated (a view of their wide kernel's output), read
    whole by four towers (a second group with a shared input): every head reaches every
    tower, so a loss on any tower reaches all heads."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, w) for w in (3, 5, 2, 4))
        self.towers = nn.ModuleList(nn.Linear(14, 2) for _ in range(4))

    def forward(self, x):
        h = torch.cat([head(x) for head in self.heads], 1)
        return tuple(tower(h) for tower in self.towers)


class BrokenChains(nn.Module):
    """Two-layer heads fused as two groups with ops between them that are not fused (each
    hidden value concatenated with a slice of itself): the second group is entered by a
    ``torch.stack`` of its members' inputs, whose backward handed a zero slice to the
    first layer of every head the loss did not reach (a ``.grad`` of zeros there)."""

    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(D, 6) for _ in range(4))
        self.second = nn.ModuleList(nn.Linear(8, 3) for _ in range(4))

    def forward(self, x):
        hs = [torch.sigmoid(layer(x)) for layer in self.first]
        return tuple(layer(torch.cat([h, h[:, :2]], 1)) for layer, h in zip(self.second, hs))


class MixedHeads(nn.Module):
    """Four alike two-layer heads beside one of another width, all reading one tensor:
    the first layers are one wide Linear, and the alike heads' ReLUs one kernel reading
    the consecutive part of its output that is theirs (a narrow of it, no copy), then one
    batched Linear. ``other_first``: the other head is called first (the alike heads'
    part starts past its columns)."""

    def __init__(self, other_first: bool = False):
        super().__init__()
        self.other_first = other_first
        self.trunk = nn.Linear(D, D)
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(4))
        self.other = nn.Sequential(nn.Linear(D, 5), nn.Tanh(), nn.Linear(5, 3))

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        if self.other_first:
            other = self.other(h)
            return (*(head(h) for head in self.heads), other)
        return (*(head(h) for head in self.heads), self.other(h))


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[], torch.Tensor]]] = {
    "heads": (Heads, lambda: torch.randn(5, D)),
    "heads_summed": (HeadsSummed, lambda: torch.randn(5, D)),
    "wide_heads": (WideHeads, lambda: torch.randn(5, D)),
    "selected_heads": (SelectedHeads, lambda: torch.randn(5, 3 * D)),
    "wide_then_shared": (WideThenShared, lambda: torch.randn(5, D)),
    "multitask": (lambda: MultiTaskHeads(d_in=12, trunk=16, widths=(3, 1, 4)), lambda: torch.randn(4, 12)),
    "broken_chains": (BrokenChains, lambda: torch.randn(5, D)),
    "mixed_heads": (MixedHeads, lambda: torch.randn(5, D)),
    "mixed_heads_other_first": (lambda: MixedHeads(other_first=True), lambda: torch.randn(5, D)),
}

OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "sgd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.05)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}

EXECUTORS: dict[str, dict[str, Any]] = {
    "auto": {},  # the trial times the backward with hooks on every parameter
    "serial": {"executor": "serial"},
    "threads": {"executor": "threads", "num_streams": 3, "min_task_cost": 0.0},
    "direct": {"executor": "serial", "grad_handoff": "direct"},
}

# Which outputs the loss reads, per step: the set changes from step to step.
USED = [(0,), (1, 2), (), (0, 1, 2, 3), (2,), (3, 0)]


def _outputs(out: Any) -> list[torch.Tensor]:
    return flatten(out)


def loss_of(out: Any, used: tuple[int, ...]) -> torch.Tensor:
    outs = _outputs(out)
    picked = [outs[i % len(outs)] for i in used if outs[i % len(outs)].requires_grad]
    if not picked:  # nothing picked: a loss that reaches no head (the trunk's own term)
        return None  # type: ignore[return-value]
    return sum((t.square().mean() * (k + 1) for k, t in enumerate(picked)), torch.zeros(()))


def make(name: str, **config: Any) -> tuple[ss.StreamScheduledModule, nn.Module, nn.Module]:
    build, _ = MODELS[name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    return ss.StreamScheduledModule(model, **config), model, ref


def fused_members(sm: ss.StreamScheduledModule) -> set[str]:
    return {m for g in sm.plan.fused_groups for m in g.members}


def assert_grads_as_eager(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), (
            f"{what}: {n}.grad is {'None' if p.grad is None else 'set'} where eager's is "
            f"{'None' if q.grad is None else 'set'}"
        )
        if q.grad is not None:
            assert_close(p.grad, q.grad, what=f"{what}: {n}.grad")


def assert_params_as_eager(model: nn.Module, ref: nn.Module, what: str) -> None:
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, atol=1e-5, what=f"{what}: {n}")


def train_steps(
    name: str, executor: str, optimizer: str, used_per_step=USED, set_to_none: bool = True
) -> tuple[ss.StreamScheduledModule, nn.Module, nn.Module]:
    sm, model, ref = make(name, **EXECUTORS[executor])
    cls, options = OPTIMIZERS[optimizer]
    opt, opt_ref = cls(model.parameters(), **options), cls(ref.parameters(), **options)
    _, make_input = MODELS[name]
    for step, used in enumerate(used_per_step):
        what = f"{name}/{executor}/{optimizer} step {step} (outputs {used})"
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        x = make_input()
        out, expected = sm(x), ref(x)
        assert_path(sm, *(("recorded",) if step == 0 else ("plan", "as-written") if executor == "auto" else ("plan",)))
        assert_close(out, expected, what=f"{what}: outputs")
        loss, loss_ref = loss_of(out, used), loss_of(expected, used)
        if loss_ref is not None:
            loss_ref.backward()
            loss.backward()
        assert_grads_as_eager(model, ref, what)
        opt.step()
        opt_ref.step()
        assert_params_as_eager(model, ref, what)
    return sm, model, ref


@pytest.mark.parametrize("executor", list(EXECUTORS))
@pytest.mark.parametrize("name", list(MODELS))
def test_unused_members_have_no_gradient_as_in_eager(name, executor):
    sm, model, ref = train_steps(name, executor, "sgd")
    assert fused_members(sm), f"{name}: nothing fused"


@pytest.mark.parametrize("name", ["mixed_heads", "mixed_heads_other_first"])
def test_alike_heads_beside_another_read_their_part_of_the_wide_output(name):
    # The alike heads' activations are one kernel (not four module calls and a copy of
    # their outputs into a stack), their gradients still reach only the heads a loss
    # reached (test_unused_members_have_no_gradient_as_in_eager runs these models too).
    sm, _, _ = train_steps(name, "serial", "sgd")
    kinds = sorted((g.kind, g.size) for g in sm.plan.fused_groups)
    assert kinds == [("Linear", 4), ("Linear", 5), ("ReLU", 4)], kinds
    assert not sm.plan.unfused, sm.plan.unfused
    program = sm._ss.last.program
    called = set(map(id, program.call.__globals__.values()))
    assert id(torch.stack) not in called and id(gated_stack) not in called, "the heads' values were stacked"


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizers_skip_unused_members_as_in_eager(optimizer):
    train_steps("heads", "serial", optimizer)
    train_steps("wide_heads", "serial", optimizer)


def test_zero_grad_without_none_steps_as_eager():
    # set_to_none=False: every parameter holds zeros after the first step, in both.
    train_steps("heads", "serial", "sgd", set_to_none=False)
    train_steps("wide_heads", "serial", "adam", set_to_none=False)


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_gradients_accumulate_over_calls_using_different_heads(executor):
    sm, model, ref = make("heads", **EXECUTORS[executor])
    cls, options = OPTIMIZERS["adamw"]
    opt, opt_ref = cls(model.parameters(), **options), cls(ref.parameters(), **options)
    sm(torch.randn(5, D))  # the recording call
    for step, parts in enumerate([[(0,), (1,)], [(2,), ()], [(3,), (3,), (0, 1)]]):
        opt.zero_grad()
        opt_ref.zero_grad()
        for k, used in enumerate(parts):
            x = torch.randn(5, D)
            out, expected = sm(x), ref(x)
            assert_path(sm, "plan")
            if used:
                loss_of(expected, used).backward()
                loss_of(out, used).backward()
            assert_grads_as_eager(model, ref, f"step {step} backward {k}")
        opt.step()
        opt_ref.step()
        assert_params_as_eager(model, ref, f"step {step}")


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_a_gradient_set_by_hand_is_kept_or_added_to(executor):
    sm, model, ref = make("heads", **EXECUTORS[executor])
    sm(torch.randn(5, D))
    x = torch.randn(5, D)
    for m in (model, ref):
        torch.manual_seed(3)
        for head in m.heads[:2]:
            head[0].weight.grad = torch.randn_like(head[0].weight)
    loss_of(sm(x), (1, 2)).backward()  # head 0's gradient stays as set, head 1's adds
    loss_of(ref(x), (1, 2)).backward()
    assert_path(sm, "plan")
    assert_grads_as_eager(model, ref, "hand-set .grad")


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_clip_grad_norm_sees_the_same_gradients(executor):
    sm, model, ref = make("heads", **EXECUTORS[executor])
    sm(torch.randn(5, D))
    for step, used in enumerate([(0, 2), (3,), (1,)]):
        model.zero_grad()
        ref.zero_grad()
        x = torch.randn(5, D)
        loss_of(sm(x), used).backward()
        loss_of(ref(x), used).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        norm_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert_close(norm, norm_ref, what=f"step {step}: norm")
        assert_grads_as_eager(model, ref, f"step {step} clipped")


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_member_parameter_hooks_fire_once_with_the_members_gradient(executor):
    """Hooks of a used member fire once, with eager's gradient. A member with a gradient
    hook whose output reaches no loss gets zeros and its hooks fire with them, where eager
    neither calls them nor sets ``.grad`` (autograd would call them with None: see
    docs/training.md)."""
    sm, model, ref = make("heads", **EXECUTORS[executor])
    sm(torch.randn(5, D))
    seen: dict[str, list] = {"wrapped": [], "eager": []}
    for key, m in (("wrapped", model), ("eager", ref)):
        for i, head in enumerate(m.heads):
            head[0].weight.register_hook(lambda g, i=i, key=key: seen[key].append(("hook", i, g.clone())))
            head[2].bias.register_post_accumulate_grad_hook(
                lambda p, i=i, key=key: seen[key].append(("post", i, p.grad.clone()))
            )
    for used in [(1,), (0, 3), ()]:
        seen["wrapped"].clear()
        seen["eager"].clear()
        x = torch.randn(5, D)
        out, expected = sm(x), ref(x)
        assert_path(sm, "plan")
        if used:
            loss_of(expected, used).backward()
            loss_of(out, used).backward()
        got = sorted(seen["wrapped"], key=lambda e: e[:2])
        want = sorted(seen["eager"], key=lambda e: e[:2])
        assert [e[:2] for e in want] == [(k, i) for k in ("hook", "post") for i in sorted(used)]
        fired = [(k, i) for k in ("hook", "post") for i in range(4)] if used else []
        assert [e[:2] for e in got] == fired, f"heads {used}: hooks fired {[e[:2] for e in got]}"
        expected_grads = {e[:2]: e[2] for e in want}
        for kind, i, g in got:
            if (kind, i) in expected_grads:
                assert_close(g, expected_grads[kind, i], what=f"heads {used}: {kind} {i}")
            else:
                assert not g.any(), f"heads {used}: {kind} {i} fired with nonzero values"
        for i, (head, head_ref) in enumerate(zip(model.heads, ref.heads)):
            # The member's parameters without hooks follow eager.
            assert (head[0].bias.grad is None) == (head_ref[0].bias.grad is None), f"heads {used}: head {i}"
        model.zero_grad()
        ref.zero_grad()


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_a_frozen_member_gets_no_gradient(executor):
    sm, model, ref = make("heads", **EXECUTORS[executor])
    sm(torch.randn(5, D))
    for m in (model, ref):
        m.heads[1].requires_grad_(False)
        m.heads[3][2].weight.requires_grad_(False)
    cls, options = OPTIMIZERS["sgd"]
    opt, opt_ref = cls(model.parameters(), **options), cls(ref.parameters(), **options)
    for step, used in enumerate([(0, 1), (1, 3), (2,), (0, 1, 2, 3)]):
        x = torch.randn(5, D)
        out, expected = sm(x), ref(x)
        assert_path(sm, "plan", "recorded")
        loss_of(expected, used).backward()
        loss_of(out, used).backward()
        assert_grads_as_eager(model, ref, f"step {step}")
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
        assert_params_as_eager(model, ref, f"step {step}")


def test_autograd_grad_of_member_parameters_as_eager():
    sm, model, ref = make("heads", executor="serial")
    sm(torch.randn(5, D))
    x = torch.randn(5, D)
    params, params_ref = list(model.heads.parameters()), list(ref.heads.parameters())
    out, expected = sm(x), ref(x)
    assert_path(sm, "plan")
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(loss_of(expected, (1,)), params_ref)
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        torch.autograd.grad(loss_of(out, (1,)), params)
    out, expected = sm(x), ref(x)
    got = torch.autograd.grad(loss_of(out, (1, 2)), params, allow_unused=True)
    want = torch.autograd.grad(loss_of(expected, (1, 2)), params_ref, allow_unused=True)
    assert [g is None for g in got] == [g is None for g in want]
    for g, w in zip(got, want):
        if w is not None:
            assert_close(g, w)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("executor", ["serial", "direct"])
def test_retain_graph_then_another_head(executor):
    sm, model, ref = make("heads", **EXECUTORS[executor])
    sm(torch.randn(5, D))
    x = torch.randn(5, D)
    out, expected = sm(x), ref(x)
    assert_path(sm, "plan")
    for used in [(0,), (2,), (0, 2)]:
        loss_of(expected, used).backward(retain_graph=True)
        loss_of(out, used).backward(retain_graph=True)
        assert_grads_as_eager(model, ref, f"heads {used}")


def test_gradient_penalty_through_some_heads():
    """Double backward: the penalty differentiates the input gradient of heads 0 and 1,
    the task loss reads heads 0 to 2: head 3 gets no gradient, in both passes."""
    sm, model, ref = make("heads", executor="serial")
    sm(torch.randn(5, D, requires_grad=True))
    for step in range(2):
        grads = []
        for m, wrapped in ((sm, True), (ref, False)):
            x = torch.randn(5, D, generator=torch.Generator().manual_seed(step)).requires_grad_()
            out = m(x)
            if wrapped:
                assert_path(sm, "plan")
            (gx,) = torch.autograd.grad(out[0].sum() + out[1].square().sum(), x, create_graph=True)
            (gx.square().sum() + sum(out[i].square().mean() for i in range(3))).backward()
            grads.append(x.grad)
        assert_grads_as_eager(model, ref, f"step {step}")
        assert model.heads[3][0].weight.grad is None
        assert_close(grads[0], grads[1], what=f"step {step}: input gradient")
        model.zero_grad()
        ref.zero_grad()


def test_after_create_graph_later_backwards_reach_every_member_an_earlier_one_reached():
    """The documented approximation: once a backward through a forward had
    ``create_graph=True``, a later one through it hands every member an earlier one
    reached a gradient (zeros where eager, which knows the second-order graph misses the
    last layer's bias, has none); members no backward reached still get none."""
    sm, model, ref = make("heads", executor="serial")
    sm(torch.randn(5, D, requires_grad=True))
    x = torch.randn(5, D).requires_grad_()
    out = sm(x)
    assert_path(sm, "plan")
    (gx,) = torch.autograd.grad(out[0].sum(), x, create_graph=True)
    (gx.square().sum() + out[2].square().mean()).backward()
    assert model.heads[0][2].bias.grad is not None and not model.heads[0][2].bias.grad.any()
    assert model.heads[0][0].weight.grad is not None and model.heads[0][0].weight.grad.any()
    assert all(p.grad is None for p in model.heads[1].parameters())
    assert all(p.grad is None for p in model.heads[3].parameters())


def test_fused_parameters_step_an_unused_member_with_its_group():
    """With ``fused_parameters()`` a group is one tensor with one ``.grad``: a member the
    loss does not reach reads zeros (a view of the stacked gradient) and is stepped with
    its group (documented in docs/training.md), where the loop leaves it untouched."""
    sm, model, ref = make("heads", executor="serial")
    with torch.no_grad():
        sm(torch.randn(5, D))
    cls, options = OPTIMIZERS["sgd"]
    opt, opt_ref = cls(sm.fused_parameters(), **options), cls(ref.parameters(), **options)
    sm(torch.randn(5, D))  # the recording call with autograd on
    x = torch.randn(5, D)
    loss_of(sm(x), (1,)).backward()
    assert_path(sm, "plan")
    loss_of(ref(x), (1,)).backward()
    unused, unused_ref = model.heads[0][0].weight, ref.heads[0][0].weight
    assert unused_ref.grad is None
    assert unused.grad is not None and not unused.grad.any()
    assert_close(model.heads[1][0].weight.grad, ref.heads[1][0].weight.grad)
    before = unused.detach().clone()
    opt.step()
    opt_ref.step()
    assert torch.equal(unused_ref, before)
    assert not torch.equal(unused, before)  # weight decay moved it
    assert_close(model.heads[1][0].weight, ref.heads[1][0].weight)


def _train_used_heads(sm: ss.StreamScheduledModule, model: nn.Module, ref: nn.Module, what: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9, weight_decay=0.05)
    for step, used in enumerate(USED):
        opt.zero_grad()
        opt_ref.zero_grad()
        x = torch.randn(5, D)
        out, expected = sm(x), ref(x)
        assert_path(sm, "recorded" if step == 0 else "plan")
        assert_close(out, expected, what=f"{what} step {step}: outputs")
        loss, loss_ref = loss_of(out, used), loss_of(expected, used)
        if loss_ref is not None:
            loss_ref.backward()
            loss.backward()
        assert_grads_as_eager(model, ref, f"{what} step {step} (outputs {used})")
        opt.step()
        opt_ref.step()
        assert_params_as_eager(model, ref, f"{what} step {step}")


@pytest.mark.parametrize("first", ["kept", "dropped"])
def test_a_model_wrapped_again_gives_unused_members_no_gradient(first):
    """The first wrapper moved the members' storage into its stack; the second one reads
    that stack (first kept) or re-stacks them (first dropped): gradients as in eager
    (tests/test_wrapped_again.py covers both wrappers used in turn)."""
    torch.manual_seed(0)
    model = Heads()
    ref = copy.deepcopy(model)
    earlier = ss.StreamScheduledModule(model, executor="serial")
    earlier(torch.randn(5, D))
    if first == "dropped":
        del earlier
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_used_heads(sm, model, ref, f"wrapped again, the first wrapper {first}")
    assert fused_members(sm)
    assert all(s.alias and s.live for s in sm.__dict__["_ss"].fusion._stacks.values())


class TiedHeads(Heads):
    """Heads 0 and 1 share their first layer's weight: no stack can alias it (copy mode)."""

    def __init__(self):
        super().__init__()
        self.heads[1][0].weight = self.heads[0][0].weight


def test_tied_members_get_a_gradient_when_either_use_is_reached():
    torch.manual_seed(0)
    model = TiedHeads()
    ref = copy.deepcopy(model)
    assert ref.heads[1][0].weight is ref.heads[0][0].weight
    sm = ss.StreamScheduledModule(model, executor="serial")
    _train_used_heads(sm, model, ref, "tied weights")
    assert fused_members(sm)


class RetainsHidden(nn.Module):
    """``retain_grad()`` inside the forward on the heads' hidden values (every head's, or
    one head's), returned for the caller to read ``.grad``."""

    def __init__(self, every: bool):
        super().__init__()
        self.every = every
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(4))

    def forward(self, x):
        hidden = [head[1](head[0](x)) for head in self.heads]
        for h in hidden if self.every else hidden[1:2]:
            h.retain_grad()
        outs = [head[2](h) for head, h in zip(self.heads, hidden)]
        return torch.stack(outs), hidden if self.every else hidden[1]


@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("every", [True, False], ids=["every-head", "one-head"])
def test_retained_gradients_of_fused_members_as_eager(every, executor):
    """The backward passes through the very tensor ``retain_grad()`` was called on, as in
    eager: the next layer's kernel read the members' stacked value around it (``.grad``
    was ``None``, or held only the caller's share)."""
    torch.manual_seed(0)
    model, ref = RetainsHidden(every), RetainsHidden(every)
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(3):
        x = torch.randn(5, D)
        out, hidden = sm(x)
        path = assert_path(sm, "recorded", "plan")
        expected, hidden_ref = ref(x)
        loss = out.square().sum() + sum(h.sum() for h in flatten(hidden))
        loss_ref = expected.square().sum() + sum(h.sum() for h in flatten(hidden_ref))
        loss.backward()
        loss_ref.backward()
        for i, (h, h_ref) in enumerate(zip(flatten(hidden), flatten(hidden_ref))):
            assert h.grad is not None, f"call {call} ({path}): hidden {i} retained no gradient"
            assert_close(h.grad, h_ref.grad, what=f"call {call} ({path}): retained gradient of hidden {i}")
        assert_close(out, expected, what=f"call {call} ({path}): outputs")
        if call > 0:
            assert sm.plan.fused_groups, "the heads' other layers were meant to be fused"


class ReturnsHidden(nn.Module):
    """The heads' hidden values returned beside the outputs (a Grad-CAM's features)."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 16), nn.ReLU(), nn.Linear(16, 3)) for _ in range(4))

    def forward(self, x):
        hidden = [head[1](head[0](x)) for head in self.heads]
        return torch.stack([head[2](h) for head, h in zip(self.heads, hidden)]), hidden


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_returned_members_are_the_tensors_the_backward_passes_through(executor):
    """The caller retains the gradient of (or hooks) the hidden values it got, then runs
    the backward of the outputs alone: eager's backward passes through them. The plan's
    were copies beside the next layer's kernel, which read the group's stacked output:
    no gradient, no hook call."""
    torch.manual_seed(0)
    model, ref = ReturnsHidden(), ReturnsHidden()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(3):
        x = torch.randn(5, D)
        seen: dict[str, list] = {"plan": [], "eager": []}
        results = {}
        for name, module in (("plan", sm), ("eager", ref)):
            out, hidden = module(x)
            if name == "plan":
                path = assert_path(sm, "recorded", "plan")
            for h in hidden:
                h.retain_grad()
            hidden[2].register_hook(lambda g, got=seen[name]: got.append(g.clone()))
            out.square().sum().backward()
            results[name] = (out, hidden)
        (out, hidden), (expected, hidden_ref) = results["plan"], results["eager"]
        assert_close(out, expected, what=f"call {call} ({path}): outputs")
        for i, (h, h_ref) in enumerate(zip(hidden, hidden_ref)):
            assert h.grad is not None, f"call {call} ({path}): returned hidden {i} got no gradient"
            assert_close(h.grad, h_ref.grad, what=f"call {call} ({path}): gradient of returned hidden {i}")
        assert len(seen["plan"]) == len(seen["eager"]) == 1, f"call {call} ({path}): hook calls"
        assert_close(seen["plan"], seen["eager"], what=f"call {call} ({path}): the hook's gradient")
        if call > 0:
            assert sm.plan.fused_groups, "the heads were meant to be fused"


class HeadsOnOwnInputs(nn.Module):
    """Heads each reading an input of its own: the group is entered by a ``torch.stack``
    of the inputs."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, 3) for _ in range(3))

    def forward(self, xs):
        return [head(x) for head, x in zip(self.heads, xs)]


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_inputs_of_unused_members_have_no_gradient_as_in_eager(executor):
    """Eager's backward never reaches the input of a head the loss does not read (its
    ``.grad`` stays ``None``); the stack entering the fused heads handed it zeros. A
    second backward through the same graph (``retain_graph``) reaching another head
    gives that head's input its gradient, as in eager."""
    torch.manual_seed(0)
    model = HeadsOnOwnInputs()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call, (used, then) in enumerate([((0, 1, 2), 0), ((1,), 0), ((0, 2), 1), ((2,), 2)]):
        xs = [torch.randn(4, D, requires_grad=True) for _ in range(3)]
        xs_ref = [x.detach().clone().requires_grad_() for x in xs]
        out, expected = sm(xs), ref(xs_ref)
        path = assert_path(sm, "recorded" if call == 0 else "plan")
        for outs in (out, expected):
            sum(outs[i].square().sum() for i in used).backward(retain_graph=True)
            outs[then].sum().backward()
        for i, (x, x_ref) in enumerate(zip(xs, xs_ref)):
            what = f"call {call} ({path}), loss on heads {used} then {then}: input {i}"
            got, want = ("None" if g is None else "set" for g in (x.grad, x_ref.grad))
            assert got == want, f"{what}: .grad {got} where eager's is {want}"
            if x_ref.grad is not None:
                assert_close(x.grad, x_ref.grad, what=what)
        assert_grads_as_eager(model, ref, f"call {call} ({path})")
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert fused_members(sm), "the heads were meant to be fused"
