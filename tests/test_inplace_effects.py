"""In-place writes between branches are ordered as eager orders them.

Each model writes a value in place that another branch reads: ``mul_``, item
assignment, ``nn.ReLU(inplace=True)``, a module that writes its argument, a write
through a view, a buffer two branches share. The branches run on CPU lanes with random
delays (chaos), so a missing ordering edge shows as a wrong result; the storage-level
race checker must also be clean. A planted mutation (the effect edges dropped) must be
caught by both.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
import streamsched.frontend.effects as effects_mod
from streamsched.runtime.synclog import check_happens_before

from .helpers import assert_close

D = 64


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(D, D) for _ in range(3)])

    def forward(self, x):
        return self.body(x)


class Writer(nn.Module):
    """A module that writes its argument in place (opaque via @branch)."""

    def forward(self, x):
        x.add_(1.0)
        return x


class Pattern(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.stem = nn.Linear(D, D)
        self.a = Tower()
        self.b = Tower()
        self.relu = nn.ReLU(inplace=True)
        self.writer = ss.branch(Writer)()
        self.register_buffer("shared", torch.zeros(D))

    def forward(self, x):
        h = self.stem(x)
        y = self.a(h)  # branch a reads h
        if self.kind == "mul_":
            h.mul_(2)
        elif self.kind == "setitem":
            h[:, : D // 2] = 0
        elif self.kind == "relu_inplace":
            h = self.relu(h)
        elif self.kind == "module_writes_arg":
            self.writer(h)
        elif self.kind == "view_write":
            h.view(-1)[::3].zero_()
        elif self.kind == "augmented":
            h += 1.0  # in place on a tensor, as in eager
            h[:, 0] *= 2
        elif self.kind == "shared_buffer":
            self.shared.add_(y.mean(0))
            return y + self.b(h) + self.shared
        z = self.b(h)  # branch b reads the written h
        return y + z


KINDS = ["mul_", "setitem", "relu_inplace", "module_writes_arg", "view_write", "augmented", "shared_buffer"]


def _run(model, calls=8):
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(
        model, executor="threads", num_streams=3, min_task_cost=0.0, fuse=False, chaos=1, sync_log=True
    )
    wrong, races = 0, []
    with torch.no_grad():
        for _ in range(calls):
            x = torch.randn(16, D)
            out, ref = sm(x), eager(x)
            if not torch.allclose(out, ref, atol=1e-5):
                wrong += 1
            if sm.last_sync_log is not None:  # the first call runs unscheduled, recording
                races += check_happens_before(sm.last_sync_log)
    assert torch.equal(sm.module.shared, eager.shared)
    return sm, wrong, races


@pytest.mark.parametrize("kind", KINDS)
def test_in_place_writes_are_ordered_under_chaos(kind):
    sm, wrong, races = _run(Pattern(kind))
    assert sm.plan.executor == "threads" and sm.plan.num_streams > 1
    assert sm.plan.effect_edges >= 1, sm.plan.summary()
    assert wrong == 0
    assert races == []


@pytest.mark.parametrize("kind", ["mul_", "setitem", "module_writes_arg"])
def test_dropped_effect_edges_are_caught(kind, monkeypatch):
    # The mutation: record the effects but add no ordering edges for them.
    monkeypatch.setattr(effects_mod, "effect_edges", lambda accesses: {})
    monkeypatch.setattr(effects_mod, "_prune_implied", lambda after, graph: after)
    sm, wrong, races = _run(Pattern(kind), calls=6)
    assert sm.plan.effect_edges == 0
    kinds = {r.kind for r in races}
    assert kinds & {"out-of-order", "unordered-read", "write-after-read", "unordered-write"}, kinds


def test_writes_to_an_input_are_ordered_and_replanned_for_new_aliasing():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = Tower()
            self.b = Tower()

        def forward(self, x, y):
            u = self.a(y)
            x.mul_(3)
            return u + self.b(x)

    model = TwoInputs()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="threads", num_streams=3, min_task_cost=0.0, fuse=False, chaos=2)
    with torch.no_grad():
        for aliased in (False, False, True, True, False):
            x = torch.randn(8, D)
            y = x if aliased else torch.randn(8, D)
            x2 = x.clone()
            y2 = x2 if aliased else y.clone()
            assert_close(sm(x, y), eager(x2, y2))
            assert_close(x, x2)


def test_augmented_assignment_to_an_argument_writes_the_callers_tensor():
    class Scales(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, D)

        def forward(self, x, n: int):
            x *= 2
            x += n
            return self.fc(x)

    model = Scales()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, D)
            x2 = x.clone()
            assert_close(sm(x, 3), model(x2, 3))
            assert torch.equal(x, x2)


def test_graph_without_writes_adds_no_edges_and_keeps_fusion():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList(nn.Sequential(nn.Linear(D, 8), nn.ReLU(inplace=True)) for _ in range(4))

        def forward(self, x):
            return torch.cat([h(x) for h in self.heads], dim=1)

    model = Heads()
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(4, D)
    sm(x)
    assert_close(sm(x), model(x))
    assert sm.plan.effect_edges == 0
    assert sm.plan.fused_groups


@pytest.mark.cuda
@pytest.mark.parametrize("kind", KINDS)
def test_in_place_writes_are_ordered_on_cuda_streams(kind):
    # On the emulated device (no GPU here) streams run out of order and every kernel's
    # storage accesses are checked for happens-before; on a GPU, streams really race.
    model = Pattern(kind).cuda()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=3, min_task_cost=0.0, fuse=False)
    with torch.no_grad():
        for _ in range(4):
            x = torch.randn(16, D, device="cuda")
            assert_close(sm(x), eager(x))
    assert sm.plan.num_streams > 1 and sm.plan.effect_edges >= 1
    assert torch.equal(sm.module.shared, eager.shared)


@pytest.mark.cuda
def test_dropped_effect_edge_is_caught_on_cuda_streams(monkeypatch, emulated_cuda):
    monkeypatch.setattr(effects_mod, "effect_edges", lambda accesses: {})
    monkeypatch.setattr(effects_mod, "_prune_implied", lambda after, graph: after)
    model = Pattern("mul_").cuda()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=3, min_task_cost=0.0, fuse=False)
    from streamsched.emulated_cuda import UnsynchronizedAccess

    with torch.no_grad():
        x = torch.randn(16, D, device="cuda")
        assert_close(sm(x), eager(x.clone()))  # the first call runs in eager order, recording
        with pytest.raises(UnsynchronizedAccess, match="mul_"):
            sm(x)
    assert emulated_cuda.take_reports()


class HeadsWrittenInPlace(nn.Module):
    """Fused heads whose outputs are each written in place by a different op (not fused
    with them), then concatenated: under autograd the views of one unbind/split cannot be
    written, and a cat made a view of the kernel's output would show the writes."""

    def __init__(self, wide: bool):
        super().__init__()
        widths = [3, 5, 4] if wide else [4, 4, 4]
        self.heads = nn.ModuleList(nn.Linear(D, w) for w in widths)

    def forward(self, x):
        outs = [h(x) for h in self.heads]
        early = torch.cat(outs, dim=1)  # before the writes: must not see them
        squared = outs[2] * outs[2]  # saves a sibling's value for backward
        for i, o in enumerate(outs[:2]):
            o.mul_(i + 2)
        return early, torch.cat(outs, dim=1), squared


