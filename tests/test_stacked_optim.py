"""Optimizers over fused groups as stacked tensors (``sm.fused_parameters()``).

Every test trains the wrapped model with an optimizer over ``fused_parameters()`` and the
plain model (the loop) with the same optimizer over its own parameters, from the same
weights on the same batches, and compares gradients and parameters step by step.
"""

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, ParallelFCN
from streamsched import optim as sso
from streamsched.passes.fusion import StackedLayoutError, StackedParameter

from .helpers import assert_close, flatten

OPTIMIZERS = {
    "sgd-momentum": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=0.01)),
    "sgd-nesterov": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "adam": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01)),
    "adam-amsgrad": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.01, amsgrad=True)),
    "adamw": (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
}

MODELS = {
    "parallel_fcn": (lambda: ParallelFCN(12), lambda: torch.randn(5, 20 * 12)),
    "critics": (lambda: CriticEnsemble(6, obs=7, hidden=9), lambda: torch.randn(4, 7)),
    "heads": (MultiTaskHeads, lambda: torch.randn(3, 64)),
}


def loss_of(out):
    return sum(t.square().mean() for t in flatten(out))


def setup(model_name, **config):
    build, make_input = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, **config)
    with torch.no_grad():
        sm(make_input())
    return sm, model, ref, make_input


def stacked_of(params):
    return [p for p in params if isinstance(p, StackedParameter)]


def assert_params_equal(model, ref, atol=1e-5, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p, q, atol=atol, what=f"{what}{name}")


def assert_grads_equal(model, ref, atol=1e-5, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if q.grad is None:
            continue
        assert p.grad is not None, f"{what}no .grad for {name}"
        assert_close(p.grad, q.grad, atol=atol, what=f"{what}{name}.grad")


def lockstep(sm, model, ref, opt, opt_ref, make_input, steps, set_to_none=True, before_step=None):
    for step in range(steps):
        x = make_input()
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        loss_of(sm(x)).backward()
        loss_of(ref(x)).backward()
        if before_step is not None:
            before_step(model, ref)
        assert_grads_equal(model, ref, what=f"step {step}: ")
        opt.step()
        opt_ref.step()
        assert_params_equal(model, ref, what=f"after step {step}: ")


# --- what fused_parameters() returns ------------------------------------------------------


def test_fused_parameters_are_the_stacked_storage_of_the_members():
    sm, model, _, _ = setup("heads")
    params = sm.fused_parameters()
    stacked = stacked_of(params)
    assert stacked, "MultiTaskHeads has fused heads"
    held = {id(m) for s in stacked for m in s.members}
    loose = [p for p in params if not isinstance(p, StackedParameter)]
    # Every parameter exactly once: either as itself or inside one stacked parameter.
    assert {id(p) for p in loose} | held == {id(p) for p in model.parameters()}
    assert not {id(p) for p in loose} & held
    assert sum(s.numel() for s in stacked) + sum(p.numel() for p in loose) == sum(p.numel() for p in model.parameters())
    for s in stacked:
        assert s.is_leaf and s.requires_grad and s.active
        for i, m in enumerate(s.members):
            # The member's values are its slice of the stacked parameter, in the same memory.
            assert m.data_ptr() == s.member_slice(s, i).data_ptr()
    # The same objects every time (an optimizer built earlier stays valid).
    assert [id(p) for p in sm.fused_parameters()] == [id(p) for p in params]
    # Planning order: model.parameters() order with each group at its first member.
    first = {
        id(s): min(i for i, p in enumerate(model.parameters()) if id(p) in {id(m) for m in s.members}) for s in stacked
    }
    assert sorted(first.values()) == [first[id(s)] for s in stacked]


def test_fused_parameters_before_the_first_call_says_to_call_once():
    sm = ss.StreamScheduledModule(ParallelFCN(4))
    with pytest.raises(RuntimeError, match="call the wrapped model once"):
        sm.fused_parameters()


def test_an_untraceable_model_has_nothing_to_stack():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(3, 2) for _ in range(4))

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return torch.cat([h(x) for h in self.heads], 1)
            return torch.cat([h(-x) for h in self.heads], 1)

    model = Branchy()
    sm = ss.StreamScheduledModule(model, strict=False)
    sm(torch.randn(2, 3))
    assert sm.plan.mode == "eager-dispatch" and not sm.plan.fused_groups  # its own forward: nothing fused
    assert [id(p) for p in sm.fused_parameters()] == [id(p) for p in model.parameters()]


