"""Calls settled to run the model as written whatever their sizes (settled_calls.py): a
call passing an object once its nested children went quiet, and a call of a structure
run as written at every size. They skip binding and keys; everything that could change
the verdict sends the call back to the full path. Each test counts the full path's calls
(``streamsched.runner.Runner.call``) to tell which way a call went, and compares with eager."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched import nesting
from streamsched.new_signatures import NESTED_GAIN_S
from streamsched.planning.choice import Trial
from streamsched.planning.plan import Plan
from streamsched.runner import Runner
from streamsched.testing import assert_path, last_path

from .helpers import assert_close
from .test_dynamic_calls import Cache, Chain, Towers, WithCache, _slow_schedules

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _settle_objects(sm: ss.StreamScheduledModule, model: nn.Module) -> None:
    for _ in range(4):
        x, cache = torch.randn(3, 16), Cache()
        assert_close(sm(x, past=cache), model(x, past=cache))
    assert sm._ss.settled is not None


def test_object_calls_skip_the_full_path_once_settled(full_calls):
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    full_calls.clear()
    refs = []
    for _ in range(20):
        x, cache = torch.randn(3, 16), Cache()
        refs.append(weakref.ref(cache))
        assert_close(sm(x, past=cache), model(x, past=cache))
        assert_path(sm, "as-written")
        del cache
    assert full_calls == []
    gc.collect()
    assert all(r() is None for r in refs)  # the shortcut keeps types, not objects
    assert "Cache object" in sm.plan.reason


def test_another_layout_takes_the_full_path(full_calls):
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    full_calls.clear()
    x = torch.randn(3, 16)
    assert_close(sm(x, past=None), model(x, past=None))  # no object: traced and planned
    assert_path(sm, "recorded")
    assert_close(sm(x), model(x))
    assert len(full_calls) == 2


def test_a_hook_registered_on_the_model_fires_after_settling(full_calls):
    """Registering a hook moves the generation: the call takes the full path, which
    runs the model's own __call__ and so its hooks."""
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    handle = model.register_forward_hook(lambda m, i, out: out * 2)
    x, cache = torch.randn(3, 16), Cache()
    assert_close(sm(x, past=cache), model(x, past=cache))  # both doubled
    handle.remove()
    assert_close(sm(x, past=cache), model(x, past=cache))


def test_a_global_hook_fires_after_settling():
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    seen = []
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, out: seen.append(type(m).__name__))
    try:
        x, cache = torch.randn(3, 16), Cache()
        sm(x, past=cache)
        wrapped = list(seen)
        seen.clear()
        model(x, past=cache)
        # The wrapper's own call fires it too; the model's calls fire it as in eager.
        assert sorted(n for n in wrapped if n != "StreamScheduledModule") == sorted(seen)
        assert "WithCache" in seen
    finally:
        handle.remove()


def test_a_swapped_child_is_called_after_settling():
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    model.b = nn.Linear(16, 16)
    x, cache = torch.randn(3, 16), Cache()
    assert_close(sm(x, past=cache), model(x, past=cache))


def test_the_nested_children_are_retried_on_schedule(monkeypatch, full_calls):
    """The shortcut counts the parent's calls for the nested children's retry, and hands
    the call due for one back to the full path."""
    monkeypatch.setattr(nesting, "_RETRY_EVERY", 8)
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    full_calls.clear()
    for _ in range(32):
        x, cache = torch.randn(3, 16), Cache()
        assert_close(sm(x, past=cache), model(x, past=cache))
    # One call in eight retries (the full path), and the next one settles again.
    assert 4 <= len(full_calls) <= 10, len(full_calls)


def test_an_observed_call_takes_the_full_path(full_calls):
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    _settle_objects(sm, model)
    full_calls.clear()

    class Observer:
        def push(self, task, stream):
            pass

        def pop(self, task, stream):
            pass

    with sm.observing(Observer()):
        x, cache = torch.randn(3, 16), Cache()
        assert_close(sm(x, past=cache), model(x, past=cache))
    assert len(full_calls) == 1


