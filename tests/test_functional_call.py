"""``torch.func.functional_call`` and ``torch.nn.utils.stateless._reparametrize_module`` on a
wrapped model: the tensors given are put straight into the modules' ``_parameters`` /
``_buffers`` (no ``__setattr__``), and every plan must compute with them, fused stacks and
CUDA graphs included, then with the model's own weights again once they are put back."""

import copy

import pytest
import torch
from torch import nn
from torch.nn.utils import stateless

import streamsched as ss
from benchmarks.zoo import CriticEnsemble
from streamsched.testing import assert_path, last_path

from .helpers import Towers, assert_close

EXECUTORS = ["serial", "threads", "streams"]


class TwoHeads(nn.Module):
    """Two Linears reading one input (one wide fused group) and a buffer read by get_attr."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)
        self.register_buffer("scale", torch.rand(d) + 0.5)

    def forward(self, x):
        return self.a(x).relu() * self.scale + self.b(x)


def _planned(model: nn.Module, **config) -> ss.StreamScheduledModule:
    sm = ss.StreamScheduledModule(model, min_task_cost=0.0, **config)
    for _ in range(2):
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what="before functional_call")
    assert_path(sm, "plan")
    assert [g.kernel for g in sm.plan.fused_groups] == ["wide linear"]
    return sm


def _other_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: torch.randn_like(v) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
@pytest.mark.parametrize("executor", EXECUTORS)
def test_functional_call_computes_with_the_tensors_given(executor, trainable):
    torch.manual_seed(0)
    model = TwoHeads().requires_grad_(trainable)
    sm = _planned(model, executor=executor)
    stacks = list(sm._ss.fusion._stacks.values())
    rebuilds = [s.rebuilds for s in stacks]
    for _ in range(2):
        weights = _other_weights(model)
        where = {k: (v.untyped_storage().data_ptr(), v.storage_offset()) for k, v in weights.items()}
        x = torch.randn(4, 8)
        out = torch.func.functional_call(sm, weights, (x,))
        assert_path(sm, "plan:" + executor)
        # Read, not taken over: the tensors given keep their own storage.
        assert {k: (v.untyped_storage().data_ptr(), v.storage_offset()) for k, v in weights.items()} == where
        assert_close(out, torch.func.functional_call(model, weights, (x,)), what="functional_call")
        with stateless._reparametrize_module(sm, weights):
            out = sm(x)
            assert_path(sm, "plan:" + executor)
        assert_close(out, torch.func.functional_call(model, weights, (x,)), what="_reparametrize_module")
        # Put back: the model's own weights again, read through the stack.
        x = torch.randn(4, 8)
        assert_close(sm(x), model(x), what="after functional_call")
        assert_path(sm, "plan:" + executor)
    # The members still alias the stack they had: nothing was re-stacked.
    assert all(s.live and s.stack is not None for s in stacks)
    assert [s.rebuilds for s in stacks] == rebuilds
    with torch.no_grad():
        model.a.weight.mul_(2)  # an in-place update still reaches the fused kernel
    x = torch.randn(4, 8)
    assert_close(sm(x), model(x), what="in-place update after functional_call")


def test_functional_call_with_some_tensors_given():
    torch.manual_seed(1)
    model = TwoHeads()
    sm = _planned(model, executor="serial")
    weights = {"b.weight": torch.randn(8, 8), "scale": torch.randn(8)}
    x = torch.randn(4, 8)
    out = torch.func.functional_call(sm, weights, (x,), strict=False)
    assert_path(sm, "plan:serial")
    assert_close(out, torch.func.functional_call(model, weights, (x,), strict=False))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_gradients_reach_the_tensors_given(executor):
    torch.manual_seed(2)
    model = TwoHeads()
    sm = _planned(model, executor=executor)
    weights = {k: v.detach().clone().requires_grad_() for k, v in _other_weights(model).items()}
    mine = {k: v.detach().clone().requires_grad_() for k, v in weights.items()}
    x = torch.randn(4, 8)
    out = torch.func.functional_call(sm, weights, (x,))
    assert_path(sm, "plan:" + executor)
    torch.func.functional_call(model, mine, (x,)).square().sum().backward()
    out.square().sum().backward()
    for k in weights:
        assert_close(weights[k].grad, mine[k].grad, what=f"grad of {k}")
    # The model's own parameters received nothing.
    assert all(p.grad is None for p in model.parameters())


def test_torch_func_grad_over_functional_call():
    """torch.func.grad over functional_call equals eager's, frozen or trainable fused
    weights alike."""
    torch.manual_seed(3)
    for trainable in (False, True):
        model = TwoHeads().requires_grad_(trainable)
        sm = _planned(model, executor="serial")
        weights = {k: v.detach() for k, v in _other_weights(model).items()}
        x = torch.randn(4, 8)

        def loss(params, module, x=x):
            return torch.func.functional_call(module, params, (x,)).square().sum()

        expected = torch.func.grad(loss)(weights, model)
        got = torch.func.grad(loss)(weights, sm)
        assert_path(sm, "plan")
        for k in weights:
            assert_close(got[k], expected[k], what=f"torch.func.grad of {k} (trainable={trainable})")


def test_torch_func_transforms_keep_a_threaded_plan_on_the_callers_thread():
    """A lane's ops would escape torch.func's wrapped tensors (its transforms are the
    calling thread's): under grad and vmap the plan's tasks run where the transform is."""
    torch.manual_seed(0)
    model = Towers(4, 64)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=4, min_task_cost=0.0, fuse=False)
    x = torch.randn(4, 64)
    for _ in range(3):
        sm(x)
    assert_path(sm, "plan:threads")
    assert sm.plan.num_streams > 1
    weights = {k: v.detach() for k, v in model.named_parameters()}

    def loss(params, module):
        return torch.func.functional_call(module, params, (x,)).square().sum()

    got, expected = torch.func.grad(loss)(weights, sm), torch.func.grad(loss)(weights, model)
    assert_path(sm, "plan:threads")
    for k in weights:
        assert_close(got[k], expected[k], what=f"torch.func.grad of {k}")
    xs = torch.randn(3, 4, 64)
    assert_close(torch.func.vmap(sm)(xs), torch.func.vmap(model)(xs))
    assert_path(sm, "plan:threads")


class NormBranches(nn.Module):
    """Two conv + BatchNorm branches on one input: fused BatchNorm stacks buffers."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 4, 3), nn.Conv2d(3, 4, 3)
        self.n1, self.n2 = nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.n1(self.c1(x)) + self.n2(self.c2(x))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_functional_call_swaps_fused_buffers(executor):
    torch.manual_seed(4)
    model = NormBranches().eval()
    with torch.no_grad():
        for n in (model.n1, model.n2):
            n.running_mean.uniform_(-1, 1)
            n.running_var.uniform_(0.5, 2)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 8, 8)
            assert_close(sm(x), model(x))
        assert_path(sm, "plan")
        assert sm.plan.fused_groups
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        for k in ("n1.running_mean", "n2.running_var", "n2.running_mean"):
            weights[k] = weights[k] + torch.rand_like(weights[k])
        x = torch.randn(2, 3, 8, 8)
        out = torch.func.functional_call(sm, weights, (x,))
        assert_path(sm, "plan:" + executor)
        assert_close(out, torch.func.functional_call(model, weights, (x,)), what="swapped buffers")
        x = torch.randn(2, 3, 8, 8)
        assert_close(sm(x), model(x), what="after")


