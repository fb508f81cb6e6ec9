"""Calls of a signature whose plan runs as one generated function take the shortcut of
``hot_plans.py``: no binding, plan key or LRU lookup. Everything the full path would
decide otherwise sends the call back to it. Each test counts the full path's calls
(``Runner.call``) to tell which way a call went, and compares with eager on fresh inputs."""

from __future__ import annotations

import copy
import random
import threading

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import streamsched as ss
from streamsched.hot_plans import MAX_HOT_SHAPES, HotPlans
from streamsched.testing import assert_path, last_path

from .helpers import assert_close
from .test_transposed_layout import Ensemble

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _hot(rows: int = 4, grad: bool = False, **options) -> tuple[nn.Module, ss.StreamScheduledModule]:
    """An ensemble and its wrapper, called until its signature at ``rows`` rows (under
    grad mode ``grad``) is hot."""
    torch.manual_seed(0)
    model = Ensemble(n=4, fin=5, hidden=6, fout=2).eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), **{"executor": "serial", **options})
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x = torch.randn(rows, 5)
            assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    assert sm._ss.hot_plans is not None
    return model, sm


def _fresh_calls_equal_eager(
    sm, model, rows: int = 4, calls: int = 3, path: str | tuple = "plan:serial", grad: bool = False, dtype=torch.float32
) -> None:
    with torch.set_grad_enabled(grad):
        for _ in range(calls):
            x = torch.randn(rows, 5, dtype=dtype)
            y = sm(x)
            assert_path(sm, *((path,) if isinstance(path, str) else path))
            assert_close(y, model(x))
            assert y.dtype == dtype


def test_a_hot_signature_skips_the_full_path(full_calls):
    model, sm = _hot()
    full_calls.clear()
    _fresh_calls_equal_eager(sm, model, calls=10)
    assert full_calls == []
    assert "fused" in str(sm.plan)  # what sm.plan reports is the plan that ran
    # Another layout (the grad mode): recorded, planned, then hot in place of the first
    # (it repeats its previous call's signature).
    _fresh_calls_equal_eager(sm, model, calls=1, grad=True, path="recorded")
    _fresh_calls_equal_eager(sm, model, calls=2, grad=True)
    assert len(full_calls) == 3
    _fresh_calls_equal_eager(sm, model, calls=5, grad=True)
    assert len(full_calls) == 3


def test_the_mode_it_already_has_set_again_before_every_call_keeps_the_shortcut(full_calls):
    # ``model.eval()`` at the top of every step of a model already in eval mode changes
    # no flag: the calls stay on the shortcut (each went through the full path, which
    # re-keys the modes over the whole tree).
    model, sm = _hot()
    full_calls.clear()
    for _ in range(3):
        sm.eval()
        _fresh_calls_equal_eager(sm, model, calls=1)
        sm.module.eval()
        _fresh_calls_equal_eager(sm, model, calls=1)
        sm.module.towers[0].training = False
        _fresh_calls_equal_eager(sm, model, calls=1)
    assert full_calls == []
    # A flag that changes still sends the call to the full path.
    sm.module.towers[1].training = True
    model.towers[1].training = True
    _fresh_calls_equal_eager(sm, model, calls=1, path=("recorded", "plan:serial"))
    assert len(full_calls) == 1


def test_a_conversion_that_changes_nothing_keeps_the_plans(full_calls):
    # ``sm.to(device)`` before every step of a model already there: each call stays on
    # its plan (it dropped every plan, and the next call of a size new to the wrapper in
    # inference ran the model as written, for good).
    model, sm = _hot()
    full_calls.clear()
    for convert in (lambda: sm.to("cpu"), sm.float, lambda: sm.to(torch.float32), lambda: sm.module.to("cpu")):
        convert()
        _fresh_calls_equal_eager(sm, model, calls=2)
    assert full_calls == []
    # One that changes the tensors drops them: traced again, in the new dtype.
    sm.double()
    model.double()
    _fresh_calls_equal_eager(sm, model, calls=1, path=("recorded", "as-written"), dtype=torch.float64)
    _fresh_calls_equal_eager(sm, model, calls=2, path="plan:serial", dtype=torch.float64)
    # And one that moves their data (same tensors, same dtype): planned again.
    sm.share_memory()
    model.share_memory()
    calls = len(full_calls)
    _fresh_calls_equal_eager(sm, model, calls=3, path=("recorded", "as-written", "plan:serial"), dtype=torch.float64)
    assert len(full_calls) > calls


