"""The first calls of a call structure (planning.signatures, settled_calls.py): in
inference (eval(), no gradients) its first call runs as written, nothing traced
(otherwise it is planned at once); a size is traced and planned when it comes back;
and while the structure's size policy would run a new size as written for being new, the
settled layout's shortcut counts it and runs it without the full path. A model that wins
from a plan at a fixed size still gets it. Each test compares every call with eager and
counts the full path's calls (``Runner.call``) to tell which way a call went."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, MultiTaskHeads, ParallelFCN
from streamsched.planning import signatures
from streamsched.runner import Runner
from streamsched.testing import assert_path, last_path

from .helpers import assert_close
from .test_dynamic_calls import Towers

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(autouse=True)
def _inference():
    """Calls without gradients (a decoding loop, ``generate``), unless a test enables them;
    the tests' models are put in ``eval()``."""
    with torch.no_grad():
        yield


@pytest.fixture
def schedule_faster(monkeypatch) -> None:
    """The ``auto`` trial times the schedule faster than the model as written, on every
    machine: what a test of the paths, not of the timings, needs."""
    original = Runner._timed

    def timed(self, compiled, name, *args, **kwargs):
        out, _ = original(self, compiled, name, *args, **kwargs)
        return out, 1e-3 if name == "eager" else 1e-4

    monkeypatch.setattr(Runner, "_timed", timed)


def test_a_growing_input_never_traces_and_takes_the_full_path_once(full_calls):
    """A decoding loop: a new size on every call, from the first. Nothing is traced; after
    the first call (the full path, which finds the structure new) every call is counted
    and run as written by the shortcut."""
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        for n in range(1, 120):
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            assert_path(sm, "as-written")
            assert sm.plan.signature == f"float32[{n}, 16]"
            assert "new to this call structure" in sm.plan.reason
    assert len(full_calls) == 1
    assert len(sm._ss.traces) == 0 and len(sm.plans) == 0


def test_a_size_the_shortcut_counted_is_planned_when_it_comes_back(full_calls):
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    for n in (3, 5, 9):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert len(full_calls) == 1  # 5 and 9: the shortcut
    x = torch.randn(5, 16)  # came back: traced, recorded and planned
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")
    assert len(full_calls) == 2 and len(sm.plans) == 1


def test_a_planned_size_is_not_taken_for_a_new_one(full_calls, schedule_faster):
    """The structure's planned sizes leave its table of sizes seen once: the shortcut must
    not count them as new (their plan would never run again)."""
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(6, 16)
    for path in ("as-written", "recorded"):
        assert_close(sm(x), model(x))
        assert_path(sm, path)
    for n in (7, 11, 13):  # new sizes between: the shortcut counts them
        y = torch.randn(n, 16)
        assert_close(sm(y), model(y))
        assert_path(sm, "as-written")
    for _ in range(40):  # its trial's calls (the schedule's and the model's as written)
        x = torch.randn(6, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "plan", "as-written")
        if sm.plan.trial is not None:
            break
    assert sm.plan.trial is not None and sm.plan.executor != "eager"
    for _ in range(3):  # then the kept schedule
        x = torch.randn(6, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "plan")


def test_sizes_of_a_bucket_under_trial_take_the_full_path(full_calls):
    """While a size bucket's trial runs at one size, its other sizes run as written
    through the full path, which counts them towards the trial's stall."""
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    for _ in range(2):  # 20 is recorded: the trial of the bucket 32 runs at 20
        x = torch.randn(20, 16)
        sm(x)
    assert_path(sm, "recorded")
    structure = next(iter(sm._ss.structures.values()))
    assert structure.trying
    before = len(full_calls)
    for n in (21, 22, 23):  # new sizes, but of the bucket under trial
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
        assert "being decided by the trial" in sm.plan.reason
    assert len(full_calls) == before + 3
    assert structure.waits[signatures.size_bucket(((20, 16),))] == 3


@pytest.mark.parametrize("train, grad", [(True, False), (False, True), (True, True)])
def test_outside_inference_the_first_call_is_planned_at_once(train, grad):
    """In train() or with gradients: a training step comes back at its size, and an
    optimizer is built over the fused parameters its first call's plan stacked (after one
    call under no_grad, as docs/training.md does)."""
    model = Towers().train(train)
    sm = ss.StreamScheduledModule(model)
    with torch.set_grad_enabled(grad):
        x = torch.randn(4, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "recorded")
        for n in (5, 6, 7):  # new sizes run as written, counted by the shortcut from here on
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            assert_path(sm, "as-written")


def test_the_first_call_can_be_planned_at_once(monkeypatch):
    """``FIRST_CALL_AS_WRITTEN = False``: the wrapper's former way, the first call traced,
    recorded and planned."""
    monkeypatch.setattr(signatures, "FIRST_CALL_AS_WRITTEN", False)
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")


def test_an_explicit_executor_plans_the_first_call():
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(4, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")
    x = torch.randn(4, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: ParallelFCN(64), (8, 64 * 20)),
        (lambda: CriticEnsemble(32), (16, 23)),
        (lambda: MultiTaskHeads(), (16, 64)),
    ],
    ids=["parallel_fcn", "critic_ensemble", "multitask_heads"],
)
def test_a_model_that_wins_from_a_plan_at_a_fixed_size_gets_it(make, shape, schedule_faster):
    """At a fixed size: the first call as written, the second recorded, the trial's calls,
    then the compiled plan on every call."""
    torch.manual_seed(0)
    model = make().eval()
    sm = ss.StreamScheduledModule(model)
    paths = []
    with torch.no_grad():
        for _ in range(40):  # until the trial decided
            x = torch.randn(*shape)
            assert_close(sm(x), model(x), atol=1e-4, rtol=1e-4)
            paths.append(last_path(sm))
            if sm.plan.trial is not None:
                break
        assert paths[:2] == ["as-written", "recorded"], paths
        assert sm.plan.trial is not None and sm.plan.executor != "eager", paths
        # Once a plan runs, no settled layout counts new sizes: each planned call would
        # pay its check before the full path.
        assert sm._ss.settled is None and sm._ss.settled_more == ()
        for _ in range(3):
            x = torch.randn(*shape)
            assert_close(sm(x), model(x), atol=1e-4, rtol=1e-4)
            assert_path(sm, "plan")