def test_a_member_replaced_in_its_table_for_good_is_restacked():
    """Not a swap: a Parameter assigned (moves the generation) becomes the member."""
    torch.manual_seed(5)
    model = TwoHeads()
    sm = _planned(model, executor="serial")
    model.a.weight = nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8)
    assert_close(sm(x), model(x))
    stacks = sm._ss.fusion._stacks.values()
    assert all(s.live for s in stacks)
    assert any(s.tensors[0] is model.a.weight for s in stacks)


def test_stacked_layers_gradients_and_torch_func_grad():
    """The critics: a wide layer, then stacked ones (baddbmm, StackedLinear for gradients)."""
    torch.manual_seed(6)
    model = CriticEnsemble(4)
    sm = ss.StreamScheduledModule(model, executor="serial", min_task_cost=0.0)
    x = torch.randn(16, 23)
    sm(x)
    sm(x)
    assert any(g.kernel.startswith("baddbmm") for g in sm.plan.fused_groups)
    weights = {k: torch.randn_like(v) * 0.3 for k, v in model.state_dict().items()}
    given = {k: v.clone().requires_grad_() for k, v in weights.items()}
    mine = {k: v.clone().requires_grad_() for k, v in weights.items()}
    x = torch.randn(16, 23)
    out = torch.func.functional_call(sm, given, (x,))
    assert_path(sm, "plan:serial")
    expected = torch.func.functional_call(model, mine, (x,))
    assert_close(out, expected, rtol=1e-4, what="stacked layers")
    out.square().sum().backward()
    expected.square().sum().backward()
    for k in given:
        assert_close(given[k].grad, mine[k].grad, rtol=1e-4, atol=1e-4, what=f"grad of {k}")

    def loss(params):
        return torch.func.functional_call(sm, params, (x,)).square().sum()

    def loss_ref(params):
        return torch.func.functional_call(model, params, (x,)).square().sum()

    # Under torch.func the kernels read the weights through autograd's own ops (a
    # StackedLinear, without functorch's hooks, was refused).
    got, want = torch.func.grad(loss)(weights), torch.func.grad(loss_ref)(weights)
    assert_path(sm, "plan:serial")
    for k in weights:
        assert_close(got[k], want[k], rtol=1e-4, atol=1e-4, what=f"torch.func.grad of {k}")
    x = torch.randn(16, 23)
    assert_close(sm(x), model(x), rtol=1e-4, what="after")
    assert last_path(sm) == "plan:serial"


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_functional_call_on_cuda_graphs(fuse):
    """A CUDA graph reads the weights at their addresses: a call with other tensors swapped
    in must not replay the graph captured with the model's own."""
    torch.manual_seed(7)
    dev = torch.device("cuda")
    model = Towers(3, 64).to(dev).eval()
    sm = ss.StreamScheduledModule(
        model, executor="streams", cuda_graph=True, num_streams=4, min_task_cost=0.0, fuse=fuse
    )
    x = torch.randn(8, 64, device=dev)
    with torch.no_grad():
        for _ in range(3):
            assert_close(sm(x), model(x), atol=1e-5)
        assert_path(sm, "graph")
        for _ in range(2):
            weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
            out = torch.func.functional_call(sm, weights, (x,))
            assert_close(out, torch.func.functional_call(model, weights, (x,)), atol=1e-4, what="functional_call")
            assert_close(sm(x), model(x), atol=1e-5, what="after")
        assert_path(sm, "graph")