def test_a_model_built_in_inference_mode_converts():
    # Its tensors have no version counter for the conversion's watch to read.
    torch.manual_seed(0)
    with torch.inference_mode():
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        wrapped = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        wrapped.load_state_dict(model.state_dict())
    assert next(wrapped.parameters()).is_inference()
    sm = ss.StreamScheduledModule(wrapped)
    x = torch.randn(3, 4)
    with torch.inference_mode():
        assert_close(sm(x), model(x))
        sm.to("cpu")
        assert_close(sm(x), model(x))
        sm.double()
        assert_close(sm(x.double()), model.double()(x.double()))


def test_the_fused_weights_written_between_calls_are_read(full_calls):
    model, sm = _hot()
    full_calls.clear()
    with torch.no_grad():
        for p, q in zip(model.parameters(), sm.module.parameters()):
            p.mul_(1.5)
            q.mul_(1.5)  # in place: the stacks are the members' storage
    _fresh_calls_equal_eager(sm, model)
    assert full_calls == []
    with torch.no_grad():
        for p, q in zip(model.parameters(), sm.module.parameters()):
            new = torch.randn_like(p)
            p.data = new
            q.data = new.clone()  # another storage: the stacks' guard re-stacks
    _fresh_calls_equal_eager(sm, model)


class _Observer:
    def __init__(self):
        self.tasks: list = []

    def push(self, task, stream):
        self.tasks.append(task)

    def pop(self, task, stream):
        pass


@pytest.mark.filterwarnings("ignore::streamsched.errors.HooksWarning")  # (a global hook's: tested elsewhere)
@pytest.mark.parametrize(
    "change", ["forward hook", "global hook", "swapped child", "train mode", "cast", "invalidate", "verdict"]
)
def test_what_the_full_path_would_decide_otherwise_sends_the_call_to_it(full_calls, change):
    model, sm = _hot()
    full_calls.clear()
    seen: list = []
    handle = None
    path, dtype = "plan:serial", torch.float32
    if change == "forward hook":
        handle = sm.module.towers[1].l2.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        path = ("plan:serial", "as-written", "recorded")
    elif change == "global hook":
        handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append(type(m)))
        path = ("as-written",)
    elif change == "swapped child":
        for m in (model, sm.module):
            m.towers[2].a2 = nn.Sigmoid()
        path = ("recorded", "plan:serial")
    elif change == "train mode":
        for m in (model, sm.module):
            m.towers[0].a1 = nn.Dropout(0.0)
            m.train()
        path = ("recorded", "plan:serial")
    elif change == "cast":
        model.double()
        sm.module.double()
        dtype = torch.float64
        path = ("recorded", "plan:serial")
    elif change == "invalidate":
        sm.invalidate()
        path = ("recorded", "plan:serial")
    elif change == "verdict":
        sm._ss.last.run_as_written("a test's decision")
        path = ("as-written",)
    try:
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(4, 5, dtype=dtype)
                y = sm(x)
                assert_path(sm, *path)
                assert_close(y, model(x))
                assert y.dtype == dtype
        assert full_calls, "the change went unnoticed: the stale plan ran"
        if change in ("forward hook", "global hook"):
            assert seen, "the hook never fired"
    finally:
        if handle is not None:
            handle.remove()


def test_an_observed_call_takes_the_full_path(full_calls):
    model, sm = _hot()
    full_calls.clear()
    observer = _Observer()
    with torch.no_grad(), sm.observing(observer):
        x = torch.randn(4, 5)
        assert_close(sm(x), model(x))
    assert observer.tasks, "the observer saw no task"
    assert len(full_calls) == 1


def test_a_call_inside_activation_checkpointing_runs_as_written(full_calls):
    model, sm = _hot(grad=True)
    full_calls.clear()
    x = torch.randn(4, 5)  # the hot layout: grad mode on, the input without grad
    y = checkpoint(sm, x, use_reentrant=False)
    assert_path(sm, "as-written")
    y.sum().backward()
    model(x).sum().backward()
    for p, q in zip(model.parameters(), sm.module.parameters()):
        assert_close(q.grad, p.grad)
    assert full_calls, "the checkpoint's saved-tensor hooks went unnoticed"
    # The table was dropped (a lasting state would cost each call the check before the
    # full path); the next call outside the region registers the signature again.
    assert sm._ss.hot_plans is None
    full_calls.clear()
    _fresh_calls_equal_eager(sm, model, calls=3, grad=True)
    assert len(full_calls) == 1 and sm._ss.hot_plans is not None


