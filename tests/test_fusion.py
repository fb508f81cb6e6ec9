import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, ParallelFCN
from streamsched.passes.fusion.kernels import FusedKernel
from streamsched.testing import assert_path

from .helpers import assert_close, assert_sgd_steps_match_the_loop, called_on, check_against_eager

# Fusion mechanics on small groups: vmap kernels where they would not pay too.
pytestmark = pytest.mark.usefixtures("vmap_any_size")


def kernels(sm):
    return [n.target for n in sm._ss.last.graph.nodes if isinstance(n.target, FusedKernel)]


def ops(sm):
    return [
        getattr(n.target, "__name__", str(n.target))
        for n in sm._ss.last.graph.nodes
        if n.op in ("call_function", "call_method", "call_module")
    ]


class Members(nn.Module):
    """``n`` copies of ``make()``, each on its own slice (``mode="slice"``), all on the same
    input (``"shared"``), or on separately computed inputs (``"separate"``); concatenated."""

    def __init__(self, make, n=4, mode="slice", width=8, dim=1):
        super().__init__()
        self.members = nn.ModuleList(make() for _ in range(n))
        self.mode, self.width, self.dim = mode, width, dim

    def forward(self, x):
        outs = []
        for i, m in enumerate(self.members):
            if self.mode == "slice":
                part = x[(slice(None),) * self.dim + (slice(self.width * i, self.width * (i + 1)),)]
            elif self.mode == "shared":
                part = x
            else:
                part = x * (i + 1)
            outs.append(m(part))
        return torch.cat(outs, dim=self.dim)


def test_reference_case_is_two_batched_matmuls_and_a_view():
    model = ParallelFCN(50)
    sm = check_against_eager(model, (torch.randn(3, 1000),), atol=1e-5)
    groups = sm.plan.fused_groups
    assert [(g.kind, g.size, g.kernel) for g in groups] == [
        ("Linear", 50, "baddbmm"),
        ("ReLU", 50, "ReLU once"),
        ("Linear", 50, "baddbmm"),
    ]
    names = ops(sm)
    assert "unstack" not in names and "stack" not in names and "cat" not in names
    assert names.count("cat_members") == 1


LINEAR = lambda: nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 3))  # noqa: E731
CASES = {
    "linear": (LINEAR, lambda: torch.randn(5, 32), "slice"),
    "linear_shared": (LINEAR, lambda: torch.randn(5, 8), "shared"),
    "linear_separate": (LINEAR, lambda: torch.randn(5, 8), "separate"),
    "conv1d": (
        lambda: nn.Sequential(nn.Conv1d(8, 4, 3, padding=1), nn.Tanh()),
        lambda: torch.randn(2, 32, 10),
        "slice",
    ),
    "conv2d": (
        lambda: nn.Sequential(nn.Conv2d(8, 4, 3, stride=2), nn.ReLU()),
        lambda: torch.randn(2, 32, 9, 9),
        "slice",
    ),
    "conv2d_shared": (lambda: nn.Conv2d(8, 4, 1), lambda: torch.randn(2, 8, 5, 5), "shared"),
    "conv2d_depthwise": (lambda: nn.Conv2d(8, 8, 3, padding=1, groups=8), lambda: torch.randn(2, 8, 5, 5), "shared"),
    "conv2d_reflect": (
        lambda: nn.Conv2d(8, 4, 3, padding=1, padding_mode="reflect"),
        lambda: torch.randn(2, 32, 6, 6),
        "slice",
    ),
    "batchnorm2d": (
        lambda: nn.Sequential(nn.Conv2d(8, 4, 1), nn.BatchNorm2d(4)),
        lambda: torch.randn(3, 32, 4, 4),
        "slice",
    ),
    "batchnorm1d": (lambda: nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)), lambda: torch.randn(6, 32), "slice"),
    "layernorm": (
        lambda: nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Tanh()),
        lambda: torch.randn(5, 32),
        "slice",
    ),
    "nested": (
        lambda: nn.Sequential(nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2)),
        lambda: torch.randn(4, 32),
        "slice",
    ),
}


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_members_equal_the_unfused_model(case, train):
    make, make_x, mode = CASES[case]
    model = Members(make, 4, mode).train(train)
    sm = check_against_eager(model, (make_x().requires_grad_(),), atol=1e-5, calls=3)
    assert sm.plan.fused_groups, "expected at least one fused group"
    assert all(g.size == 4 for g in sm.plan.fused_groups)