def test_functional_call_reaches_nested_plans():
    """An untraceable forward runs as written; its children run fused plans of their own."""
    import warnings

    from .test_nested_plans import Untraceable

    torch.manual_seed(8)
    model = Untraceable().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ss.UntraceableWarning)
        for _ in range(4):
            x = torch.randn(8, 16)
            assert_close(sm(x), model(x))
        plans = sm.nested_plans
        assert sorted(plans) == ["blocks.0", "blocks.1"] and all(p.fused_groups for p in plans.values())
        sites = {s.path: s.wrapper for s in sm._ss.nested.sites()}
        for _ in range(2):
            # Requiring grad as the parameters do: the children's inputs keep their signature.
            weights = {k: (torch.randn_like(v) * 0.5).requires_grad_() for k, v in model.state_dict().items()}
            x = torch.randn(8, 16)
            out = torch.func.functional_call(sm, weights, (x,))
            assert_path(sites["blocks.0"], "plan:serial")
            assert_path(sites["blocks.1"], "plan:serial")
            assert_close(out, torch.func.functional_call(model, weights, (x,)), what="nested functional_call")
            x = torch.randn(8, 16)
            assert_close(sm(x), model(x), what="after")


@pytest.mark.parametrize("call_first", [False, True], ids=["at-entry", "after-a-call"])
def test_fused_parameters_inside_functional_call_is_refused(call_first):
    """The stacked parameters are the model's own weights, set aside while tensors are
    swapped in: fused_parameters() inside the swap says so, changes nothing, and works
    after it; an optimizer built before it keeps stepping the model's own weights."""
    torch.manual_seed(9)
    model = TwoHeads()
    sm = _planned(model, executor="serial")
    weights = _other_weights(model)
    x = torch.randn(4, 8)
    with stateless._reparametrize_module(sm, weights):
        if call_first:
            assert_close(sm(x), torch.func.functional_call(model, weights, (x,)), what="inside")
        with pytest.raises(
            RuntimeError, match=r"fused_parameters\(\): called while torch.func.functional_call.*a\.weight"
        ):
            sm.fused_parameters()
        with pytest.raises(RuntimeError, match="before or after functional_call"):
            ss.optim.fused_parameters(sm, [{"params": list(model.parameters())}])
        assert_close(sm(x), torch.func.functional_call(model, weights, (x,)), what="inside, after the refusal")
    params = sm.fused_parameters()
    assert sorted(type(p).__name__ for p in params) == ["StackedParameter", "StackedParameter"]
    opt = torch.optim.SGD(params, lr=0.1)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    sm(x).square().sum().backward()
    assert_path(sm, "plan:serial")
    with stateless._reparametrize_module(sm, weights):
        with pytest.raises(RuntimeError, match="functional_call"):
            sm.fused_parameters()
    opt.step()  # steps the model's own weights, through the stacks
    assert all(not torch.equal(model.state_dict()[k], expected[k]) for k in expected if k != "scale")
    x = torch.randn(4, 8)
    assert_close(sm(x), model(x), what="after a step")
    assert sm.fused_parameters() == params


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_functional_call_under_cuda_graphs_captures_nothing(fuse, monkeypatch):
    """Calls made while tensors are swapped in run the plan on streams, without capture;
    the graph of the model's own weights stays cached and replays after the swap."""
    from streamsched.runtime.graphs import GraphExecutor

    captures = []
    capture = GraphExecutor._capture

    def counting(self, program, inputs, stacks):
        captures.append(id(program))
        return capture(self, program, inputs, stacks)

    monkeypatch.setattr(GraphExecutor, "_capture", counting)
    torch.manual_seed(10)
    dev = torch.device("cuda")
    model = Towers(3, 64).to(dev).eval()
    sm = ss.StreamScheduledModule(
        model, executor="streams", cuda_graph=True, num_streams=4, min_task_cost=0.0, fuse=fuse, graph_cache_size=1
    )
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(8, 64, device=dev)
            assert_close(sm(x), model(x), atol=1e-5)
        assert_path(sm, "graph")
        assert len(captures) == 1
        for _ in range(2):
            weights = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
            x = torch.randn(8, 64, device=dev)
            out = torch.func.functional_call(sm, weights, (x,))
            assert_path(sm, "plan:streams")
            assert_close(out, torch.func.functional_call(model, weights, (x,)), atol=1e-4, what="functional_call")
            with stateless._reparametrize_module(sm, weights):
                for _ in range(2):
                    x = torch.randn(8, 64, device=dev)
                    assert_close(sm(x), torch.func.functional_call(model, weights, (x,)), atol=1e-4, what="inside")
                    assert_path(sm, "plan:streams")
            x = torch.randn(8, 64, device=dev)
            assert_close(sm(x), model(x), atol=1e-5, what="after")
            assert_path(sm, "graph")
        assert len(captures) == 1, captures
        # A parameter replaced for good is not a swap: captured again, with it.
        model.towers[0][0].weight = nn.Parameter(torch.randn_like(model.towers[0][0].weight))
        x = torch.randn(8, 64, device=dev)
        assert_close(sm(x), model(x), atol=1e-5, what="re-assigned")
        assert_path(sm, "graph")
        assert len(captures) == 2, captures


