"""``streamsched.testing.last_path`` / ``assert_path``: every call says which way it ran.

Each path a call can take is reached here on purpose, asserted, and its output compared
with eager on fresh inputs, so that a record that names the wrong path fails a test.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import PATHS, assert_path, last_path

from .helpers import Towers, assert_close


def _fresh() -> torch.Tensor:
    return torch.randn(4, 16)


def test_before_the_first_call_no_path_is_recorded():
    sm = ss.StreamScheduledModule(Towers(3, 16))
    assert last_path(sm) == ""
    with pytest.raises(AssertionError, match="the last call ran ''"):
        assert_path(sm, "recorded")


@pytest.mark.parametrize("executor", ["serial", "threads", "streams"])
def test_the_recording_call_then_the_plan_on_the_named_executor(executor):
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor=executor, num_streams=3, min_task_cost=0.0)
    x = _fresh()
    assert_close(sm(x), model(x))
    assert last_path(sm) == "recorded"
    for _ in range(2):
        x = _fresh()
        assert_close(sm(x), model(x))
        assert last_path(sm) == f"plan:{executor}"
        assert sm.plan.schedule_executor == executor
    assert assert_path(sm, "plan") == f"plan:{executor}"  # a prefix matches every executor
    assert_path(sm, "recorded", f"plan:{executor}")  # any of several
    with pytest.raises(AssertionError, match=f"ran 'plan:{executor}', expected 'recorded'"):
        assert_path(sm, "recorded")
    with pytest.raises(AssertionError):
        assert_path(sm, "pla")  # a prefix ends at the colon


def test_a_new_signature_records_again_and_an_old_one_runs_its_plan():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(model, executor="serial")
    for shape, path in [
        ((4, 16), "recorded"),
        ((4, 16), "plan:serial"),
        ((7, 16), "recorded"),
        ((4, 16), "plan:serial"),
    ]:
        x = torch.randn(shape)
        assert_close(sm(x), model(x))
        assert last_path(sm) == path, (shape, path)


def test_hooks_on_the_model_run_it_as_written():
    model = Towers(3, 16)
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    sm.module.register_forward_hook(lambda m, i, o: None)  # a hook on the wrapped model itself
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(2):
            x = _fresh()
            assert_close(sm(x), model(x))
            assert last_path(sm) == "as-written"


class Untraceable(nn.Module):
    """Control flow on a tensor's value: its forward cannot be traced."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            h = -h
        return self.b(h)


class UntraceableWithBranches(Untraceable):
    @ss.branch
    def left(self, x):
        return torch.tanh(self.a(x))

    @ss.branch
    def right(self, x):
        return torch.sigmoid(self.b(x))

    def forward(self, x):
        if x.sum() > 0:
            x = -x
        return self.left(x) + self.right(x)


def test_an_untraceable_forward_runs_under_eager_dispatch_then_as_written():
    model = Untraceable()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            x = _fresh()
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
    # No @streamsched.branch to dispatch: after a few quiet calls it runs as written.
    assert paths[0] == "eager-dispatch" and paths[-1] == "as-written", paths


def test_eager_dispatch_with_branches_stays_eager_dispatch():
    model = UntraceableWithBranches()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(5):
            x = _fresh()
            assert_close(sm(x), model(x))
            assert last_path(sm) == "eager-dispatch"


def test_every_path_is_listed():
    assert set(PATHS) == {
        "recorded",
        "plan:serial",
        "plan:threads",
        "plan:streams",
        "graph",
        "as-written",
        "eager-dispatch",
    }


@pytest.mark.cuda
def test_a_cuda_graph_replay_is_its_own_path():
    model = Towers(3, 16).cuda().eval()
    sm = ss.StreamScheduledModule(model, executor="streams", cuda_graph=True, num_streams=3, min_task_cost=0.0)
    paths = []
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(4, 16, device="cuda")
            assert_close(sm(x), model(x), atol=1e-5)
            paths.append(last_path(sm))
    assert paths[0] == "recorded" and paths[-1] == "graph", paths