class _CastsToItsWeights(nn.Module):
    """Casts its input to its weights' dtype (the trace bakes that dtype in), then runs
    two heads."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x):
        x = x.to(self.a.weight.dtype)
        return self.a(x).sum(1) + self.b(x).sum(1)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_model_cast_after_its_plan_went_hot_is_traced_again(full_calls, fuse):
    torch.manual_seed(0)
    model = _CastsToItsWeights().eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial", fuse=fuse)
    _fresh_calls_equal_eager(sm, model, calls=1, path="recorded")
    _fresh_calls_equal_eager(sm, model, calls=3)
    assert sm._ss.hot_plans is not None
    assert (sm._ss.last.program.stack_guard is not None) is fuse  # no stacks' guard to notice
    full_calls.clear()
    model.double()
    sm.module.double()
    with torch.no_grad():
        x = torch.randn(4, 5)  # the hot layout: only the weights were cast
        y = sm(x)
        assert_path(sm, "recorded")
        assert y.dtype == torch.float64
        assert_close(y, model(x))
    assert full_calls


def test_shapes_each_hot_and_the_table_bounded(full_calls):
    model, sm = _hot()
    for rows in (2, 3, 5):  # each recorded, planned, then hot
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=1, path="recorded")
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=2)
    full_calls.clear()
    for _ in range(2):
        for rows in (4, 2, 3, 5):
            _fresh_calls_equal_eager(sm, model, rows=rows, calls=1)
    assert full_calls == []
    for rows in range(6, 6 + MAX_HOT_SHAPES):
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=1, path="recorded")
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=1)
    assert len(sm._ss.hot_plans.sizes) <= MAX_HOT_SHAPES


def test_an_evicted_plan_is_planned_again_not_run_from_the_table(full_calls):
    model, sm = _hot(plan_cache_size=1)
    _fresh_calls_equal_eager(sm, model, rows=7, calls=1, path="recorded")  # evicts rows=4's plan
    _fresh_calls_equal_eager(sm, model, rows=7, calls=2)
    full_calls.clear()
    _fresh_calls_equal_eager(sm, model, rows=4, calls=1, path="recorded")
    assert full_calls


def test_a_hot_plan_stays_in_the_cache_while_other_sizes_come_and_go(full_calls):
    model, sm = _hot(plan_cache_size=2)
    for rows in (7, 8, 9, 10):
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=1, path="recorded")
        _fresh_calls_equal_eager(sm, model, rows=4, calls=1)  # kept the most recent: never recorded again
        _fresh_calls_equal_eager(sm, model, rows=rows, calls=1)  # planned (the cache's least recent goes)
        _fresh_calls_equal_eager(sm, model, rows=4, calls=1)


def test_a_layout_switched_every_call_does_not_rebuild_the_table(full_calls):
    model, sm = _hot()
    _fresh_calls_equal_eager(sm, model, calls=1, grad=True, path="recorded")
    table = sm._ss.hot_plans
    for i in range(6):
        _fresh_calls_equal_eager(sm, model, calls=1, grad=bool(i % 2))
    assert sm._ss.hot_plans is table


def test_modes_switched_every_call_do_not_rebuild_the_table(monkeypatch, full_calls):
    model, sm = _hot()
    made = []
    original = HotPlans.__init__

    def counted(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(HotPlans, "__init__", counted)
    for i in range(8):
        sm.train(i % 2 == 0)
        model.train(i % 2 == 0)
        _fresh_calls_equal_eager(sm, model, calls=1, path=("recorded", "plan:serial"))
    assert made == []
    sm.eval()
    model.eval()
    _fresh_calls_equal_eager(sm, model, calls=3)  # one mode again: hot from its second call
    assert len(made) == 1
    full_calls.clear()
    _fresh_calls_equal_eager(sm, model, calls=3)
    assert full_calls == []


def test_a_bad_input_gets_the_full_paths_error_and_the_next_call_works():
    model, sm = _hot()
    with torch.no_grad():
        with pytest.raises(RuntimeError):
            sm(torch.randn(4, 6))  # another shape: the full path, which names the problem
    _fresh_calls_equal_eager(sm, model)


def test_threads_calling_one_hot_wrapper_each_get_their_own_result():
    model, sm = _hot()
    errors: list = []

    def worker(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            with torch.no_grad():
                for _ in range(50):
                    x = torch.randn(4, 5, generator=g)
                    assert_close(sm(x), model(x))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_lasting_state_the_shortcut_cannot_take_leaves_no_table(full_calls):
    """While something the shortcut must not skip holds (here an NVTX tool listening, as
    ``Runner.direct``'s third field reports it), the signature is not registered again
    after the table is dropped: each call would pay the check before the full path."""
    model, sm = _hot()
    compiled = sm._ss.last
    verdict, program, _ = compiled.direct
    compiled.direct = (verdict, program, lambda: True)
    full_calls.clear()
    _fresh_calls_equal_eager(sm, model, calls=4)
    assert len(full_calls) == 4
    assert sm._ss.hot_plans is None


class _NormedHeads(nn.Module):
    """Heads with a BatchNorm (its running statistics written in training) and a dict
    output holding a value computed outside the heads."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)) for _ in range(3)
        )

    def forward(self, x):
        return {"a": torch.cat([h(x) for h in self.heads], 1), "b": x.sum()}