@pytest.mark.parametrize("executor", EXECUTORS)
def test_functional_call_with_only_buffers(executor):
    """A dict of buffers alone: the fused BatchNorm statistics and a get_attr buffer."""
    torch.manual_seed(11)
    model = NormBranches().eval()
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    heads = TwoHeads()
    sh = _planned(heads, executor=executor)
    with torch.no_grad():
        for _ in range(2):
            x = torch.randn(2, 3, 8, 8)
            assert_close(sm(x), model(x))
            x = torch.randn(4, 8)
            assert_close(sh(x), heads(x))
        assert sm.plan.fused_groups
        for _ in range(2):
            buffers = {k: v + torch.rand_like(v) for k, v in model.named_buffers() if "running" in k}
            x = torch.randn(2, 3, 8, 8)
            out = torch.func.functional_call(sm, buffers, (x,), strict=False)
            assert_path(sm, "plan:" + executor)
            assert_close(out, torch.func.functional_call(model, buffers, (x,), strict=False), what="buffers")
            x = torch.randn(4, 8)
            scale = {"scale": torch.randn(8)}
            out = torch.func.functional_call(sh, scale, (x,), strict=False)
            assert_path(sh, "plan:" + executor)
            assert_close(out, torch.func.functional_call(heads, scale, (x,), strict=False), what="get_attr buffer")
            x = torch.randn(2, 3, 8, 8)
            assert_close(sm(x), model(x), what="after")
            x = torch.randn(4, 8)
            assert_close(sh(x), heads(x), what="after")
    assert all(s.live for s in sm._ss.fusion._stacks.values() if s.alias)