def test_a_planned_size_whose_trial_stalled_is_not_taken_for_a_new_one(full_calls):
    """A trial handed over after a stall leaves its bucket neither decided nor under
    trial, and its size out of the table of sizes seen once (it was planned): when that
    size comes back it runs its plan's trial through the full path, not as a new size."""
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    for _ in range(2):  # 17 is recorded: the trial of the bucket 32 runs at 17
        x = torch.randn(17, 16)
        sm(x)
    assert_path(sm, "recorded")
    for i in range(signatures.STALL_CALLS):  # other sizes of the bucket: the trial stalls
        x = torch.randn(18 + i % 15, 16)
        assert_close(sm(x), model(x))
    structure = next(iter(sm._ss.structures.values()))
    assert not structure.trying and not structure.decisions and (17, 16) in [s[0] for s in structure.planned]
    before = len(full_calls)
    x = torch.randn(17, 16)
    assert_close(sm(x), model(x))
    assert len(full_calls) == before + 1
    assert "new to this call structure" not in sm.plan.reason


class _Untraceable(nn.Module):
    """Control flow on a tensor's value: its forward cannot be traced."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        if float(x.sum()) > 1e9:
            return self.a(x)
        return self.a(x) + self.b(x)


def test_an_untraceable_structure_keeps_no_sizes_after_its_first_call():
    """Its first call runs as written, the second finds it untraceable: it then runs as
    an untraceable structure always has (eager dispatch, then as written once quiet), with
    no size policy to keep (which counted each call of its one size as a re-planned size
    and called it churn)."""
    model = _Untraceable().eval()
    sm = ss.StreamScheduledModule(model)
    paths = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(12):
            x = torch.randn(4, 16)
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
    assert paths[:2] == ["as-written", "eager-dispatch"], paths
    assert "churn" not in sm.plan.reason and len(sm._ss.structures) == 0, sm.plan.reason


def test_a_call_run_as_written_names_the_models_device():
    """``sm.plan`` of a structure's first call in inference (run as written) says where
    the model is, as a planned call's does."""
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        x = torch.randn(3, 16)
        assert_close(sm(x), model(x))
    assert_path(sm, "as-written")
    assert sm.plan.device == "cpu"
    assert "on cpu)" in str(sm.plan).splitlines()[0]


NONE_RAN = "the model ran as written: none of the tasks below ran"


def test_a_new_size_run_as_written_says_its_plans_tasks_did_not_run():
    """A new size in training runs as written and ``sm.plan`` reports the call structure's
    plan at the other size: it says that none of those tasks ran; a planned call does not."""
    model = Towers()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    for n in (8, 8, 12):
        x = torch.randn(n, 16)
        with torch.enable_grad():
            out, expected = sm(x), ref(x)
            out.sum().backward()
            expected.sum().backward()
        assert_close(out, expected)
        if n == 8:
            assert_path(sm, "recorded", "plan")  # (the auto trial's first two calls)
            assert NONE_RAN not in str(sm.plan)
    assert_path(sm, "as-written")
    assert sm.plan.executor == "eager" and sm.plan.tasks and sm.plan.coverage == 0.0
    assert "12x16" in sm.plan.reason and NONE_RAN in str(sm.plan)


class CapacityRouter(nn.Module):
    """Assigns an attribute it reads from the number of tokens on every call, as
    NLLB-MoE's router assigns ``expert_capacity`` in eval."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.capacity = 1

    def forward(self, x):
        self.capacity = max(1, x.shape[0] // 2)
        return self.gate(x)[:, :1] * self.capacity


class Routed(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = CapacityRouter()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return self.a(x) + self.b(x) * self.router(x)


def test_a_forward_assigning_what_it_reads_on_every_call_keeps_the_shortcut(full_calls, monkeypatch):
    """The attribute moves the generation on every call whose size changed it; once the
    calls settled to run as written, that move (the model's own) does not send each call
    back to the full path, while a change made between calls still does."""
    original = Runner._timed

    def written_faster(self, compiled, name, *args, **kwargs):  # the trial's verdict: as written
        out, _ = original(self, compiled, name, *args, **kwargs)
        return out, 1e-4 if name == "eager" else 1e-3

    monkeypatch.setattr(Runner, "_timed", written_faster)
    model = Routed().eval()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    sizes = [3, 8, 5]
    for i in range(45):
        x = torch.randn(sizes[i % 3], 16)
        assert_close(sm(x), ref(x))
    assert_path(sm, "as-written")
    before = len(full_calls)
    for i in range(30):
        x = torch.randn(sizes[i % 3], 16)
        assert_close(sm(x), ref(x))
        assert_path(sm, "as-written")
    assert len(full_calls) == before, f"{len(full_calls) - before} of 30 settled calls took the full path"
    # A change between calls: the next call is checked on the full path (and still right).
    model.router.gate = ref.router.gate = nn.Linear(16, 4)
    x = torch.randn(3, 16)
    assert_close(sm(x), ref(x))
    assert len(full_calls) == before + 1
