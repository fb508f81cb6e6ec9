"""Call patterns real code has: sizes that change, decoding that grows the input, objects
passed on every call, a member swapped or a hook removed while wrapped, and the model's
own methods (``generate``) run through the wrapper. Every output is compared with eager,
and every check says which path the compared call ran."""

from __future__ import annotations

import gc
import time
import weakref

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.planning import signatures
from streamsched.testing import assert_path, last_path

from .helpers import assert_close


class Towers(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(d, w), nn.Tanh(), nn.Linear(w, d)) for w in (8, 12, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(t(x) for t in self.towers)


class Heads(nn.Module):
    def __init__(self, n: int = 8, d: int = 16):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(d, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([h(x) for h in self.heads])


class Cache:
    """Holds tensors, like transformers' DynamicCache; not a pytree node."""

    def __init__(self) -> None:
        self.k = torch.randn(2, 16)


class WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, past: object = None) -> torch.Tensor:
        out = self.a(x) + self.b(x)
        if past is not None:
            out = out + past.k.sum()
        return out


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# --- new sizes of a known structure --------------------------------------------------


def test_a_new_size_runs_as_written_then_is_planned_when_it_comes_back():
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    x8 = torch.randn(8, 16)
    assert_close(sm(x8), model(x8))
    assert_path(sm, "recorded")
    x3 = torch.randn(3, 16)
    assert_close(sm(x3), model(x3))
    assert_path(sm, "as-written")
    assert sm.plan.executor == "eager" and "new to this call structure" in sm.plan.reason
    assert sm.plan.signature == "float32[3, 16]"  # this call's, not the planned size's
    assert len(sm.plans) == 1
    x3 = torch.randn(3, 16)
    assert_close(sm(x3), model(x3))
    assert_path(sm, "recorded")
    assert len(sm.plans) == 2


def test_decoding_that_grows_the_input_never_records_again():
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    sm(torch.randn(1, 3, 16))
    for n in range(4, 40):
        x = torch.randn(1, n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert len(sm.plans) == 1


def test_explicit_executors_still_plan_every_size():
    model = Towers()
    sm = ss.StreamScheduledModule(model, executor="serial")
    for n in (3, 4, 5):
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "recorded")
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "plan:serial")


def test_churn_through_the_plan_cache_stops_planning_new_sizes():
    model = Towers()
    sm = ss.StreamScheduledModule(model, plan_cache_size=2)
    recorded = 0
    sizes = list(range(1, 7))
    for _ in range(8):
        for n in sizes:
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            recorded += last_path(sm) == "recorded"
    # Each of the 6 sizes planned once; re-plans stop after CHURN_REPLANS (or once more
    # sizes than CHURN_SIZES x the cache were planned).
    assert recorded <= len(sizes) + signatures.CHURN_REPLANS
    x = torch.randn(11, 16)
    sm(x)
    sm(torch.randn(11, 16))
    assert_path(sm, "as-written")
    assert "churn" in sm.plan.reason and "plan_cache_size" in sm.plan.reason
    assert len(sm.plans) <= 2


def test_the_trial_decides_once_per_size_bucket(monkeypatch):
    """A planted slow schedule: the first size's trial drops it after its second call; every
    other size of the bucket takes the verdict (as written) without a trial of its own."""
    from streamsched.runtime.serial import SerialExecutor
    from streamsched.runtime.threads import ThreadExecutor

    for executor in (SerialExecutor, ThreadExecutor):

        def slow(self, *args, _run=executor.run, **kwargs):
            time.sleep(0.02)
            return _run(self, *args, **kwargs)

        monkeypatch.setattr(executor, "run", slow)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    slow_calls = 0
    for _rep in range(6):
        for n in (17, 20, 24, 29, 32):  # one bucket: 32
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            slow_calls += last_path(sm).startswith("plan")
    # The bound: a candidate twice as slow as the leader runs twice in the bucket's trial
    # (the plan's executor, and serial where that is another).
    assert 2 <= slow_calls <= 4
    assert_path(sm, "as-written")
    assert "size bucket 32x16 was decided for the model as written" in sm.plan.reason