def _settle_every_size(sm: ss.StreamScheduledModule, model: nn.Module) -> None:
    for _rep in range(6):
        for n in (3, 6, 12, 24, 48):
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
    assert "every size of this call structure" in sm.plan.reason
    assert sm._ss.settled is not None


def test_a_structure_run_as_written_at_every_size_skips_the_full_path(monkeypatch, full_calls):
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    _settle_every_size(sm, model)
    full_calls.clear()
    for n in range(1, 40):  # decoding that grows the input: a new size every call
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert full_calls == []


def test_the_plan_of_a_structure_settled_at_every_size_names_no_one_size(monkeypatch):
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    _settle_every_size(sm, model)
    for n in (7, 31):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
        # One report stands for every size: it names none of them.
        assert sm.plan.signature == "float32[2-d]", sm.plan.signature


@pytest.mark.parametrize(
    "change",
    ["dtype", "requires_grad", "rank", "no_grad", "keyword", "two_args"],
)
def test_what_the_structure_key_holds_besides_sizes_takes_the_full_path(monkeypatch, full_calls, change):
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    _settle_every_size(sm, model)
    full_calls.clear()
    x = torch.randn(5, 16)
    if change == "dtype":
        model.double()
        out, expected = sm(x.double()), model(x.double())
        model.float()
    elif change == "requires_grad":
        x.requires_grad_(True)
        out, expected = sm(x), model(x)
    elif change == "rank":
        out, expected = sm(x.unsqueeze(0)), model(x.unsqueeze(0))
    elif change == "no_grad":
        with torch.no_grad():
            out, expected = sm(x), model(x)
    elif change == "keyword":
        out, expected = sm(x=x), model(x=x)
    else:
        with pytest.raises(TypeError, match="Chain"):
            sm(x, x)
        assert len(full_calls) == 1
        return
    assert_close(out, expected)
    assert len(full_calls) == 1


