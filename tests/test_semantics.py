"""What eager does, the wrapper does: module modes, buffer updates and output types.

Each test is a minimal reproduction of a way a trace can silently differ from eager:
a training flag read by traced-through code, an in-place buffer update inside a
traced-through module, a Python side effect during tracing, an output container type.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path, check_happens_before

from .helpers import assert_close, called_on, grads

# --- 1. modes ------------------------------------------------------------------------


class MyBatchNorm(nn.BatchNorm2d):
    """A BatchNorm subclass outside torch.nn: traced through, reading self.training and
    updating num_batches_tracked in place (as timm's BatchNormAct2d does)."""

    def forward(self, x):
        if self.training:
            self.num_batches_tracked.add_(1)
            momentum = 0.0 if self.momentum is None else self.momentum
            if self.momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        else:
            momentum = 0.0
        return F.batch_norm(
            x, self.running_mean, self.running_var, self.weight, self.bias, self.training, momentum, self.eps
        )


class DropPath(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = torch.ones(x.shape[0], 1, 1, 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Net(nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), MyBatchNorm(8, momentum=momentum), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.drop = DropPath(0.5)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = torch.cat([self.a(x), self.drop(self.b(x))], dim=1)
        return self.head(h.mean((2, 3)))


def _pair(model: nn.Module, **options):
    eager = copy.deepcopy(model)
    return eager, ss.StreamScheduledModule(model, **options)


def _step_both(eager, sm, x, seed=0, path=None):
    """One forward + backward on each; outputs, grads and the whole state must agree.
    ``path``: which way the wrapper's call must have run (``streamsched.testing``)."""
    for m in (eager, sm):
        m.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    ref = eager(x)
    torch.manual_seed(seed)
    out = sm(x)
    if path is not None:
        assert_path(sm, path)
    assert_close(out, ref, what="output")
    if torch.is_grad_enabled() and ref.requires_grad:
        ref.square().mean().backward()
        out.square().mean().backward()
        g_ref, g_out = grads(eager), grads(sm.module)
        assert g_ref.keys() == g_out.keys()
        for k in g_ref:
            assert_close(g_out[k], g_ref[k], what=f"grad {k}")
    sd_ref, sd_out = eager.state_dict(), sm.module.state_dict()
    for k in sd_ref:
        assert torch.equal(sd_out[k], sd_ref[k]) or torch.allclose(sd_out[k], sd_ref[k], atol=1e-6), k


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_eval_then_train_then_eval_equals_eager(executor):
    eager, sm = _pair(Net(), executor=executor)
    x = torch.randn(4, 3, 8, 8)
    eager.eval(), sm.eval()
    _step_both(eager, sm, x)
    eager.train(), sm.train()
    for i in range(3):
        _step_both(eager, sm, torch.randn(4, 3, 8, 8), seed=i)
    assert int(sm.module.a[1].num_batches_tracked) == 3
    eager.eval(), sm.eval()
    _step_both(eager, sm, x)


def _steps_on_each_path(eager, sm, seed=0):
    """A recording call, then two calls of the compiled plan, each on fresh inputs and
    compared with eager (``sm`` needs an explicit executor: no trial runs it as written)."""
    for i, path in enumerate(("recorded", "plan", "plan")):
        _step_both(eager, sm, torch.randn(4, 3, 8, 8), seed=seed + i, path=path)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_train_then_eval_uses_running_statistics(executor):
    eager, sm = _pair(Net(), executor=executor)
    _steps_on_each_path(eager, sm)  # train: the running statistics move
    eager.eval(), sm.eval()
    with torch.no_grad():
        _steps_on_each_path(eager, sm, seed=10)


def test_freezing_batchnorm_inside_a_training_model():
    eager, sm = _pair(Net())
    x = torch.randn(4, 3, 8, 8)
    _step_both(eager, sm, x)
    for model in (eager, sm.module):
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
    for i in range(2):
        _step_both(eager, sm, torch.randn(4, 3, 8, 8), seed=i)
    assert int(sm.module.a[1].num_batches_tracked) == 1


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_setting_the_training_attribute_directly_is_seen(executor):
    eager, sm = _pair(Net(), executor=executor)
    _steps_on_each_path(eager, sm)
    eager.a[1].training = False
    sm.module.a[1].training = False
    _steps_on_each_path(eager, sm, seed=10)


def test_buffer_updates_run_every_call_with_momentum_none():
    eager, sm = _pair(Net(momentum=None))
    for i in range(4):
        _step_both(eager, sm, torch.randn(4, 3, 8, 8), seed=i)
    assert int(sm.module.a[1].num_batches_tracked) == 4
    assert_close(sm.module.a[1].running_mean, eager.a[1].running_mean)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_a_changed_flag_of_a_traced_module_retraces(executor):
    eager, sm = _pair(Net(), executor=executor)
    _steps_on_each_path(eager, sm)
    eager.drop.p = 0.0
    sm.module.drop.p = 0.0
    _steps_on_each_path(eager, sm, seed=10)


# --- 2. a trace has no side effects ----------------------------------------------------


class CountsInPlace(nn.Module):
    """Updates a plain tensor attribute (not a buffer) and a Python counter in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.seen = torch.zeros(())
        self.calls = 0

    def forward(self, x):
        self.seen.add_(1)
        self.calls += 1
        return self.fc(x)


class HasCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.counter = CountsInPlace()
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        return self.counter(x) + self.other(x)


def test_side_effects_during_tracing_make_the_module_opaque():
    model = HasCounter()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    for i in range(3):
        sm(x)
        assert model.counter.calls == i + 1
        assert float(model.counter.seen) == i + 1
    assert [o.path for o in sm.plan.opaque] == ["counter"]


class UntraceableWithCounter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.count.add_(1)
        if x.sum() > 0:  # untraceable in the root: strict=False runs the model's own forward
            return self.fc(x)
        return -self.fc(x)


def test_failed_trace_attempt_has_no_effect_on_state():
    model = UntraceableWithCounter()
    sm = ss.StreamScheduledModule(model, strict=False)
    sm(torch.randn(2, 4))
    assert int(model.count) == 1
    sm(torch.randn(2, 4))
    assert int(model.count) == 2


# --- 4. output types ---------------------------------------------------------------------


Pair = namedtuple("Pair", "logits hidden")


class PlainDict(dict):
    pass


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor
    note: str = "static"


class OrderedOutput(OrderedDict):
    """Like transformers' ModelOutput when it is not registered with pytree."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


class Returns(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 3)
        self.b = nn.Linear(4, 5)

    def forward(self, x):
        logits, hidden = self.a(x), self.b(x)
        if self.kind == "namedtuple":
            return Pair(logits, hidden)
        if self.kind == "ordereddict":
            return OrderedDict(logits=logits, hidden=hidden)
        if self.kind == "dict_subclass":
            return PlainDict(logits=logits, hidden=[hidden, None, 3])
        if self.kind == "dataclass":
            return Output(logits, hidden)
        if self.kind == "ordered_subclass":
            return OrderedOutput(logits=logits, hidden=hidden)
        return {"logits": logits, "hidden": (hidden,)}


OUTPUT_KINDS = ["namedtuple", "ordereddict", "dict_subclass", "dataclass", "ordered_subclass", "dict"]


@pytest.mark.parametrize("kind", OUTPUT_KINDS)
def test_outputs_keep_their_types_on_every_call(kind):
    model = Returns(kind)
    sm = ss.StreamScheduledModule(model)
    for _ in range(3):
        x = torch.randn(2, 4)
        out, ref = sm(x), model(x)
        assert type(out) is type(ref)
        if isinstance(ref, dict):
            assert list(out.keys()) == list(ref.keys())
            assert_close(list(out.values())[0], list(ref.values())[0])
        if kind in ("namedtuple", "dataclass", "ordered_subclass"):
            assert_close(out.logits, ref.logits)
            assert_close(out.hidden, ref.hidden)
        if kind == "dataclass":
            assert out.note == "static"
        if kind == "dict_subclass":
            assert out["hidden"][1:] == [None, 3]
        if kind == "dict":
            assert type(out["hidden"]) is tuple


def test_each_call_gets_a_fresh_output_container():
    sm = ss.StreamScheduledModule(Returns("dict"))
    x = torch.randn(2, 4)
    first = sm(x)
    first["extra"] = 1
    assert "extra" not in sm(x)


# --- 5. functions as leaves ----------------------------------------------------------------


def untraceable_helper(x):
    if x.sum() > 0:  # would fail to trace
        return x * 2
    return x


class CallsHelper(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return untraceable_helper(self.fc(x))


def test_leaf_modules_accepts_functions():
    model = CallsHelper()
    sm = ss.StreamScheduledModule(model, leaf_modules=(untraceable_helper,))
    x = torch.randn(2, 4)
    assert_close(sm(x), model(x))
    assert any(n.op == "call_function" and n.target.__name__ == "untraceable_helper" for n in sm._ss.last.graph.nodes)
    assert not sm.plan.opaque


def test_leaf_modules_rejects_other_things():
    with pytest.raises(ss.ConfigError, match="functions"):
        ss.StreamScheduledModule(CallsHelper(), leaf_modules=(3,))


# --- 6. the plan says why a group was not fused ------------------------------------------


def test_plan_says_why_a_group_was_not_fused():
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Linear(4, 2) for _ in range(3))
            for h in self.heads:
                h.register_forward_hook(lambda m, i, o: None)

        def forward(self, x):
            return torch.cat([h(x) for h in self.heads], dim=1)

    model = Hooked()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    assert_close(sm(x), model(x))
    assert not sm.plan.fused_groups
    [unfused] = sm.plan.unfused
    assert unfused.kind == "Linear" and unfused.size == 3 and "hooks" in unfused.reason
    assert "not fused: Linear x3" in sm.plan.summary()


# --- tracing coverage ------------------------------------------------------------------------


class Factories(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        z = torch.zeros(x.shape[0], 6)
        z[:, : x.shape[1] // 2] = self.fc(x)[:, :3]
        pos = torch.arange(x.shape[1]).float()
        return z + pos + torch.ones(x.shape[0], 1)


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_tensor_factories_with_traced_sizes_are_traced(executor):
    model = Factories()
    sm = ss.StreamScheduledModule(model, executor=executor)
    for n in (2, 5):
        for path in ("recorded", "plan"):
            x = torch.randn(n, 6)
            assert_close(called_on(sm, path, x), model(x))
        assert not sm.plan.opaque


def test_threads_log_of_outputs_from_side_lanes_is_clean():
    class ReturnsViews(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            return x, self.a.weight[0], self.b(x), self.a(x)

    model = ReturnsViews()
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=3, min_task_cost=0.0, sync_log=True)
    for _ in range(2):
        x = torch.randn(4, 8)
        out = sm(x)
    assert out[0] is x
    assert_close(list(out), list(model(x)))
    assert check_happens_before(sm.last_sync_log) == []


def test_the_summary_lists_ten_unfused_groups_and_counts_the_rest():
    from streamsched.planning.plan import Plan, UnfusedGroup

    unfused = [UnfusedGroup(kind="Linear", size=2, members=[f"a{i}", f"b{i}"], reason="why") for i in range(13)]
    plan = Plan(
        model="M",
        signature="float32[1]",
        device="cpu",
        executor="serial",
        reason="r",
        stream_bound=1,
        num_streams=1,
        order=[],
        tasks=[],
        fused_groups=[],
        critical_path=[],
        critical_path_us=0.0,
        est_serial_us=0.0,
        est_parallel_us=0.0,
        cross_stream_waits=0,
        unfused=unfused,
    )
    text = plan.summary()
    assert text.count("not fused: Linear x2") == 10 and "a9, b9" in text and "a10, b10" not in text
    assert "... 3 more groups not fused (plan.unfused lists all)" in text
    assert len(plan.unfused) == 13


@dataclasses.dataclass
class _Fields:
    value: torch.Tensor
    extra: torch.Tensor


class _Encoder(nn.Module):
    """Runs opaque (named in leaf_modules): the trace sees its output as one value."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return _Fields(self.lin(x), x * 2)


class _Projects(nn.Module):
    """Replaces a field of the opaque encoder's output, as CLIPModel.get_text_features
    does with ``pooler_output``."""

    def __init__(self):
        super().__init__()
        self.encoder = _Encoder()
        self.proj = nn.Linear(4, 2)

    def forward(self, x):
        out = self.encoder(x)
        out.value = self.proj(out.value)
        return out


class _ProjectsInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Projects()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        out = self.inner(x)
        return out.value, self.head(x)


@pytest.mark.parametrize("where", ["root", "submodule"])
def test_assigning_a_field_of_an_opaque_output_is_not_lost(where):
    torch.manual_seed(0)
    model = _Projects() if where == "root" else _ProjectsInside()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, leaf_modules=(_Encoder,))
    with pytest.warns(ss.UntraceableWarning, match="assigns attribute 'value'") if where == "root" else _no_op():
        for _ in range(3):
            x = torch.randn(3, 4)
            actual, expected = sm(x), ref(x)
            if where == "root":
                assert type(actual) is _Fields
                assert_close(actual.value, expected.value)
                assert_close(actual.extra, expected.extra)
            else:
                assert_close(actual, expected)
    if where == "submodule":
        assert [o.path for o in sm.plan.opaque] == ["inner"]


class _no_op:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