class Chain(nn.Module):
    """Nothing to run side by side and nothing to batch: one stream, no fused group."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _slow_schedules(monkeypatch) -> None:
    from streamsched.runtime.serial import SerialExecutor
    from streamsched.runtime.threads import ThreadExecutor

    for executor in (SerialExecutor, ThreadExecutor):

        def slow(self, *args, _run=executor.run, **kwargs):
            time.sleep(0.02)
            return _run(self, *args, **kwargs)

        monkeypatch.setattr(executor, "run", slow)


def test_a_structure_with_nothing_to_schedule_is_decided_once_for_every_size(monkeypatch):
    """Its schedule differs from the forward only by the forward's Python: one trial for
    the structure, not one per size bucket; sizes never planned take the verdict."""
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    paths = []
    for _rep in range(6):
        for n in (3, 6, 12, 24, 48):  # five size buckets
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
    assert paths.count("recorded") == 1, paths
    assert sum(p.startswith("plan") for p in paths) == 2, paths  # the slow schedule: twice in all
    for n in (5, 100, 100):  # sizes no call had: no recording, no trial
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert "every size of this call structure" in sm.plan.reason
    assert "decided for the model as written" in sm.plan.reason


def test_a_stalled_trial_of_a_structure_with_nothing_to_schedule_decides_as_written(monkeypatch):
    """Decoding meets each length once per sequence: the trial's size comes back only with
    the next sequence. After STALL_CALLS calls of other sizes, the structure is decided for
    the model as written, and the trial's own size takes that verdict when it comes back."""
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    lengths = range(2, 2 + signatures.STALL_CALLS + 10)
    admitted = []
    admit = signatures.Structure.admit
    monkeypatch.setattr(signatures.Structure, "admit", lambda self, *a: admitted.append(a) or admit(self, *a))
    for n in lengths:  # the first sequence: the first length is recorded and tried
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
    assert "stalled" in sm.plan.reason and "decided for the model as written" in sm.plan.reason
    for n in lengths:  # the next sequence: every length runs as written
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    asked = len(admitted)
    for n in lengths:  # every length is settled now: no call asks the size policy again
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert len(admitted) == asked
    x = torch.randn(2, 16)  # the trial's own length took the verdict
    assert_close(sm(x), model(x))
    assert_path(sm, "as-written")
    assert sm.plan.trial is None and sm.plan.executor == "eager"