def test_batchnorm_statistics_advance_per_member():
    model = Members(lambda: nn.BatchNorm1d(8), 3, "slice").train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    for _ in range(4):
        x = torch.randn(16, 24) * torch.arange(1, 25)
        assert_close(sm(x), ref(x))
    for m_new, m_ref in zip(model.members, ref.members):
        assert_close(m_new.running_mean, m_ref.running_mean)
        assert_close(m_new.running_var, m_ref.running_var)
        assert int(m_new.num_batches_tracked) == int(m_ref.num_batches_tracked) == 4
    assert sm.plan.fused_groups[0].kind == "BatchNorm1d"


def test_dropout_in_training_draws_eager_s_masks_and_is_not_fused():
    """Members drawing masks are not fused (one kernel would draw for all of them at once):
    with the same seed each member's mask is the one eager draws."""
    model = Members(lambda: nn.Dropout(0.5), 16, "shared").train()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.ones(64, 32)
    sm(x)
    torch.manual_seed(3)
    out = sm(x)
    torch.manual_seed(3)
    assert torch.equal(out, model(x))
    masks = (out.view(64, 16, 32) == 0).transpose(0, 1).reshape(16, -1)
    assert len({tuple(m.tolist()) for m in masks}) == 16
    assert not any(g.kind == "Dropout" for g in sm.plan.fused_groups)
    assert "draws random numbers" in sm.plan.summary()
    # In eval nothing draws: the members are fused.
    model.eval()
    sm(x)
    sm(x)
    assert torch.equal(sm(x), x.repeat(1, 16)) and sm.plan.fused_groups


def test_groups_of_size_two_and_one_thousand():
    check_against_eager(Members(LINEAR, 2, "slice"), (torch.randn(3, 16),))
    sm = check_against_eager(ParallelFCN(1000), (torch.randn(2, 20000),), calls=1)
    assert sm.plan.fused_groups[0].size == 1000


def test_members_sharing_parameters_are_stacked_per_call_and_stay_exact():
    shared = nn.Linear(8, 8)
    model = Members(lambda: nn.Sequential(shared, nn.Tanh()), 4, "slice")
    sm = check_against_eager(model, (torch.randn(3, 32),))
    assert sm.plan.fused_groups


def test_unfusable_member_is_left_alone_and_correct():
    model = Members(LINEAR, 4, "slice")
    calls = []
    model.members[2][0].register_forward_hook(lambda *a: calls.append(1))
    sm = check_against_eager(model, (torch.randn(3, 32),))
    first = next(g for g in sm.plan.fused_groups if g.members[0].endswith(".0"))
    assert first.size == 3 and "members.2.0" not in first.members
    calls.clear()
    sm(torch.randn(3, 32))
    assert calls == [1]  # the hook fires once per call, as in eager


def test_inplace_activation_is_fused_only_where_no_one_else_sees_its_input():
    safe = Members(lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(inplace=True)), 4, "slice")
    sm = check_against_eager(safe, (torch.randn(3, 32),))
    assert any(g.kind == "ReLU" for g in sm.plan.fused_groups)

    class SharedInplace(nn.Module):
        def __init__(self):
            super().__init__()
            self.acts = nn.ModuleList(nn.ReLU(inplace=True) for _ in range(3))

        def forward(self, x):
            h = x * 1.0
            return torch.cat([a(h) for a in self.acts], 1)

    sm = check_against_eager(SharedInplace(), (torch.randn(3, 8),), backward=False)
    assert not any(g.kind == "ReLU" for g in sm.plan.fused_groups)