def test_a_stacked_step_is_a_few_tensors_not_one_per_member():
    sm, model, _, make_input = setup("parallel_fcn")
    params = sm.fused_parameters()
    assert len(params) == 4 and all(isinstance(p, StackedParameter) for p in params)
    assert len(list(model.parameters())) == 48
    # The stacked gradient arrives through one AccumulateGrad per stacked parameter, and
    # none per member.
    for _ in range(2):  # the first call of a signature runs the model as written
        out = sm(make_input())
    leaves = _accumulated_leaves(loss_of(out))
    assert {id(p) for p in params} <= leaves
    assert not leaves & {id(p) for p in model.parameters()}
    assert {st.grad_handoff for st in sm._ss.fusion._stacks.values()} == {"stacked"}


def _accumulated_leaves(loss):
    seen, todo, leaves = set(), [loss.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if hasattr(fn, "variable"):
            leaves.add(id(fn.variable))
        todo.extend(f for f, _ in fn.next_functions)
    return leaves


# --- steps equal the loop -------------------------------------------------------------------


@pytest.mark.parametrize("model_name", sorted(MODELS))
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
def test_stacked_steps_equal_per_member_steps(model_name, opt_name):
    sm, model, ref, make_input = setup(model_name)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(sm.fused_parameters(), **kw)
    opt_ref = cls(ref.parameters(), **kw)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=5)


@pytest.mark.parametrize(
    "cls, kw",
    [
        (torch.optim.RMSprop, dict(lr=0.01, momentum=0.5, weight_decay=0.01)),
        (torch.optim.Adagrad, dict(lr=0.05, weight_decay=0.01)),
        (torch.optim.NAdam, dict(lr=0.01, weight_decay=0.01)),
        (torch.optim.RAdam, dict(lr=0.01, weight_decay=0.01)),
        (torch.optim.Adamax, dict(lr=0.01, weight_decay=0.01)),
    ],
    ids=["rmsprop", "adagrad", "nadam", "radam", "adamax"],
)
def test_other_elementwise_optimizers_equal_the_loop(cls, kw):
    sm, model, ref, make_input = setup("parallel_fcn")
    lockstep(sm, model, ref, cls(sm.fused_parameters(), **kw), cls(ref.parameters(), **kw), make_input, steps=4)


def test_a_replaced_member_sends_its_group_back_to_per_member_gradients():
    sm, model, ref, make_input = setup("parallel_fcn")
    params = sm.fused_parameters()
    old = model.mlps[2].fc1.weight
    model.mlps[2].fc1.weight = nn.Parameter(old.detach().clone())
    ref.mlps[2].fc1.weight = nn.Parameter(old.detach().clone())
    x = make_input()
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    assert not params[0].active
    assert_grads_equal(model, ref)
    again = sm.fused_parameters()
    assert again[0] is not params[0] and again[0].active and again[1] is params[1]
    opt = torch.optim.SGD(again, lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=2)