class TiedHeads(TwoHeads):
    """TwoHeads (a and b one fused group) and a Linear ``c`` after them whose weight is
    ``a``'s (tied: one Parameter in both modules' tables)."""

    def __init__(self, d: int = 8):
        super().__init__(d)
        self.c = nn.Linear(d, d)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(super().forward(x))


@pytest.mark.parametrize("executor", EXECUTORS)
def test_functional_call_with_tied_weights(executor):
    torch.manual_seed(12)
    model = TiedHeads()
    sm = _planned(model, executor=executor)
    stacks = [s for s in sm._ss.fusion._stacks.values() if s.alias]
    assert any(model.a.weight in s.tensors for s in stacks)
    for tie in (True, False):
        for keys in (None, {"a.weight"}, {"c.weight"}, {"c.weight", "b.bias"}):
            params = dict(model.named_parameters())  # c.weight only as a.weight (tied)
            if keys is not None:
                params = {k: torch.randn(model.get_parameter(k).shape) for k in keys}
            else:
                params = {k: torch.randn_like(v) for k, v in params.items()}
            x = torch.randn(4, 8)
            kw = {"tie_weights": tie, "strict": False}
            out = torch.func.functional_call(sm, params, (x,), **kw)
            assert_path(sm, "plan:" + executor)
            expected = torch.func.functional_call(model, params, (x,), **kw)
            assert_close(out, expected, what=f"tie_weights={tie}, {sorted(params)}")
            assert model.c.weight is model.a.weight
            x = torch.randn(4, 8)
            assert_close(sm(x), model(x), what="after")
    assert all(s.live for s in stacks)
    with torch.no_grad():
        model.c.weight.mul_(2)  # the tied weight still aliases the stack
    x = torch.randn(4, 8)
    assert_close(sm(x), model(x), what="in-place update of the tied weight")


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_torch_func_transforms_over_the_wrapper_with_trainable_fused_weights(executor):
    """torch.func.vmap, grad and jacrev over the wrapper itself, its fused weights
    trainable (the plan's stacked reads were Python autograd Functions without
    functorch's hooks: the plan's call raised where eager's ran), then a training call."""
    torch.manual_seed(4)
    model = CriticEnsemble(4)
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, min_task_cost=0.0)
    for _ in range(2):
        sm(torch.randn(16, 23)).sum().backward()
    model.zero_grad(set_to_none=True)
    assert any(g.kernel.startswith("baddbmm") for g in sm.plan.fused_groups)
    xs = torch.randn(3, 16, 23)
    assert_close(torch.func.vmap(sm)(xs), torch.func.vmap(ref)(xs), rtol=1e-4, what="vmap")
    assert_path(sm, "plan:" + executor)
    # (The input a transform differentiates is a signature of its own: recorded, then planned.)
    for path in ("recorded", "plan:" + executor):
        x = torch.randn(16, 23)
        got = torch.func.grad(lambda t: sm(t).square().sum())(x)
        assert_path(sm, path)
        want = torch.func.grad(lambda t: ref(t).square().sum())(x)
        assert_close(got, want, rtol=1e-4, atol=1e-5, what=f"grad ({path})")
        got = torch.func.jacrev(sm)(x)
        assert_path(sm, "plan:" + executor)
        assert_close(got, torch.func.jacrev(ref)(x), rtol=1e-4, atol=1e-5, what=f"jacrev ({path})")
    assert all(p.grad is None for p in model.parameters()), "a transform left a .grad"
    out, expected = sm(x), ref(x)
    assert_path(sm, "plan:" + executor)
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-4, what=f"grad of {name} after the transforms")