class _WritesItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(5, 4), nn.Linear(5, 4)

    def forward(self, x):
        y = self.a(x) + self.b(x)
        x.mul_(2)
        return y, x


class _Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.h = nn.ModuleList(nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.Tanh()) for _ in range(4))

    def forward(self, x):
        return torch.stack([h(x) for h in self.h])


def _leaves(out) -> list:
    if isinstance(out, dict):
        return list(out.values())
    return list(out) if isinstance(out, (list, tuple)) else [out]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize(
    "make",
    [
        lambda: Ensemble(n=4, fin=5, hidden=6, fout=1),
        lambda: Ensemble(n=3, fin=5, hidden=6, fout=2, out="list"),
        _NormedHeads,
        _WritesItsInput,
        _Dropped,
    ],
    ids=["stacked", "list", "batchnorm-dict", "writes-input", "dropout"],
)
def test_random_call_sequences_equal_eager(full_calls, make, seed):
    """Sizes, the grad mode and the modules' mode changing at random, optimizer steps and
    weights re-pointed between calls: every output, input write, gradient and buffer as
    eager's, with many calls on the shortcut (none for a plan that writes its input: its
    order of in-place writes holds for one aliasing of the inputs, which the full path
    checks)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = make().eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), executor="serial")
    opt_m = torch.optim.SGD(model.parameters(), lr=1e-3)
    opt_s = torch.optim.SGD(sm.module.parameters(), lr=1e-3)
    planned = 0
    for step in range(80):
        grad = rng.random() < 0.3
        if rng.random() < 0.1:
            mode = rng.random() < 0.5
            model.train(mode)
            sm.train(mode)
        x = torch.randn(rng.choice([4, 4, 4, 4, 16, 7]), 5)
        xa, xb = x.clone(), x.clone()
        draws = rng.randrange(1 << 30)
        before = len(full_calls)
        with torch.set_grad_enabled(grad):
            torch.manual_seed(draws)
            expected = model(xa)
            torch.manual_seed(draws)
            got = sm(xb)
        planned += last_path(sm) == "plan:serial" and len(full_calls) == before
        for e, g in zip(_leaves(expected), _leaves(got)):
            assert_close(g, e, atol=1e-5, what=f"step {step}")
        assert torch.equal(xa, xb)
        if grad and any(t.requires_grad for t in _leaves(expected)):
            opt_m.zero_grad()
            opt_s.zero_grad()
            try:
                sum(t.sum() for t in _leaves(expected) if t.requires_grad).backward()
            except RuntimeError:  # eager's backward refuses (the input written in place)
                with pytest.raises(RuntimeError):
                    sum(t.sum() for t in _leaves(got) if t.requires_grad).backward()
                continue
            sum(t.sum() for t in _leaves(got) if t.requires_grad).backward()
            for (name, p), q in zip(model.named_parameters(), sm.module.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if p.grad is not None:
                    assert_close(q.grad, p.grad, atol=1e-4, rtol=1e-3, what=name)
            opt_m.step()
            opt_s.step()
        if rng.random() < 0.05:
            with torch.no_grad():
                for p, q in zip(model.parameters(), sm.module.parameters()):
                    p.data = torch.randn_like(p)
                    q.data = p.data.clone()
        for name, b in model.named_buffers():
            assert_close(sm.module.get_buffer(name).float(), b.float(), atol=1e-5, what=name)
    if make is _WritesItsInput:
        assert planned == 0
    else:
        assert planned >= 5, "the shortcut was never taken: this sequence tests nothing of it"