@pytest.mark.parametrize("config", [{"grad_handoff": "direct"}, {"executor": "threads"}, {"fuse_params": "copy"}])
def test_stacked_steps_equal_the_loop_under_other_configs(config):
    sm, model, ref, make_input = setup("parallel_fcn", **config)
    params = sm.fused_parameters()
    if config.get("fuse_params") == "copy":
        assert not stacked_of(params), "copy mode has no aliased storage to stack"
    opt = torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.1)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=4)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_either_way_and_member_grads_are_views(set_to_none):
    sm, model, ref, make_input = setup("parallel_fcn")
    opt = torch.optim.SGD(sm.fused_parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=3, set_to_none=set_to_none)
    s = stacked_of(opt.param_groups[0]["params"])[0]
    for i, m in enumerate(s.members):
        assert m.grad.data_ptr() == s.member_slice(s.grad, i).data_ptr()
    opt.zero_grad(set_to_none=set_to_none)
    # The members read zeros (the stacked .grad stays their buffer), never stale values.
    assert s.grad is not None and not s.grad.any()
    assert all(not m.grad.any() for m in s.members)


def test_gradient_accumulation_and_model_zero_grad_equal_the_loop():
    sm, model, ref, make_input = setup("critics")
    opt = torch.optim.Adam(sm.fused_parameters(), lr=0.01)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        # The module's own zero_grad clears the members (not the stacked tensors): the
        # stale stacked gradient must not be added to.
        (model if step % 2 else sm).zero_grad()
        ref.zero_grad()
        for _ in range(2):  # two micro-batches accumulate
            x = make_input()
            loss_of(sm(x)).backward()
            loss_of(ref(x)).backward()
        assert_grads_equal(model, ref, what=f"step {step}: ")
        opt.step()
        opt_ref.step()
        assert_params_equal(model, ref, what=f"step {step}: ")


