"""torch.compile and streamsched, both ways round.

(a) ``torch.compile(StreamScheduledModule(model))``: the wrapper's forward is excluded
    from dynamo (``torch.compiler.disable`` on the path dynamo traces): tracing the scheduler's own machinery only
    found graph breaks and replayed the fused-parameter re-pointing as an in-place op.
    Compiling the wrapper is therefore harmless and cheap, and equal to eager from the
    first call, with or without fusion.
(b) A model whose submodules are ``torch.compile``d: fx cannot trace through a compiled
    module, so each compiled module runs as one opaque task (and identical compiled
    members can still be fused by ``vmap``), equal to eager.

Compiling is slow on CPU (inductor builds C++), so the models are tiny and the tests
that compile the wrapper are marked slow.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

import streamsched as ss
from benchmarks.zoo import CriticEnsemble

from .helpers import Towers, assert_close

EXECUTORS = ["serial", "threads", "streams"]

pytestmark = [
    pytest.mark.usefixtures("vmap_any_size"),  # fused identical branches, a few of them
    # dynamo warns about the library internals it cannot trace (thread ids, lru_cache);
    # the graph breaks are expected here and counted where they matter.
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test wraps new modules: without a reset, dynamo's per-code-object recompile
    # limit would silently turn later tests into eager runs.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    # A compiled submodule holds the original under `_orig_mod`: name parameters as eager does.
    return {n.replace("_orig_mod.", ""): p.grad.clone() for n, p in model.named_parameters()}


def compare_training_calls(run_wrapped, reference: nn.Module, wrapped_model: nn.Module, calls: int = 3) -> None:
    """Forward and backward through ``run_wrapped`` and ``reference`` on fresh inputs."""
    for call in range(calls):
        for p in list(reference.parameters()) + list(wrapped_model.parameters()):
            p.grad = None
        x = torch.randn(4, 16)
        out_w, out_e = run_wrapped(x), reference(x)
        assert_close(out_w, out_e, atol=1e-5, rtol=1e-5, what=f"output (call {call})")
        out_w.square().sum().backward()
        out_e.square().sum().backward()
        g_w, g_e = grads(wrapped_model), grads(reference)
        assert g_w.keys() == g_e.keys()
        for n in g_e:
            assert_close(g_w[n], g_e[n], atol=1e-5, rtol=1e-5, what=f"grad {n} (call {call})")


# --- (a) torch.compile of the wrapper -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("executor", EXECUTORS)
def test_compiled_wrapper_without_fusion_equals_eager(executor):
    model = Towers(3, 16)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor, fuse=False, num_streams=4, min_task_cost=0.0)
    compiled = torch.compile(sm)
    compare_training_calls(compiled, reference, model)
    # The wrapper really planned and ran its schedule inside the compiled call.
    assert sm.plan is not None and sm.plan.executor == executor
    assert sm._ss.calls == 3


def test_compiled_wrapper_with_fusion_first_call_backward_works():
    model = Towers(3, 16)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    compare_training_calls(torch.compile(sm), reference, model, calls=1)


@pytest.mark.slow
def test_compiled_wrapper_with_fusion_after_an_eager_warm_up_equals_eager():
    model = Towers(3, 16)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    sm(torch.randn(4, 16))  # plans and stacks the fused parameters outside the compiled region
    reference(torch.randn(4, 16))
    compare_training_calls(torch.compile(sm), reference, model)
    assert len(sm.plan.fused_groups) > 0


@pytest.mark.slow
def test_compiled_wrapper_with_copied_fused_parameters_equals_eager_from_the_first_call():
    model = Towers(3, 16)
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", fuse_params="copy")
    compare_training_calls(torch.compile(sm), reference, model)
    assert len(sm.plan.fused_groups) > 0


# --- (b) a compiled submodule inside a wrapped model ----------------------------------


def towers_with_a_compiled_tower() -> tuple[nn.Module, nn.Module]:
    model = Towers(3, 16)
    reference = copy.deepcopy(model)
    model.towers[1] = torch.compile(model.towers[1])
    return model, reference


@pytest.mark.parametrize("executor", EXECUTORS)
def test_compiled_submodule_runs_as_one_task_without_being_declared(executor):
    model, reference = towers_with_a_compiled_tower()
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=4, min_task_cost=0.0)
    compare_training_calls(sm, reference, model)
    assert any(task.name == "towers.1" for task in sm.plan.tasks), [t.name for t in sm.plan.tasks]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_compiled_submodule_declared_opaque_runs_as_one_task_equal_to_eager(executor):
    model, reference = towers_with_a_compiled_tower()
    sm = ss.StreamScheduledModule(
        model, executor=executor, leaf_modules=(OptimizedModule,), num_streams=4, min_task_cost=0.0
    )
    compare_training_calls(sm, reference, model)
    # The compiled tower is a task of its own, never fused or traced into.
    assert any(task.nodes == ["towers_1"] or task.name == "towers.1" for task in sm.plan.tasks), sm.plan.tasks
    assert all("towers.1" not in member for g in sm.plan.fused_groups for member in g.members)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_identical_compiled_branches_declared_opaque_equal_eager(fuse):
    model = CriticEnsemble(4, obs=16, hidden=16)
    reference = copy.deepcopy(model)
    for i, critic in enumerate(model.critics):
        model.critics[i] = torch.compile(critic)
    sm = ss.StreamScheduledModule(model, leaf_modules=(OptimizedModule,), fuse=fuse)
    compare_training_calls(sm, reference, model)
    # Identical compiled members are fused like any identical modules, or not at all.
    assert len(sm.plan.fused_groups) == (1 if fuse else 0)