@pytest.mark.parametrize("wide", [False, True])
def test_consumers_may_write_fused_members_in_place_under_autograd(wide):
    model = HeadsWrittenInPlace(wide)
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    for _ in range(3):
        x = torch.randn(4, D, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, ref = sm(x), eager(x2)
        assert_close(list(out), list(ref))
        sum(o.square().sum() for o in out).backward()
        sum(o.square().sum() for o in ref).backward()
        assert_close(x.grad, x2.grad)
        for p, q in zip(sm.module.parameters(), eager.parameters()):
            assert_close(p.grad, q.grad)
    assert sm.plan.fused_groups, "the heads should still be fused"


def test_a_freed_storages_address_reused_by_another_value_makes_no_edge(monkeypatch):
    """Storages are named per lifetime: a value allocated where a freed one lived shares
    nothing with it, and writing it in place must not be ordered after the old value's
    readers (that edge blocked fusion, and depended on the allocator run to run). The
    allocator handing the new value the old address is simulated: whether it does so
    varies from run to run."""
    real = effects_mod.storage_key
    reused: dict[int, int] = {}
    monkeypatch.setattr(effects_mod, "storage_key", lambda t: reused.get(real(t), real(t)))
    a = torch.randn(256)
    with effects_mod.EffectRecorder() as rec:
        rec.begin("make_x")
        x = a * 2
        rec.end()
        rec.begin("read_x")
        _ = x.sum()
        rec.end()
        old_address = real(x)
        del x
        rec.begin("make_y")
        y = a * 3
        rec.end()
        reused[real(y)] = old_address  # y now has the address x had
        rec.begin("write_y")
        y.add_(1)
        rec.end()
    after = effects_mod.effect_edges(rec.accesses)
    assert "read_x" not in after.get("write_y", set())
    # A true write-after-read on one live storage is still an edge.
    with effects_mod.EffectRecorder() as rec:
        x = a * 2
        rec.begin("read_x")
        _ = x.sum()
        rec.end()
        rec.begin("write_x")
        x.add_(1)
        rec.end()
    assert effects_mod.effect_edges(rec.accesses)["write_x"] == {"read_x"}


def test_the_recorders_weak_references_hold_storage_ids_apart_until_released():
    # The recorder names storages by address, with a weak reference to each: while it
    # holds one, the storage object stays allocated (its data is freed), so no storage
    # made meanwhile takes its address and ids stay apart; release() (or dropping the
    # recorder) frees them, and the address is the allocator's again.
    rec = effects_mod.EffectRecorder()
    x = torch.empty(256)
    address = x.untyped_storage()._cdata
    first = rec.key_of(x)
    assert rec.key_of(x[1:]) == first
    del x
    ys = [torch.empty(256) for _ in range(50)]
    assert all(y.untyped_storage()._cdata != address for y in ys)
    assert len({rec.key_of(y) for y in ys} | {first}) == 51
    del ys
    # release() frees every weak reference it made, once each (a leaked one keeps the
    # storage object, and its address, taken for the rest of the process). Counted, not
    # watched through the allocator: whether a freed address comes back soon depends on
    # what the allocator met before, which in a whole test run can be a lot.
    held = {ref for _, ref in rec._ids.values()}
    assert len(held) == 51
    freed = []
    if rec._raw:
        real_free = effects_mod._FREE_WEAK_REF
        effects_mod._FREE_WEAK_REF = lambda ref: (freed.append(ref), real_free(ref))[1]
        try:
            rec.release()
        finally:
            effects_mod._FREE_WEAK_REF = real_free
        assert sorted(freed) == sorted(held)
    else:
        rec.release()
    assert not rec._ids


class WideHeadsThenActivations(nn.Module):
    """Heads of different widths on one input (one wide Linear, split per head), each
    followed by an activation module of its own; ``inplace`` is set after planning."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, w) for w in (3, 5, 4))
        self.acts = nn.ModuleList([nn.ReLU(), nn.ReLU6(), nn.LeakyReLU(0.1)])

    def forward(self, x):
        return [act(head(x)) * 2 for head, act in zip(self.heads, self.acts)]


@pytest.mark.parametrize("executor", ["serial", "threads"])
def test_an_activation_made_in_place_after_planning_re_records_its_effects(executor):
    """The recorded effects said no call writes the heads' parts of the wide kernel's
    output; ``act.inplace = True`` afterwards made the kept plan write them in place (a
    view of a split, which autograd refuses to write: the call raised)."""
    torch.manual_seed(0)
    model = WideHeadsThenActivations()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(5):
        if call == 2:
            for act, act_ref in zip(model.acts, eager.acts):
                act.inplace = act_ref.inplace = True
        x = torch.randn(4, D, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        out, ref = sm(x), eager(x2)
        path = ss.testing.assert_path(sm, "recorded", "plan")
        assert_close(out, ref, what=f"call {call} ({path}): outputs")
        sum(o.square().sum() for o in out).backward()
        sum(o.square().sum() for o in ref).backward()
        assert_close(x.grad, x2.grad, what=f"call {call} ({path}): input gradient")
        for p, q in zip(sm.module.parameters(), eager.parameters()):
            assert_close(p.grad, q.grad, what=f"call {call} ({path}): gradients")
            p.grad = q.grad = None
        assert sm.plan.fused_groups, "the heads should be fused"


def _edges_over_a_stack(steps: dict) -> dict:
    """The effect edges of ``steps`` (node name -> what it does to the members of a
    stack of 3 rows, given the stack and its members), recorded with the members'
    slices as regions."""
    stack = torch.zeros(3, 4)
    members = list(stack.unbind(0))
    starts = [m.storage_offset() for m in members]
    regions = {stack.untyped_storage()._cdata: sorted((s, s + m.numel()) for s, m in zip(starts, members))}
    with effects_mod.EffectRecorder(regions) as rec:
        for name, step in steps.items():
            rec.begin(name)
            step(stack, members)
            rec.end()
    rec.merge_spanning()
    return effects_mod.effect_edges(rec.accesses)


def test_members_of_a_stack_written_one_by_one_order_nothing():
    """A storage holding several tensors side by side (a fused group's stack): each
    member's slice is named apart, so one member written (a batch norm's statistics)
    orders nothing with another member's reader; a write to the same member does."""
    after = _edges_over_a_stack(
        {
            "write_0": lambda stack, members: members[0].add_(1),
            "read_1": lambda stack, members: members[1].sum(),
            "read_0": lambda stack, members: members[0][1:].sum(),  # a view inside member 0's slice
        }
    )
    assert "read_1" not in after and after["read_0"] == {"write_0"}


def test_an_access_spanning_members_names_their_storage_whole():
    """Where some access reaches over two members' slices, every slice of that storage
    is named as the whole storage again (as without regions): the writes keep their
    order, and the reader of the whole stack follows the last of them."""
    after = _edges_over_a_stack(
        {
            "write_0": lambda stack, members: members[0].add_(1),
            "write_2": lambda stack, members: members[2].mul_(2),
            "read_all": lambda stack, members: stack.sum(),
        }
    )
    assert after["read_all"] == {"write_2"}
    assert after["write_2"] == {"write_0"}  # one storage again: without the merge, no edge


class NormedTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Conv2d(6, 6, 1), nn.BatchNorm2d(6), nn.ReLU()) for _ in range(4))

    def forward(self, x):
        return torch.cat([h(x) for h in self.heads], 1)


def test_a_fused_batch_norm_in_training_stays_fused_at_a_new_size():
    """After the first plan, the fused batch norms' statistics are slices of one stack;
    the recording of a new size sees each member update its own slice, which orders
    nothing: the group is fused again, and the statistics follow eager's."""
    torch.manual_seed(0)
    model = NormedTowers()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial", min_task_cost=0.0)
    for n in (5, 5, 7, 7):
        x = torch.randn(n, 6, 3, 3)
        with torch.no_grad():
            assert_close(sm(x), eager(x), atol=1e-5)
        kinds = {g.kind for g in sm.plan.fused_groups}
        assert "BatchNorm2d" in kinds and sm.plan.effect_edges == 0, (n, kinds, sm.plan.effect_edges)
    assert sm._ss.last_path == "plan:serial" and sm.plan.signature.startswith("float32[7")
    for a, b in zip(model.buffers(), eager.buffers()):
        assert_close(a, b, atol=1e-6)