def test_members_used_outside_the_wrapper_reach_the_stacked_gradient():
    """Calling the plain model (its members, not the stacked kernels) adds into the
    members' .grad, which are views of the stacked .grad the optimizer steps."""
    sm, model, ref, make_input = setup("parallel_fcn")
    opt = torch.optim.SGD(sm.fused_parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        opt_ref.zero_grad()
        x, y = make_input(), make_input()
        (loss_of(sm(x)) + loss_of(model(y))).backward()
        (loss_of(ref(x)) + loss_of(ref(y))).backward()
        assert_grads_equal(model, ref, what=f"step {step}: ")
        opt.step()
        opt_ref.step()
        assert_params_equal(model, ref, what=f"step {step}: ")


def test_gradient_penalty_with_create_graph_equals_the_loop():
    sm, model, ref, make_input = setup("critics")
    opt = torch.optim.SGD(sm.fused_parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(2):
        opt.zero_grad()
        opt_ref.zero_grad()
        x = make_input()
        loss_of(sm(x)).backward(create_graph=True)
        loss_of(ref(x)).backward(create_graph=True)
        assert_grads_equal(model, ref, what=f"step {step}: ")
        # Differentiate through the gradient: a penalty on the first critic's gradient norm.
        pen = model.critics[0].net[0].weight.grad.square().sum()
        pen_ref = ref.critics[0].net[0].weight.grad.square().sum()
        assert_close(pen, pen_ref, atol=1e-5)
        opt.step()
        opt_ref.step()
        assert_params_equal(model, ref, what=f"step {step}: ")
    opt.zero_grad()
    s = stacked_of(opt.param_groups[0]["params"])[0]
    assert not s.grad.requires_grad and all(m.grad is not None and not m.grad.any() for m in s.members)


# --- checkpoints and switching layouts ------------------------------------------------------


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw"])
def test_optimizer_state_dict_saves_and_loads(opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    sm, model, ref, make_input = setup("parallel_fcn")
    opt = cls(sm.fused_parameters(), **kw)
    opt_ref = cls(ref.parameters(), **kw)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=3)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    # The model's checkpoint has the loop's keys.
    assert list(model.state_dict()) == list(ref.state_dict())

    # A fresh process: new model, first call, then load model and optimizer.
    torch.manual_seed(123)
    model2 = ParallelFCN(12)
    sm2 = ss.StreamScheduledModule(model2)
    with torch.no_grad():
        sm2(make_input())
    buf.seek(0)
    ckpt = torch.load(buf)
    model2.load_state_dict(ckpt["model"])
    opt2 = cls(sm2.fused_parameters(), **kw)
    opt2.load_state_dict(ckpt["opt"])
    for p, q in zip(opt2.param_groups[0]["params"], opt.param_groups[0]["params"]):
        for key, value in opt.state[q].items():
            assert_close(opt2.state[p][key], value, atol=0, what=key)
    lockstep(sm2, model2, ref, opt2, opt_ref, make_input, steps=3)


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adam", "adamw"])
def test_switching_layouts_mid_training_equals_the_loop(opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    sm, model, ref, make_input = setup("heads")
    opt_ref = cls(ref.parameters(), **kw)

    members_opt = cls(model.parameters(), **kw)
    lockstep(sm, model, ref, members_opt, opt_ref, make_input, steps=2)

    stacked_opt = cls(sm.fused_parameters(), **kw)
    sso.stack_state(members_opt, stacked_opt)
    s = stacked_of(stacked_opt.param_groups[0]["params"])[0]
    for i, m in enumerate(s.members):
        for key, value in members_opt.state[m].items():
            got = stacked_opt.state[s][key]
            assert_close(s.member_slice(got, i) if key != "step" else got, value, atol=0, what=key)
    lockstep(sm, model, ref, stacked_opt, opt_ref, make_input, steps=2)

    back_opt = cls(sso.member_parameters(sm), **kw)
    sso.unstack_state(stacked_opt, back_opt)
    assert all(p.grad_fn is None for p in model.parameters())
    lockstep(sm, model, ref, back_opt, opt_ref, make_input, steps=2)
    assert all(st.grad_handoff != "stacked" for st in sm._ss.fusion._stacks.values())

    # And into the stacked layout once more: the same stacked parameters come back.
    again = cls(sm.fused_parameters(), **kw)
    assert stacked_of(again.param_groups[0]["params"])[0] is s
    sso.stack_state(back_opt, again)
    lockstep(sm, model, ref, again, opt_ref, make_input, steps=2)


def test_stack_state_copies_hyperparameters_and_unstack_gives_them_back():
    sm, model, ref, make_input = setup("parallel_fcn")
    members_opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    loss_of(sm(make_input())).backward()
    members_opt.step()
    members_opt.param_groups[0]["lr"] = 0.003  # as a scheduler would
    stacked = torch.optim.Adam(sm.fused_parameters(), lr=1.0)
    sso.stack_state(members_opt, stacked)
    assert stacked.param_groups[0]["lr"] == 0.003 and stacked.param_groups[0]["betas"] == (0.8, 0.9)
    back = torch.optim.Adam(sso.member_parameters(sm), lr=1.0)
    sso.unstack_state(stacked, back)
    assert back.param_groups[0]["lr"] == 0.003
    for p in model.parameters():
        for key, value in members_opt.state[p].items():
            assert_close(back.state[p][key], value, atol=0, what=key)


def test_model_state_dict_and_load_state_dict_reach_the_stacked_parameters():
    sm, model, ref, make_input = setup("parallel_fcn")
    params = sm.fused_parameters()
    x = make_input()
    torch.manual_seed(7)
    other = ParallelFCN(12)
    model.load_state_dict(other.state_dict())
    s = params[0]
    assert_close(s.detach()[3], other.mlps[3].fc1.weight, atol=0)
    assert_close(sm(x), other(x), atol=1e-5)
    # Reading a member's weight reads the stack.
    with torch.no_grad():
        s[5].fill_(0.25)
    assert bool((model.mlps[5].fc1.weight == 0.25).all())


def test_moving_the_model_keeps_the_stacked_parameters():
    sm, model, ref, make_input = setup("parallel_fcn")
    params = sm.fused_parameters()
    opt = torch.optim.SGD(params, lr=0.05)
    sm.double()
    ref.double()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)

    def make64():
        return make_input().double()

    lockstep(sm, model, ref, opt, opt_ref, make64, steps=2)
    assert params[0].dtype == torch.float64 and params[0].grad.dtype == torch.float64
    assert params[0].data_ptr() == model.mlps[0].fc1.weight.data_ptr()


# --- what a stacked step cannot express ---------------------------------------------------


def test_different_lr_per_member_is_refused():
    sm, model, _, _ = setup("parallel_fcn")
    groups = [{"params": m.parameters(), "lr": 0.01 * (i + 1)} for i, m in enumerate(model.mlps)]
    with pytest.raises(
        StackedLayoutError, match=r"mlps\.0\.fc1\.weight \(lr=0\.01\) and mlps\.1\.fc1\.weight \(lr=0\.02\)"
    ):
        sm.fused_parameters(groups)
    # The per-member optimizer itself is fine; converting its state into stacks is not.
    members_opt = torch.optim.SGD([{"params": m.parameters(), "lr": 0.01 * (i + 1)} for i, m in enumerate(model.mlps)])
    stacked = torch.optim.SGD(sm.fused_parameters(), lr=0.01)
    with pytest.raises(StackedLayoutError, match="will not average"):
        sso.stack_state(members_opt, stacked)


def test_groups_with_equal_options_are_accepted_and_merged():
    sm, model, ref, make_input = setup("parallel_fcn")
    half = len(model.mlps) // 2
    groups = [
        {"params": [p for m in model.mlps[:half] for p in m.parameters()], "lr": 0.05},
        {"params": [p for m in model.mlps[half:] for p in m.parameters()], "lr": 0.05},
    ]
    fused = sm.fused_parameters(groups)
    assert len(fused) == 2 and len(fused[0]["params"]) == 4 and fused[1]["params"] == []
    opt = torch.optim.SGD(fused, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=2)


def test_a_group_split_between_grouped_and_ungrouped_members_is_refused():
    sm, model, _, _ = setup("parallel_fcn")
    with pytest.raises(StackedLayoutError, match="in no parameter group"):
        sm.fused_parameters([{"params": model.mlps[0].parameters(), "lr": 0.1}])


def test_partly_frozen_groups_are_refused_and_frozen_groups_get_no_gradient():
    sm, model, ref, make_input = setup("parallel_fcn")
    model.mlps[3].fc2.weight.requires_grad_(False)
    with pytest.raises(StackedLayoutError, match="frozen"):
        sm.fused_parameters()
    for m in list(model.mlps) + list(ref.mlps):
        m.fc2.weight.requires_grad_(False)
    params = sm.fused_parameters()
    frozen = [p for p in params if not p.requires_grad]
    assert len(frozen) == 1 and frozen[0].members[0] is model.mlps[0].fc2.weight
    opt = torch.optim.Adam(params, lr=0.01)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=2)
    assert all(m.fc2.weight.grad is None for m in model.mlps)


def test_stack_state_refuses_state_held_by_some_members_only():
    sm, model, _, make_input = setup("parallel_fcn")
    members_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    loss_of(model.mlps[0](torch.randn(2, 20))).backward()  # only member 0 has a gradient
    members_opt.step()
    stacked = torch.optim.Adam(sm.fused_parameters(), lr=0.01)
    with pytest.raises(StackedLayoutError, match="has no optimizer state"):
        sso.stack_state(members_opt, stacked)


# --- gradient clipping ----------------------------------------------------------------------


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("layout", ["stacked", "members"])
def test_clip_per_member_equals_clipping_each_member(norm_type, layout):
    sm, model, ref, make_input = setup("parallel_fcn")
    params = sm.fused_parameters() if layout == "stacked" else sso.member_parameters(sm)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    norms = []

    def clip(model_, ref_):
        # The median member norm as the limit: about half the members are clipped.
        before = [torch.nn.utils.get_total_norm([p.grad for p in m.parameters()], norm_type) for m in ref_.mlps]
        max_norm = float(torch.stack(before).median())
        got = sso.clip_grad_norm_per_member_(model_.mlps, max_norm, norm_type)
        want = torch.stack([torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm, norm_type) for m in ref_.mlps])
        assert_close(got, want, atol=1e-6, what="per-member norms")
        norms.append((want, max_norm))

    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=3, before_step=clip)
    # Some members were clipped and some were not: the test tells the two apart.
    assert all(bool((n > m * 1.01).any() and (n < m * 0.99).any()) for n, m in norms)