def test_split_chunk_and_unbind_inputs_become_views():
    class Parts(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ModuleList(nn.Linear(8, 4) for _ in range(4))
            self.b = nn.ModuleList(nn.Linear(8, 4) for _ in range(4))
            self.c = nn.ModuleList(nn.Linear(8, 4) for _ in range(3))

        def forward(self, x, y):
            pa = x.split(8, dim=1)
            pb = torch.chunk(x, 4, dim=1)
            pc = y.unbind(1)
            return (
                torch.stack([m(pa[i]) for i, m in enumerate(self.a)], 0),
                torch.cat([m(pb[i]) for i, m in enumerate(self.b)], 1),
                torch.stack([m(pc[i]) for i, m in enumerate(self.c)], 2),
            )

    sm = check_against_eager(Parts(), (torch.randn(5, 32), torch.randn(5, 3, 8)))
    assert [g.size for g in sm.plan.fused_groups] == [4, 4, 3]
    names = ops(sm)
    assert "stack" not in names and "unstack" not in names


def test_wide_heads_of_different_widths_read_one_tensor_once():
    model = MultiTaskHeads(widths=(3, 5, 7))
    model.heads = nn.ModuleDict({f"h{w}": nn.Linear(256, w) for w in (3, 5, 7)})
    sm = check_against_eager(model, (torch.randn(4, 64),))
    wide = [g for g in sm.plan.fused_groups if "concatenated" in g.kernel]
    assert wide and wide[0].size == 3


def test_vmap_batches_any_identical_module():
    @ss.branch
    class Gated(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return torch.sigmoid(self.a(x)) * self.b(x)

    sm = check_against_eager(Members(Gated, 4, "slice"), (torch.randn(3, 32),))
    assert [g.kernel for g in sm.plan.fused_groups] == ["vmap(functional_call)"]


def test_parameters_keep_identity_names_and_values():
    model = ParallelFCN(20)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(2, 400))
    sm(torch.randn(2, 400))
    after = dict(model.named_parameters())
    assert list(after) == list(before)
    for name, (p, value) in before.items():
        assert after[name] is p and torch.equal(p, value) and p.is_leaf
    assert list(sm.state_dict()) == list(ParallelFCN(20).state_dict())


def _fcn_pair(n=16):
    model = ParallelFCN(n)
    return model, copy.deepcopy(model), torch.randn(8, 20 * n)


def test_optimizer_step_is_seen_by_the_next_forward():
    model, ref, x = _fcn_pair()
    sm = ss.StreamScheduledModule(model)
    opts = [torch.optim.Adam(m.parameters(), lr=0.1) for m in (model, ref)]
    for _ in range(3):
        for opt in opts:
            opt.zero_grad()
        sm(x).pow(2).sum().backward()
        ref(x).pow(2).sum().backward()
        for opt in opts:
            opt.step()
        assert_close(sm(x), ref(x), atol=1e-5)


def test_reassigned_and_resized_parameters_are_never_stale():
    model, ref, x = _fcn_pair()
    sm = ss.StreamScheduledModule(model)
    sm(x)
    sm(x)
    new = nn.Parameter(torch.randn(10, 20))
    model.mlps[3].fc1.weight = new
    ref.mlps[3].fc1.weight = nn.Parameter(new.detach().clone())
    assert_close(sm(x), ref(x))
    with torch.no_grad():
        model.mlps[5].fc2.bias.data = torch.full((1,), 7.0)
        ref.mlps[5].fc2.bias.data = torch.full((1,), 7.0)
    assert_close(sm(x), ref(x))
    sm.load_state_dict(ParallelFCN(16).state_dict())
    ref.load_state_dict(model.state_dict())
    assert_close(sm(x), ref(x))


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_to_dtype_on_the_inner_model_restacks(executor):
    model, ref, x = _fcn_pair()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for path in ("recorded", "plan"):
        x = torch.randn_like(x)
        assert_close(called_on(sm, path, x), ref(x))
    assert sm.plan.fused_groups
    model.double()
    ref.double()
    # The float64 plan's kernels read float64 stacks of the (converted) members.
    for path in ("recorded", "plan", "plan"):
        x = torch.randn_like(x, dtype=torch.float64)
        assert_close(called_on(sm, path, x), ref(x), atol=1e-10, rtol=1e-10)
    assert sm.plan.fused_groups


@pytest.mark.parametrize("set_to_none", [True, False])
def test_training_step_grads_zero_grad_and_clipping_match_the_loop(set_to_none):
    model, ref, x = _fcn_pair(32)
    sm = ss.StreamScheduledModule(model)

    def grads_equal(model, ref):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_close(p.grad, q.grad, atol=1e-5, what=name)

    assert_sgd_steps_match_the_loop(sm, model, ref, [x] * 3, set_to_none, grads_equal)
    assert_close(sm(x), ref(x), atol=1e-5)


def test_ensemble_and_fuse_false():
    sm = check_against_eager(CriticEnsemble(6), (torch.randn(4, 23),))
    assert sm.plan.fused_groups
    off = ss.StreamScheduledModule(CriticEnsemble(6), fuse=False)
    off(torch.randn(4, 23))
    assert off.plan.fused_groups == []


def test_copy_mode_never_touches_parameter_storage():
    sm = check_against_eager(ParallelFCN(8), (torch.randn(2, 160),), fuse_params="copy")
    assert sm.plan.fused_groups
    fresh = ParallelFCN(8)
    ptrs = [p.data_ptr() for p in fresh.parameters()]
    sm = ss.StreamScheduledModule(fresh, fuse_params="copy")
    sm(torch.randn(2, 160))
    sm(torch.randn(2, 160))
    assert [p.data_ptr() for p in fresh.parameters()] == ptrs


class _NormAct(nn.BatchNorm1d):
    """A torch.nn subclass with a child and a plain attribute (as timm's BatchNormAct2d):
    fused by vmap over the first member's code, which swaps in parameters and buffers only."""

    def __init__(self, act: nn.Module, scale: float = 1.0):
        super().__init__(8)
        self.act = act
        self.scale = scale

    def forward(self, x):
        return self.act(super().forward(x)) * self.scale


class _FourNormActs(nn.Module):
    def __init__(self, members):
        super().__init__()
        self.members = nn.ModuleList(members)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_()
            for m in self.members:
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        return torch.stack([m(x) for m in self.members])


def _own_forward(m: nn.Module) -> nn.Module:
    m.forward = lambda x: -nn.BatchNorm1d.forward(m, x)
    return m


def _child_in_the_other_mode(train: bool) -> nn.Module:
    m = _NormAct(nn.BatchNorm1d(8))
    m.act.train(not train)  # a child whose mode differs from its parent's
    return m


@pytest.mark.parametrize(
    "odd_one",
    [
        lambda train: _NormAct(nn.Identity()),  # another child
        lambda train: _NormAct(nn.ReLU(), scale=3.0),  # a plain attribute extra_repr does not print
        lambda train: _own_forward(_NormAct(nn.ReLU())),  # an instance's own forward
    ],
    ids=["child", "attribute", "instance-forward"],
)
@pytest.mark.parametrize("train", [False, True])
def test_members_differing_beyond_parameters_are_not_fused_together(odd_one, train):
    model = _FourNormActs([_NormAct(nn.ReLU()) for _ in range(3)] + [odd_one(train)]).train(train)
    sm = check_against_eager(model, (torch.randn(5, 8),), calls=3)
    sizes = sorted(g.size for g in sm.plan.fused_groups)
    assert sizes == [3], f"the three alike members fuse, the odd one stays alone: {sizes}"


@pytest.mark.parametrize("train", [False, True])
def test_members_whose_children_differ_in_mode_are_not_fused_together(train):
    members = [_NormAct(nn.BatchNorm1d(8)) for _ in range(3)]
    model = _FourNormActs(members + [_NormAct(nn.BatchNorm1d(8))]).train(train)
    model.members[3].act.train(not train)
    sm = check_against_eager(model, (torch.randn(5, 8),), calls=3)
    sizes = sorted(g.size for g in sm.plan.fused_groups)
    assert 4 not in sizes and 3 in sizes, sizes


class _CopiedNormAct(nn.BatchNorm1d):
    """As timm's BatchNormAct2d: a torch.nn subclass whose forward is its own copy of the
    base's (a rank check, then the functional call) and never calls the base's forward.
    Its forward traces now that ranks are known; it must stay one call, fused by vmap."""

    def forward(self, x):
        assert x.ndim == 2, f"expected 2D input (got {x.ndim}D input)"
        y = nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.1, 1e-5)
        return torch.relu(y)