def test_grad_flows_through_a_settled_call(monkeypatch):
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    _settle_every_size(sm, model)
    x = torch.randn(7, 16)
    sm(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        assert_close(got, want)


def test_sizes_settled_one_by_one_skip_the_full_path_at_those_sizes(monkeypatch, full_calls):
    """A size bucket decided for the model as written (towers side by side: not one
    verdict for every size): the sizes that settled take the shortcut, a size of another
    bucket takes the full path, and sm.plan reports each call's own signature."""
    _slow_schedules(monkeypatch)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    bucket = (17, 20, 24, 29, 32)  # one size bucket: 32
    for _rep in range(6):
        for n in bucket:
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
    assert sm._ss.settled is not None and sm._ss.settled.sizes is not None
    full_calls.clear()
    for n in bucket:
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
        assert sm.plan.executor == "eager"
        assert sm.plan.signature == f"float32[{n}, 16]"  # this call's own signature
    assert full_calls == []
    x = torch.randn(100, 16)  # another bucket: its own trial, through the full path
    assert_close(sm(x), model(x))
    assert len(full_calls) == 1
    x = torch.randn(20, 16)
    assert_close(sm(x), model(x))
    assert len(full_calls) == 1


def test_a_hook_on_the_wrapper_keeps_firing_and_the_layout_is_not_settled_again(monkeypatch):
    """A hook on the wrapper sends every call through nn.Module.__call__ and the full path,
    which finds the layout settled already: no new record per call."""
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    seen = []
    sm.register_forward_hook(lambda m, i, out: seen.append(1))
    _settle_every_size(sm, model)
    record = sm._ss.settled
    seen.clear()
    for n in (3, 9, 27):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert len(seen) == 3
    assert sm._ss.settled is record


class Scaled(nn.Module):
    """Keywords as transformers' forwards take them: tensors and plain values."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor = None, scale: float = 1.0) -> torch.Tensor:
        out = self.body(x) * scale
        return out if mask is None else out * mask


def test_keyword_tensors_and_plain_values_settle_and_values_key_by_value(monkeypatch, full_calls):
    _slow_schedules(monkeypatch)
    model = Scaled()
    sm = ss.StreamScheduledModule(model)
    for _rep in range(6):
        for n in (3, 6, 12, 24, 48):
            x, mask = torch.randn(n, 16), torch.rand(n, 1)
            assert_close(sm(x=x, mask=mask, scale=2.0), model(x=x, mask=mask, scale=2.0))
    assert "every size of this call structure" in sm.plan.reason
    full_calls.clear()
    for n in (5, 7, 9):
        x, mask = torch.randn(n, 16), torch.rand(n, 1)
        assert_close(sm(mask=mask, scale=2.0, x=x), model(x=x, mask=mask, scale=2.0))  # any keyword order
        assert_path(sm, "as-written")
    assert full_calls == []
    x, mask = torch.randn(5, 16), torch.rand(5, 1)
    assert_close(sm(x=x, mask=mask, scale=3.0), model(x=x, mask=mask, scale=3.0))  # another value
    assert len(full_calls) == 1
    assert_close(sm(x=x, mask=None, scale=2.0), model(x=x, mask=None, scale=2.0))  # None for a tensor
    assert len(full_calls) == 2


class TowersMasked(Towers):
    def forward(self, x: torch.Tensor, mask: torch.Tensor = None) -> torch.Tensor:
        return super().forward(x) * mask


def test_sizes_settled_one_by_one_with_keywords_in_any_order(monkeypatch, full_calls):
    _slow_schedules(monkeypatch)
    model = TowersMasked()
    sm = ss.StreamScheduledModule(model)
    bucket = (17, 20, 24, 29, 32)
    for _rep in range(6):
        for n in bucket:
            x, mask = torch.randn(n, 16), torch.rand(n, 1)
            assert_close(sm(x=x, mask=mask), model(x=x, mask=mask))
    assert sm._ss.settled is not None and sm._ss.settled.sizes is not None
    full_calls.clear()
    for n in bucket:
        x, mask = torch.randn(n, 16), torch.rand(n, 1)
        assert_close(sm(mask=mask, x=x), model(x=x, mask=mask))
        assert_path(sm, "as-written")
    assert full_calls == []


def test_settling_keeps_no_argument_tensor_alive(monkeypatch):
    """The layout check is made from the tensors' metadata: no table holds the tensors."""
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    refs = []
    for _rep in range(6):
        for n in (3, 6, 12, 24, 48):
            x = torch.randn(n, 16)
            refs.append(weakref.ref(x))
            sm(x)
            del x
    assert sm._ss.settled is not None
    gc.collect()
    assert all(r() is None for r in refs)


def _grad_and_autocast_states() -> list:
    """What real code switches around its calls: the three grad modes, CPU autocast."""
    return [
        torch.no_grad,
        torch.enable_grad,
        torch.inference_mode,
        lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    ]


@pytest.mark.parametrize("via", ["wrapper", "attached"])
def test_layouts_switched_around_every_call_each_stay_settled(monkeypatch, full_calls, via):
    """Grad modes and autocast are part of a settled layout's check: code that switches
    them around every call keeps one settled layout per state (up to
    MAX_SETTLED_LAYOUTS), each call taking the shortcut, not the full path. The model's
    own calls, routed through the wrapper by ``attach()``, check every layout kept too."""
    _slow_schedules(monkeypatch)
    model = Chain()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    states = _grad_and_autocast_states()
    for state in states:
        with state():
            _settle_every_size(sm, model)
    call = sm.attach() if via == "attached" else sm
    full_calls.clear()
    try:
        for i in range(24):
            x = torch.randn(1 + i, 16)
            with states[i % len(states)]():
                got, want = call(x), ref(x)
                assert_path(sm, "as-written")
            assert_close(got, want)
            assert got.dtype == want.dtype and got.requires_grad == want.requires_grad
    finally:
        sm.detach()
    assert full_calls == []


def test_a_layout_beyond_those_kept_takes_the_full_path(monkeypatch, full_calls):
    """Settled layouts are kept up to a bound: a fifth pushes the oldest out, whose next
    call takes the full path (and settles again)."""
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():  # the oldest
        _settle_every_size(sm, model)
    with torch.enable_grad():
        _settle_every_size(sm, model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _settle_every_size(sm, model)
        with torch.no_grad():
            _settle_every_size(sm, model)
    full_calls.clear()
    with torch.no_grad():
        x = torch.randn(5, 16)
        assert_close(sm(x), model(x))
    assert full_calls == []  # four layouts: all kept
    for _rep in range(6):  # a fifth: inputs of another rank
        for n in (3, 6, 12, 24, 48):
            x = torch.randn(2, n, 16)
            assert_close(sm(x), model(x))
    full_calls.clear()
    with torch.enable_grad():  # the oldest now, since the no_grad call above
        x = torch.randn(5, 16)
        assert_close(sm(x), model(x))
    assert len(full_calls) == 1


def test_a_bucket_decided_as_written_admits_its_sizes_never_called(monkeypatch, full_calls):
    """Once a size bucket is decided for the model as written, each of its sizes runs as
    written: sizes of the bucket never called before take the shortcut too (a decoding
    loop meets each length once), sm.plan naming their own signature; a size of another
    bucket still takes the full path."""
    _slow_schedules(monkeypatch)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    for _rep in range(6):
        for n in (17, 20, 24, 29, 32):  # one size bucket: 32
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
    assert "was decided for the model as written" in sm.plan.reason
    full_calls.clear()
    for n in (18, 19, 21, 25, 30, 31):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
        assert sm.plan.executor == "eager" and "was decided for the model as written" in sm.plan.reason
        assert sm.plan.signature == f"float32[{n}, 16]"
    assert full_calls == []
    x = torch.randn(40, 16)  # the bucket 64
    assert_close(sm(x), model(x))
    assert len(full_calls) == 1


class _TwoChildren(nn.Module):
    """An untraceable forward (control flow on a value) whose children are traceable: they
    are nested, each with a plan of its own."""

    def __init__(self):
        super().__init__()
        self.left = Chain()
        self.right = Towers()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.left(x)
        if float(h.sum()) > 1e9:
            return h
        return h + self.right(x)


def test_a_nested_child_whose_schedule_saves_less_than_nesting_costs_runs_as_written(monkeypatch, full_calls):
    """A nested child's schedule costs each call of the parent the nesting (its full path,
    the child's wrapper): a schedule a few microseconds faster than the child's forward
    is not kept, the child stops being nested and the parent's calls settle."""
    original = Runner._timed

    def timed(self, compiled, name, *args, **kwargs):
        out, _ = original(self, compiled, name, *args, **kwargs)
        return out, 30e-6 if name == "eager" else 25e-6  # the schedule 5 us faster

    monkeypatch.setattr(Runner, "_timed", timed)
    model = _TwoChildren()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        for _ in range(40):
            x = torch.randn(4, 16)
            assert_close(sm(x), model(x))
        for path in ("left", "right"):
            plan = sm.nested_plans[path]
            assert plan.executor == "eager" and "nesting this module costs" in plan.reason, plan.reason
        full_calls.clear()
        for _ in range(10):
            x = torch.randn(4, 16)
            assert_close(sm(x), model(x))
            assert_path(sm, "as-written")
    assert full_calls == []


@pytest.mark.parametrize("schedule_us", [25.0, 30.0, 30.3], ids=["5us-faster", "as-fast", "1pc-slower"])
def test_a_nested_childs_trial_keeps_no_schedule_that_saves_less_than_the_minimum_gain(schedule_us):
    """The minimum gain holds whatever the schedule's margin: a schedule as fast as the
    model's own forward, or slower by less than the trial's margin (2%), saves nothing,
    less than the nesting costs (a structure whose verdict is per size bucket has no
    schedule margin)."""
    trial = Trial("serial", as_written=True)
    trial.min_gain_s = NESTED_GAIN_S
    assert trial.schedule_margin == 0.0
    for _ in range(trial.max_rounds):
        trial.add("serial", schedule_us * 1e-6)
        trial.add("eager", 30e-6)
    assert trial.done()
    plan, eager = trial.decide(_plan())
    assert eager and plan.executor == "eager", plan.reason
    assert "nesting this module costs" in plan.reason, plan.reason
    # Without a minimum gain, a schedule as fast as the forward, or within the margin, stays.
    trial = Trial("serial", as_written=True)
    for _ in range(trial.max_rounds):
        trial.add("serial", schedule_us * 1e-6)
        trial.add("eager", 30e-6)
    _, eager = trial.decide(_plan())
    assert not eager


def _plan() -> Plan:
    """A serial plan of a small model, for a trial to decide on."""
    sm = ss.StreamScheduledModule(Chain(), executor="serial")
    sm(torch.randn(4, 16))
    return sm.plan


def test_a_bucket_whose_schedule_would_not_repay_a_plan_admits_its_new_sizes_not_its_planned_ones(
    monkeypatch, full_calls
):
    """A bucket decided for the schedule by a gain too small to repay a recording call per
    size runs its new sizes as written: they take the shortcut, never called before too;
    its planned size keeps running its plan, through the full path."""
    from streamsched.planning import signatures

    original = Runner._timed

    def timed(self, compiled, name, *args, **kwargs):
        out, _ = original(self, compiled, name, *args, **kwargs)
        return out, 30e-6 if name == "eager" else 20e-6  # the schedule faster, on every machine

    monkeypatch.setattr(Runner, "_timed", timed)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    for _ in range(3):
        x = torch.randn(17, 16)
        assert_close(sm(x), model(x))
    compiled = sm._ss.plans[next(iter(sm._ss.plans))]
    structure = compiled.structure
    structure.record_s = 0.5
    gain_s = 0.5 / (signatures.PAYBACK_CALLS * 2)
    structure.decide(
        signatures.size_bucket(compiled.sizes),
        signatures.Decision(False, "serial", "planted", compiled.sizes, gain_s=gain_s),
    )
    x = torch.randn(20, 16)
    assert_close(sm(x), model(x))
    assert "would take more than" in sm.plan.reason
    full_calls.clear()
    for n in (21, 25, 30, 20):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
        assert sm.plan.signature == f"float32[{n}, 16]"
    assert full_calls == []
    for calls in (1, 2):
        x = torch.randn(17, 16)
        assert_close(sm(x), model(x))
        assert last_path(sm).startswith("plan:"), last_path(sm)
        assert len(full_calls) == calls


def test_new_sizes_past_the_table_of_sizes_seen_keep_the_shortcut(full_calls):
    # A batch and a length that both vary bring more distinct sizes than the structure's
    # table of sizes seen holds: once it is full, each new size forgets the oldest (as
    # the size policy's own count does) and keeps running as written on the shortcut;
    # before, every new size from then on took the full path.
    model = Towers().eval()
    sm = ss.StreamScheduledModule(model)
    with torch.no_grad():
        sm(torch.randn(1, 1, 16))
        structure = next(iter(sm._ss.structures.values()))
        held = structure.seen.maxsize
        shapes = [(1 + i % 8, 2 + i // 8) for i in range(1, held + 40)]
        for b, n in shapes[: held - 1]:
            sm(torch.randn(b, n, 16))
        assert len(structure.seen) == held
        full_calls.clear()
        for b, n in shapes[held - 1 :]:
            x = torch.randn(b, n, 16)
            assert_close(sm(x), model(x))
            assert_path(sm, "as-written")
    assert full_calls == [], f"{len(full_calls)} of 40 new sizes took the full path"
    assert len(structure.seen) == held