def test_clip_per_member_of_some_members_only():
    sm, model, ref, make_input = setup("parallel_fcn")
    sm.fused_parameters()
    x = make_input()
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    chosen = [model.mlps[i] for i in (1, 4, 7)]
    got = sso.clip_grad_norm_per_member_(chosen, 1e-4)
    want = torch.stack([torch.nn.utils.clip_grad_norm_(ref.mlps[i].parameters(), 1e-4) for i in (1, 4, 7)])
    assert_close(got, want, atol=1e-6)
    assert_grads_equal(model, ref)


def test_global_clip_over_stacked_parameters_equals_clipping_all_members_together():
    sm, model, ref, make_input = setup("critics")
    params = sm.fused_parameters()
    x = make_input()
    loss_of(sm(x)).backward()
    loss_of(ref(x)).backward()
    got = torch.nn.utils.clip_grad_norm_(params, 0.01)
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert_close(got, want, atol=1e-6)
    assert_grads_equal(model, ref)


def test_stacked_parameters_pickle_and_copy_as_plain_parameters():
    sm, _, _, _ = setup("parallel_fcn")
    s = sm.fused_parameters()[0]
    for clone in (copy.deepcopy(s), _roundtrip(s)):
        assert type(clone) is nn.Parameter
        assert_close(clone, s, atol=0)