@pytest.mark.parametrize("cls", [_NormAct, _CopiedNormAct], ids=["calls-super", "own-copy"])
def test_subclasses_of_torch_leaf_modules_stay_one_fusable_call(cls):
    members = [cls(nn.ReLU()) if cls is _NormAct else cls(8) for _ in range(4)]
    model = _FourNormActs(members).eval()
    sm = check_against_eager(model, (torch.randn(5, 8),), calls=3)
    assert [g.size for g in sm.plan.fused_groups] == [4]
    assert not sm.plan.opaque  # a leaf, not a class made opaque by a failed trace


def test_members_alike_in_everything_are_fused():
    model = _FourNormActs([_NormAct(nn.ReLU(), scale=2.0) for _ in range(4)]).eval()
    sm = check_against_eager(model, (torch.randn(5, 8),), calls=3)
    assert [g.size for g in sm.plan.fused_groups] == [4]


def test_reconfiguring_a_fused_member_after_planning_re_plans():
    model = _FourNormActs([_NormAct(nn.ReLU(), scale=2.0) for _ in range(4)]).eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    x = torch.randn(5, 8)
    with torch.no_grad():
        for _ in range(2):
            assert_close(sm(x), model(x))
        assert [g.size for g in sm.plan.fused_groups] == [4]
        for m in (model, sm.module):
            m.members[3].scale = 3.0  # read by the fused kernel's code, not a parameter
        assert_close(sm(x), model(x))
        assert [g.size for g in sm.plan.fused_groups] == [3]
        for m in (model, sm.module):
            m.members[0].scale = 3.0
            m.members[1].scale = 3.0
        assert_close(sm(x), model(x))