def test_a_stalled_trial_of_a_size_bucket_hands_over_to_a_size_that_comes_back(monkeypatch):
    """A bucket's trial whose size never comes back would keep the bucket undecided for
    ever; after STALL_CALLS calls of other sizes, the next size that comes back is tried."""
    _slow_schedules(monkeypatch)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    paths = []
    x = torch.randn(17, 16)  # bucket 32x16: recorded, its trial waits for 17 to come back
    assert_close(sm(x), model(x))
    for _rep in range(signatures.STALL_CALLS // 15 + 6):
        for n in range(18, 33):
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
    # The size that took the trial over (and, where its own trial stalled in turn while
    # it waited for a second call of the slow schedule, the one after it).
    assert 1 <= paths.count("recorded") <= signatures.MAX_HANDOFFS, paths
    assert 2 <= sum(p.startswith("plan") for p in paths) <= 4, paths  # the slow schedule, dropped
    assert "size bucket 32x16 was decided for the model as written" in sm.plan.reason
    x = torch.randn(17, 16)  # the first trial's size: it takes the bucket's verdict
    assert_close(sm(x), model(x))
    assert_path(sm, "as-written")


def test_a_bucket_whose_trials_stall_again_and_again_is_decided_as_written(monkeypatch):
    """Sizes that each come back only after STALL_CALLS others, and trials that need more
    calls than that (planted: they never decide by themselves): a new trial per stall
    would plan size after size for nothing; after MAX_HANDOFFS hand-overs the bucket is
    decided for the model as written, and its sizes stop recording."""
    from streamsched.planning.choice import Trial

    monkeypatch.setattr(Trial, "done", lambda self: False)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    sizes = list(range(33, 33 + signatures.STALL_CALLS + 2))  # one bucket: 64 (and 128 for the last)
    sizes = [n for n in sizes if n <= 64]
    paths = []
    for _rep in range(2 * (signatures.MAX_HANDOFFS + 2)):
        for n in sizes:
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
    assert paths.count("recorded") == 1 + signatures.MAX_HANDOFFS, paths
    assert "stalled 3 times" in sm.plan.reason and "decided for the model as written" in sm.plan.reason
    tail = paths[-len(sizes) :]
    assert tail == ["as-written"] * len(sizes)


def test_a_settled_signature_skips_the_size_policy(monkeypatch):
    _slow_schedules(monkeypatch)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    for _ in range(4):
        sm(torch.randn(3, 16))  # recorded, then the trial drops the slow schedule
    assert sm.plan.executor == "eager"
    asked = []
    admit = signatures.Structure.admit
    monkeypatch.setattr(signatures.Structure, "admit", lambda self, *a: asked.append(a) or admit(self, *a))
    for _ in range(3):
        x = torch.randn(7, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "as-written")
    assert len(asked) == 1  # the first call of the size; the answer stands for the next
    assert "decided for the model as written" in sm.plan.reason
    model.eval()  # another mode is another call structure: traced and recorded anew
    x = torch.randn(7, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")


def test_a_bucket_decided_for_the_schedule_plans_new_sizes_without_a_trial():
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    structure_plans = []
    for n in (17, 17, 17):
        sm(torch.randn(n, 16))
    compiled = sm._ss.plans[next(iter(sm._ss.plans))]
    # Decide the bucket for the schedule, as a trial that kept it would.
    compiled.structure.decide(
        signatures.size_bucket(compiled.sizes),
        signatures.Decision(False, "serial", "planted", compiled.sizes),
    )
    for _ in range(3):
        x = torch.randn(20, 16)
        assert_close(sm(x), model(x))
        structure_plans.append(last_path(sm))
    assert structure_plans == ["as-written", "recorded", "plan:serial"]
    assert "size bucket decided" in sm.plan.reason and sm.plan.trial is None


def test_rss_and_tables_stay_bounded_over_many_sizes():
    model = Towers(8)
    sm = ss.StreamScheduledModule(model)

    def rss_mb() -> float:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * 4096 / 2**20

    with torch.no_grad():
        for i in range(1000):
            sm(torch.randn(1 + i % 1000, 8))
        gc.collect()
        before = rss_mb()
        for i in range(10_000):
            sm(torch.randn(1 + (i * 7) % 1000, 8))
        gc.collect()
        after = rss_mb()
    assert after - before < 40, (before, after)
    st = sm._ss
    assert len(st.plans) <= sm.config.plan_cache_size
    assert all(len(s.seen) <= s.seen.maxsize and len(s.planned) <= s.planned.maxsize for s in st.structures.values())


# --- objects passed on every call -----------------------------------------------------


def test_object_arguments_run_as_written_and_are_not_kept_alive():
    model = WithCache()
    sm = ss.StreamScheduledModule(model)
    refs = []
    for _ in range(20):
        cache = Cache()
        refs.append(weakref.ref(cache))
        x = torch.randn(3, 16)
        assert_close(sm(x, past=cache), model(x, past=cache))
        assert_path(sm, "as-written")
        del cache
    gc.collect()
    assert all(r() is None for r in refs)
    assert "Cache object" in sm.plan.reason
    assert len(sm._ss.traces) == 0
    # A call without the object is traced and planned as before.
    x = torch.randn(3, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")


def test_plain_values_still_key_by_value():
    from streamsched.frontend.binder import is_plain

    for value in (None, True, 3, 2.5, "x", torch.float16, torch.device("cpu"), torch.Size([2, 3]), (1, "a"), len):
        assert is_plain(value), value
    assert not is_plain(Cache()) and not is_plain((1, Cache())) and not is_plain(nn.Linear(1, 1))


# --- changes while wrapped ------------------------------------------------------------


def test_a_swapped_fused_member_is_stacked_again_not_copied_per_call():
    model = Heads()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(4, 16)
    sm(x)
    sm(x)
    assert sm.plan.fused_groups
    model.heads[3] = nn.Linear(16, 4)
    for _ in range(2):
        x = torch.randn(4, 16)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    assert sm.plan.fused_groups
    stacks = list(sm._ss.fusion._stacks.values())
    assert stacks and all(s.alias for s in stacks), "a group fell back to stacking per call"
    # The swapped member is a member of the stack: an in-place update reaches the kernel.
    with torch.no_grad():
        model.heads[3].weight.add_(1.0)
    x = torch.randn(4, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_removing_a_hook_restores_the_plan_without_it():
    model = Heads()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(4, 16)
    sm(x), sm(x)
    fused_before = [g.size for g in sm.plan.fused_groups]
    calls = []
    handle = model.heads[2].register_forward_hook(lambda m, i, o: calls.append(1))
    sm(x), sm(x)
    assert_path(sm, "plan:serial")
    assert calls == [1, 1]
    assert [g.size for g in sm.plan.fused_groups] != fused_before
    handle.remove()
    for _ in range(2):
        x = torch.randn(4, 16)
        assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")
    assert [g.size for g in sm.plan.fused_groups] == fused_before
    assert calls == [1, 1]


# --- the model's own methods ----------------------------------------------------------


class Decoder(nn.Module):
    """A tiny greedy decoder whose ``generate`` calls ``self(...)``, as Hugging Face's does."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.branches = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.head(sum(b(h) for b in self.branches))

    def generate(self, ids: torch.Tensor, steps: int) -> torch.Tensor:
        for _ in range(steps):
            ids = torch.cat([ids, self(ids)[:, -1:].argmax(-1)], dim=1)
        return ids


def test_attach_runs_the_models_own_methods_through_the_wrapper():
    model = Decoder()
    sm = ss.StreamScheduledModule(model, executor="serial")
    prompt = torch.randint(0, 50, (2, 4))
    expected = model.generate(prompt, 6)
    seen = []
    hook = model.register_forward_hook(lambda m, i, o: seen.append(1))
    assert sm.attach() is model
    out = model.generate(prompt, 6)
    assert torch.equal(out, expected)
    assert seen == [1] * 6, "the model's own hooks fire once per call"
    assert len(sm.plans) == 6 and last_path(sm) == "recorded"
    out = model.generate(prompt, 6)
    assert torch.equal(out, expected)
    assert_path(sm, "plan:serial")
    hook.remove()
    with sm.detached():
        assert "forward" not in model.__dict__
    assert "forward" in model.__dict__
    with pytest.raises(TypeError, match="detach"):
        import copy

        copy.deepcopy(model)
    sm.detach()
    assert "forward" not in model.__dict__


def test_a_schedule_with_nothing_to_schedule_must_win_clearly(monkeypatch):
    """Both ways within a few percent: a plan that runs nothing side by side and batches
    nothing is not kept (its verdict holds for every size, each of which would pay a plan)."""
    from streamsched.runtime.serial import SerialExecutor

    def slow(self, *args, _run=SerialExecutor.run, **kwargs):
        time.sleep(0.01)
        return _run(self, *args, **kwargs)

    def slow_forward(self, x, _forward=Chain.forward):
        time.sleep(0.0102)
        return _forward(self, x)

    monkeypatch.setattr(SerialExecutor, "run", slow)
    monkeypatch.setattr(Chain, "forward", slow_forward)
    model = Chain()
    sm = ss.StreamScheduledModule(model)
    for _ in range(40):
        x = torch.randn(3, 16)
        assert_close(sm(x), model(x))
        if sm.plan.trial is not None:
            break
    trial = sm.plan.trial
    assert trial is not None and trial.chosen == "eager", sm.plan.reason
    assert trial.best_us["serial"] < trial.best_us["eager"]  # the schedule was (a little) faster


def test_a_trial_whose_size_comes_back_rarely_decides_on_one_call_of_each():
    """Ten sizes cycled, each met once per pass: a trial waiting for rounds of calls of
    its own size would stay undecided for tens of passes. After RARE_CALLS calls of other
    signatures it decides once every candidate has run two calls."""
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    sizes = list(range(17, 27))  # one bucket: 32
    for _pass in range(7):
        for n in sizes:
            x = torch.randn(n, 16)
            assert_close(sm(x), model(x))
    structure = next(iter(sm._ss.structures.values()))
    decision = structure.decision(signatures.size_bucket(((17, 16),)))
    assert decision is not None and decision.sizes == ((17, 16),)
    assert "came back rarely" in decision.why
    assert not structure.trying
    paths = []
    for n in sizes:  # settled: no trial call, no recording
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        paths.append(last_path(sm))
    assert "recorded" not in paths
    assert paths.count("as-written") >= len(sizes) - 1, paths


def _decided_for_the_schedule(record_s: float, gain_s: float) -> tuple:
    """``Towers`` planned at batch 17, its size bucket decided for the schedule with a
    planted gain per call and recording cost: (model, wrapper, call structure)."""
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    for _ in range(3):
        sm(torch.randn(17, 16))
    compiled = sm._ss.plans[next(iter(sm._ss.plans))]
    structure = compiled.structure
    structure.record_s = record_s
    structure.decide(
        signatures.size_bucket(compiled.sizes),
        signatures.Decision(False, "serial", "planted", compiled.sizes, gain_s=gain_s),
    )
    return model, sm, structure


def test_a_bucket_decided_for_a_schedule_that_would_not_repay_a_plan_runs_new_sizes_as_written(monkeypatch):
    """A bucket decided for the schedule by a gain per call too small to repay a recording
    call within PAYBACK_CALLS calls: its new sizes run as written, settled (the size policy
    is asked once per size); a gain that repays one plans them as before."""
    asked = []
    admit = signatures.Structure.admit
    monkeypatch.setattr(signatures.Structure, "admit", lambda self, *a: asked.append(a) or admit(self, *a))
    for gain_calls, expected in (
        (signatures.PAYBACK_CALLS * 2, ["as-written"] * 4),
        (signatures.PAYBACK_CALLS // 2, ["as-written", "recorded", "plan:serial", "plan:serial"]),
    ):
        model, sm, _structure = _decided_for_the_schedule(record_s=0.5, gain_s=0.5 / gain_calls)
        asked.clear()
        paths = []
        for _ in range(4):
            x = torch.randn(20, 16)
            assert_close(sm(x), model(x))
            paths.append(last_path(sm))
        assert paths == expected, (gain_calls, paths)
        if expected[-1] == "as-written":
            assert len(asked) == 1
            assert "would take more than" in sm.plan.reason


def test_a_size_that_comes_back_rarely_is_planned_only_where_its_calls_would_repay_the_plan():
    """A size back after many calls of other sizes is expected back at that rate: it is
    planned only where the calls of it within PAYBACK_WINDOW calls, each saving what the
    structure's trials measured (the best decided bucket, for a bucket not decided yet),
    repay a recording call. A size back at once is planned as before; so is a rare one
    where the gain would repay it."""
    record_s, interval = 0.5, 100
    calls_in_window = signatures.PAYBACK_WINDOW / (interval + 1)
    for gain_s, expected in (
        (record_s / calls_in_window / 2, "as-written"),
        (record_s / calls_in_window * 2, "recorded"),
    ):
        model, sm, structure = _decided_for_the_schedule(record_s, gain_s)
        x = torch.randn(40, 16)  # another bucket, not decided: the structure's best gain stands for it
        assert_close(sm(x), model(x))
        assert structure.seen.get(((40, 16),)) == (1, sm._ss.calls)
        x = torch.randn(56, 16)  # its first call counted by the settled layout (settled_calls.py)
        assert_close(sm(x), model(x))
        assert structure.seen.get(((56, 16),)) == (1, sm._ss.calls)
        for _ in range(interval - 1):
            sm(torch.randn(17, 16))
        x = torch.randn(40, 16)
        assert_close(sm(x), model(x))
        assert last_path(sm) == expected, (gain_s, sm.plan.reason)
        if expected == "as-written":
            assert "came back after 101 calls" in sm.plan.reason
            for n in (100, 100):  # back at once (another bucket): planned on its second call
                x = torch.randn(n, 16)
                assert_close(sm(x), model(x))
            assert last_path(sm) == "recorded"
            x = torch.randn(40, 16)  # back sooner now: judged on the calls since its last
            assert_close(sm(x), model(x))
            assert last_path(sm) == "recorded"


def _rare_size_unmeasured(record_s: float, grad: bool = True) -> tuple:
    """``Towers`` planned at batch 17 (training: a structure's first call is planned), no
    trial's figure kept, its recording call taken to cost ``record_s``; then size 40
    called, 100 new sizes, size 40 (timed as written), 100 new sizes and size 40 again;
    all with gradients (``grad``) or without. Every output compared with eager; every new
    size run as written and counted by the settled layout (none took the full path).
    Returns the wrapper and the call structure, after the last call."""
    from streamsched.settled_calls import BucketCall

    model = Towers()
    sm = ss.StreamScheduledModule(model)
    fresh = iter(range(100, 400))

    def other_sizes(n: int) -> None:
        for _ in range(n):
            y = torch.randn(next(fresh), 16)
            assert_close(sm(y), model(y))
            assert isinstance(sm._ss.last, BucketCall)  # run as written, counted by the layout
            assert last_path(sm) == "as-written"

    with torch.set_grad_enabled(grad):
        x = torch.randn(17, 16)
        assert_close(sm(x), model(x))
        assert_path(sm, "recorded")
        structure = next(iter(sm._ss.structures.values()))
        structure.decisions.clear()
        structure.trying.clear()
        structure.waits.clear()
        structure.record_s = record_s
        x = torch.randn(40, 16)
        assert_close(sm(x), model(x))
        other_sizes(100)
        x = torch.randn(40, 16)
        assert_close(sm(x), model(x))
        assert last_path(sm) == "as-written"
        assert "is timed" in sm.plan.reason, sm.plan.reason
        timed = structure.timed.get(((40, 16),))
        assert timed is not None and timed > 0
        other_sizes(100)
        x = torch.randn(40, 16)
        assert_close(sm(x), model(x))
    return sm, structure


@pytest.mark.parametrize("record_s, expected", [(10.0, "as-written"), (1e-6, "recorded")])
def test_a_rare_size_no_trial_measured_is_timed_then_planned_only_where_its_whole_call_could_repay(record_s, expected):
    """Where no trial of the structure measured a gain, a size that comes back rarely runs
    as written once more, timed: no plan saves more than the whole call. When it comes
    back again it is planned only where that much on each of its calls within
    PAYBACK_WINDOW would repay a recording call; else it runs as written, judged by the
    settled layout itself (its calls between are new sizes, which the layout counts)."""
    from streamsched.settled_calls import RareCall

    sm, _ = _rare_size_unmeasured(record_s)
    assert last_path(sm) == expected, sm.plan.reason
    if expected == "as-written":
        assert isinstance(sm._ss.last, RareCall)  # the settled layout's own verdict
        assert "came back after 101 calls" in sm.plan.reason and "even a plan taking all" in sm.plan.reason


@pytest.mark.parametrize("grad, expected", [(True, "recorded"), (False, "as-written")])
def test_a_rare_call_autograd_records_may_save_on_its_backward_too(monkeypatch, grad, expected):
    """A call whose output autograd records is bounded by GRAD_BOUND times its forward (a
    plan may shorten its backward too); without gradients, by the forward alone."""
    monkeypatch.setattr(signatures, "GRAD_BOUND", 1e9)
    sm, _ = _rare_size_unmeasured(10.0, grad=grad)
    assert last_path(sm) == expected, sm.plan.reason


def test_what_a_new_size_costs_leaves_the_structures_trace_out(monkeypatch):
    """``Structure.record_s`` is what a plan of a new size costs: its recording call, plan
    and compile. The trace is made once for all of the structure's sizes (a first
    recording call that traced cost five times a later one, and kept rare sizes of 64
    fused heads from being planned where their plans repay themselves)."""
    import streamsched.new_signatures as new_signatures

    trace = new_signatures.trace_model

    def slow_trace(*args, **kwargs):
        time.sleep(0.3)
        return trace(*args, **kwargs)

    monkeypatch.setattr(new_signatures, "trace_model", slow_trace)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(17, 16)
    assert_close(sm(x), model(x))
    assert_path(sm, "recorded")
    structure = next(iter(sm._ss.structures.values()))
    assert structure.record_s is not None and 0 < structure.record_s < 0.3


def test_a_trial_that_keeps_the_schedule_hands_its_gain_to_the_bucket(monkeypatch):
    """The gain per call the plan of a new size must win back is the trial's own figure."""
    from streamsched.runner import Runner

    slow = Runner.as_written

    def slower(self, args, kwargs):
        time.sleep(0.01)
        return slow(self, args, kwargs)

    monkeypatch.setattr(Runner, "as_written", slower)
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    for _ in range(8):
        x = torch.randn(17, 16)
        assert_close(sm(x), model(x))
    structure = next(iter(sm._ss.structures.values()))
    decision = structure.decision(signatures.size_bucket(((17, 16),)))
    assert decision is not None and not decision.as_written
    assert decision.gain_s is not None and decision.gain_s > 0.005
    assert structure.record_s is not None and structure.record_s > 0


def test_one_slow_call_of_the_model_as_written_does_not_drop_it_from_a_trial():
    """A trial deciding on few calls (its size comes back rarely) must not lose the model as
    written to one call slowed by something else; a second slow call drops it."""
    from streamsched.planning.choice import Trial

    trial = Trial("serial", as_written=True)
    trial.rare = True
    trial.add("serial", 1e-3)
    trial.add("eager", 10e-3)  # one call ten times slower: another process ran meanwhile
    assert "eager" in trial.live and not trial.done()
    trial.add("serial", 1e-3)
    trial.add("eager", 0.9e-3)
    assert trial.done()
    plan = ss.Plan.as_written("M", "planted")
    _decided, eager = trial.decide(plan)
    assert eager is True  # its second call was the faster way
    trial = Trial("serial", as_written=True)
    for _ in range(2):
        trial.add("serial", 1e-3)
        trial.add("eager", 10e-3)
    assert trial.live == ["serial"]


def test_one_slow_call_of_the_schedule_does_not_drop_it_from_a_trial():
    """The schedule's first trial call slowed twenty times by another process: the way
    that is faster on every later call stays in the trial and wins it."""
    from streamsched.planning.choice import Trial

    trial = Trial("threads", as_written=True)
    trial.add("threads", 20e-3)  # one spike
    trial.add("serial", 20e-3)  # and another
    trial.add("eager", 2e-3)
    assert trial.live == ["threads", "serial", "eager"]
    for _ in range(trial.rounds):
        trial.add("threads", 1e-3)
        trial.add("serial", 1.5e-3)
        trial.add("eager", 2e-3)
    assert trial.done()
    plan = ss.Plan.as_written("M", "planted")
    decided, eager = trial.decide(plan)
    assert eager is False and decided.trial.chosen == "threads"


def test_no_collection_lands_in_a_timed_trial_call(monkeypatch):
    # A full collection (4 ms on a loaded 2-core machine) landing in the schedule's first
    # trial call made it 5 ms against the model's 0.25 ms: the schedule was dropped on
    # that one call (about one run in four of a branchy model 1.4x faster planned). The
    # cyclic collector waits while a trial call is timed.
    import gc

    from streamsched.runner import Runner

    timing = []
    landed = []
    original = Runner._clocked  # the timed span of every trial call

    def timed(self, *args, **kwargs):
        timing.append(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            timing.pop()

    def callback(phase, info):
        if phase == "start" and timing:
            landed.append(info["generation"])

    monkeypatch.setattr(Runner, "_clocked", timed)
    thresholds = gc.get_threshold()
    # What earlier tests left on the heap is set aside, so that the many collections
    # below stay cheap whatever ran before.
    gc.collect()
    gc.freeze()
    gc.callbacks.append(callback)
    gc.set_threshold(1, 1, 1)  # a collection on (almost) every allocation of a container
    try:
        model = Chain()
        sm = ss.StreamScheduledModule(model)
        # Until the trial decided (a close call takes up to 15 calls of each way).
        for _ in range(64):
            x = torch.randn(4, 16)
            assert_close(sm(x), model(x))
            if sm.plan.trial is not None:
                break
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(callback)
        gc.unfreeze()
    assert sm.plan.trial is not None, "no trial ran"
    assert landed == [], f"{len(landed)} collections ran inside timed trial calls"


def test_sizes_that_come_back_after_many_others_are_known_again():
    """97 batch sizes cycled (a loader whose last batches differ, bucketed lengths): each
    size comes back after 96 others. A table of sizes seen smaller than that forgot every
    size before it returned, so every call was a new size, paid the full path and was
    never planned nor settled (0.77x eager on a small branchy model)."""
    model = Towers()
    sm = ss.StreamScheduledModule(model)
    sizes = [1 + i % 97 for i in range(3 * 97)]
    reasons = []
    for n in sizes:
        x = torch.randn(n, 16)
        assert_close(sm(x), model(x))
        reasons.append(sm.plan.reason)
    last_cycle = reasons[-97:]
    assert not any("new to this call structure" in r for r in last_cycle), [
        r for r in last_cycle if "new to this call structure" in r
    ][:3]