def _roundtrip(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_training_loss_goes_down_like_the_loop():
    sm, model, ref, make_input = setup("parallel_fcn")
    opt = torch.optim.Adam(sm.fused_parameters(), lr=0.01)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=0.01)
    x = make_input()
    target = torch.randn(5, 12)
    first = float(F.mse_loss(ref(x), target))
    for _ in range(20):
        opt.zero_grad()
        opt_ref.zero_grad()
        loss = F.mse_loss(sm(x), target)
        loss_ref = F.mse_loss(ref(x), target)
        loss.backward()
        loss_ref.backward()
        opt.step()
        opt_ref.step()
    assert_close(loss, loss_ref, atol=1e-5)
    assert float(loss) < 0.5 * first


# --- on CUDA streams ----------------------------------------------------------------------


class TwoEnsembles(nn.Module):
    """Two independent ensembles (different widths), each reading its half of the input:
    branches the planner can put on separate streams."""

    def __init__(self, n=6, d=10):
        super().__init__()
        self.a = nn.ModuleList(nn.Sequential(nn.Linear(d, 128), nn.ReLU(), nn.Linear(128, 1)) for _ in range(n))
        self.b = nn.ModuleList(nn.Sequential(nn.Linear(d, 96), nn.Tanh(), nn.Linear(96, 2)) for _ in range(n))

    def forward(self, x):
        xa, xb = x[:, :10], x[:, 10:]
        return torch.cat([m(xa) for m in self.a], 1), torch.cat([m(xb) for m in self.b], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw"])
def test_stacked_steps_on_cuda_streams_equal_the_loop(opt_name):
    cls, kw = OPTIMIZERS[opt_name]
    torch.manual_seed(0)
    model = TwoEnsembles().cuda()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=2)

    def make_input():
        return torch.randn(32, 20, device="cuda")

    with torch.no_grad():
        sm(make_input())
    params = sm.fused_parameters()
    assert len(stacked_of(params)) == 8
    opt = cls(params, **kw)
    opt_ref = cls(ref.parameters(), **kw)
    for _ in range(2):
        sm(make_input())  # the training signature's first call runs the model as written
    lockstep(sm, model, ref, opt, opt_ref, make_input, steps=3)
    assert sm.plan.executor == "streams" and len({t.stream for t in sm.plan.tasks}) == 2