def test_changing_a_wide_conv_member_configuration_re_plans():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(3, 4, 3, padding=1)
            self.b = nn.Conv2d(3, 6, 3, padding=1)

        def forward(self, x):
            return self.a(x).sum() + self.b(x).sum()

    model = Heads()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        sm(x)
        assert_close(sm(x), model(x))
        assert [g.size for g in sm.plan.fused_groups] == [2]
        for m in (model, sm.module):
            m.b.padding = (0, 0)
        assert_close(sm(x), model(x))


@pytest.mark.parametrize("runtime", ["native", "python"])
def test_data_assigned_to_a_middle_member_is_seen(runtime):
    """``member.data = t`` gives one member storage of its own: the kernel reading the
    stack must see it on the next call, with or without the native stack guard (the
    Python check looked at the first and last member only)."""
    torch.manual_seed(0)
    model = ParallelFCN(8)
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(2, 160)
    sm(x), sm(x)
    assert sm.plan.fused_groups
    stacks = [s for s in sm._ss.fusion._stacks.values() if s.alias]
    assert stacks
    if runtime == "python":
        for stack in stacks:
            stack._guard = None
    members = stacks[0].tensors
    middle = members[len(members) // 2]
    middle.data = torch.randn_like(middle)
    x = torch.randn(2, 160)
    assert_close(called_on(sm, "plan:serial", x), model(x), atol=1e-5)


class _TwoRanks(nn.Module):
    """Four alike Linears: two on a matrix, two on a batch of matrices."""

    def __init__(self):
        super().__init__()
        self.flat = nn.ModuleList(nn.Linear(4, 3) for _ in range(2))
        self.deep = nn.ModuleList(nn.Linear(4, 3) for _ in range(2))

    def forward(self, x, z):
        return [m(x * (i + 1)) for i, m in enumerate(self.flat)] + [m(z * (i + 1)) for i, m in enumerate(self.deep)]


def test_members_alike_but_for_their_inputs_shapes_are_fused_apart():
    # A signature holds the description of each argument's value: Linears alike in
    # everything but the rank of their inputs make two groups, not one.
    torch.manual_seed(0)
    sm = check_against_eager(_TwoRanks().eval(), (torch.randn(5, 4), torch.randn(5, 2, 4)), calls=3)
    assert sorted(sorted(g.members) for g in sm.plan.fused_groups) == [
        ["deep.0", "deep.1"],
        ["flat.0", "flat.1"],
    ]


# --- a vmap kernel never swaps tensors into the model's own modules ------------------

_WATCH: list = []
_SEEN: list = []


class _Gate(nn.Module):
    """A module type with no batched kernel of its own: fused by vmap(functional_call).
    Its forward notes whether the first member still holds its own parameter."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8))
        self.scale = 2.0

    def forward(self, x):
        first, weight = _WATCH
        _SEEN.append(first._parameters["weight"] is weight)
        return x * torch.sigmoid(self.weight) * self.scale


class _Gates(nn.Module):
    def __init__(self):
        super().__init__()
        self.gates = nn.ModuleList(_Gate() for _ in range(3))

    def forward(self, x):
        return sum(g(x) for g in self.gates)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_vmap_kernel_leaves_the_members_tensors_in_place_while_it_runs(executor):
    """functional_call swaps the stacked (vmap-batched) tensors into the module it runs:
    run on the first member itself, the member held them for the length of the kernel,
    where a call of it on another lane, or a second kernel with the same first member,
    saw or put back the wrong ones (torchvision's FCOS head under ``auto``: state_dict()
    raised, a tensor escaped from vmap). The kernel runs a stand-in; a flag set on the
    member after planning still reaches it."""
    torch.manual_seed(0)
    model = _Gates()
    _WATCH[:] = [model.gates[0], model.gates[0].weight]
    sm = ss.StreamScheduledModule(model, executor=executor, leaf_modules=(_Gate,), min_task_cost=0.0)
    try:
        for call in range(6):
            if call == 3:
                for g in model.gates:
                    g.scale = 3.0  # a plain attribute the kernel's stand-in must read
            x = torch.randn(4, 8)
            _SEEN.clear()
            out = sm(x)
            path = assert_path(sm, "recorded", "plan")
            assert all(_SEEN), f"call {call} ({path}): the member held other tensors while a kernel ran: {_SEEN}"
            assert_close(out, model(x), what=f"call {call} ({path})")
        assert path.startswith("plan") and sm.plan.fused_groups, (path, sm.plan.fused_groups)
        assert sm.plan.fused_groups[0].kernel == "vmap(functional_call)"
        model.state_dict()
    finally:
        _WATCH.clear()


class MaskRouted(nn.Module):
    """One small MLP per route; each reads the rows its route selects (``x[route == i]``, a
    boolean mask: how many rows is decided by the values of ``route``, not by any shape)
    and writes them back in place, as X-MOD's per-language adapters and mixture-of-experts
    layers with an expert module each do."""

    def __init__(self, routes=2, width=8, how="mask"):
        super().__init__()
        self.how = how
        self.adapters = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, width)) for _ in range(routes)
        )

    def forward(self, x, route):
        out = torch.zeros_like(x)
        for i, adapter in enumerate(self.adapters):
            if self.how == "mask":
                rows = route == i
            elif self.how == "nonzero":
                rows = (route == i).nonzero().squeeze(1)
            else:
                rows = torch.masked_select(torch.arange(route.shape[0]), route == i)
            out[rows] = adapter(x[rows])
        return out + x


@pytest.mark.parametrize("how", ["mask", "nonzero", "masked_select"])
@pytest.mark.parametrize("executor", ["serial", "auto"])
def test_members_reading_rows_chosen_by_values_are_not_fused(how, executor):
    # Recorded with one row per route, the members' inputs are alike in shape; a later
    # call of the same signature routes every row to one adapter (and none to the other):
    # a plan that fused the adapters stacked inputs of 0 and 2 rows (RuntimeError), or
    # would cut each member's rows from the recording call's sizes.
    torch.manual_seed(0)
    model = MaskRouted(how=how)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    x = torch.randn(4, 8)
    for route in ([0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 1, 0], [1, 1, 1, 1]):
        r = torch.tensor(route)
        with torch.no_grad():
            assert_close(sm(x, r), ref(x, r), atol=1e-6)
    if executor == "serial":
        assert_path(sm, "plan:serial")
    assert sm.plan.fused_groups == []
    # Training: the same routes, gradients of every adapter (a route with no rows leaves
    # its adapter's .grad as eager does).
    sm.train(), ref.train()
    for route in ([0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]):
        r = torch.tensor(route)
        for p in list(sm.parameters()) + list(ref.parameters()):
            p.grad = None
        sm(x, r).square().sum().backward()
        ref(x, r).square().sum().backward()
        for (name, a), b in zip(sm.module.named_parameters(), ref.parameters()):
            assert (a.grad is None) == (b.grad is None), name
            if b.grad is not None:
                assert_close(a.grad, b.grad, atol=1e-6)
    if executor == "serial":
        assert_path(sm, "plan:serial")


class WideConvBranches(nn.Module):
    """1x1 convolutions of different widths reading one feature map (one wide kernel),
    three of them alike and each followed by BatchNorm and ReLU, as an Inception block's
    branches: the alike branches' BatchNorms and ReLUs read their part of the wide
    output (a narrow of its channels)."""

    def __init__(self, other_first: bool):
        super().__init__()
        self.other_first = other_first
        self.alike = nn.ModuleList(nn.Sequential(nn.Conv2d(6, 8, 1), nn.BatchNorm2d(8), nn.ReLU()) for _ in range(3))
        self.other = nn.Conv2d(6, 5, 1)

    def forward(self, x):
        other = self.other(x) if self.other_first else None
        outs = [m(x) for m in self.alike]
        if other is None:
            other = self.other(x)
        return torch.cat(outs + [other], 1)


@pytest.mark.parametrize("other_first", [False, True])
def test_alike_branches_of_a_wide_convolution_run_their_norms_once(other_first):
    torch.manual_seed(0)
    model = WideConvBranches(other_first)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    model.eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 6, 5, 5)
            assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    kinds = sorted((g.kind, g.size) for g in sm.plan.fused_groups)
    assert ("BatchNorm2d", 3) in kinds and ("Conv2d", 4) in kinds, kinds
    assert not sm.plan.unfused, sm.plan.unfused
