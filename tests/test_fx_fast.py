"""``frontend.fx_fast``: the tracer's cheaper per-call work makes exactly the graph fx makes.

Each model is traced twice, with the fast paths on and off (``fx_fast.ENABLED``), and
every node is compared: name, op, target, arguments (with the nodes they name), type and
``meta`` (the module stack that node labels are read from included); then the wrapped
model's calls are checked against eager.
"""

import collections
import operator

import pytest
import torch
from torch import fx, nn

import streamsched as ss
from benchmarks.zoo import Inception3, MultiTaskHeads, NASNetCells, ParallelFCN, RandWire
from streamsched.frontend import fx_fast
from streamsched.frontend.binder import CallBinder
from streamsched.frontend.nodes import node_label
from streamsched.frontend.trace import trace_model
from streamsched.planning import planner
from streamsched.testing import assert_path

from .helpers import assert_close

Pair = collections.namedtuple("Pair", "a b")


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x, scale=None, opts=None):
        y = self.fc(x)
        if scale is not None:
            y = y * scale
        if opts is not None and opts["shift"]:
            y = y + opts["shift"]
        return self.norm(y)


class Everything(nn.Module):
    """Arguments of every kind fx_fast converts itself (and some it hands to fx)."""

    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.other = Inner()
        self.register_buffer("offset", torch.randn(8))
        self.const = torch.randn(8)  # a plain tensor attribute: a get_attr
        self.pair_fc = nn.Linear(8, 8)

    def forward(self, x, mask=None):
        a = self.inner(x)
        b = self.inner(x, scale=2.0, opts={"shift": 0.5})  # a second call of one module: "inner@1"
        c = self.other(x[..., :8], 0.5)
        d = torch.cat([a, b[:, 0:8:1], c], dim=-1).reshape(x.shape[0], 3, 8)
        e = d.sum(dim=(1,), keepdim=True).squeeze(1)
        f = torch.nn.functional.pad(e, [0, 0], mode="constant", value=None)
        g = f.to(dtype=torch.float32, device=x.device) + self.offset + self.const
        h = torch.where(mask, g, torch.zeros_like(g)) if mask is not None else g
        p = Pair(h, a)  # a named tuple as an argument: fx makes a node of it
        out = torch.stack(tuple(p), dim=0).sum(0)
        out = out + self.pair_fc(torch.tensor([1.0] * 8))  # a fresh constant tensor
        return {"out": out, "parts": [a, b], "n": x.size(0)}


def _describe(graph: fx.Graph) -> list:
    rows = []
    for node in graph.nodes:
        meta = {k: (list(v.items()) if isinstance(v, dict) else repr(v)) for k, v in node.meta.items()}
        rows.append(
            (
                node.name,
                node.op,
                node.target if isinstance(node.target, str) else repr(node.target),
                repr(node.args),
                type(node.args).__name__,
                repr(node.kwargs),
                type(node.kwargs).__name__,
                [u.name for u in node.users],
                node.type,
                meta,
                node_label(node),
            )
        )
    return rows


def _trace(model, args, kwargs, enabled, monkeypatch):
    monkeypatch.setattr(fx_fast, "ENABLED", enabled)
    binder = CallBinder(model)
    _, spec = binder.bind(args, kwargs)
    ranks = tuple(a.dim() for a in args if isinstance(a, torch.Tensor)) + tuple(
        v.dim() for v in kwargs.values() if isinstance(v, torch.Tensor)
    )
    return trace_model(model, binder, spec, ranks=ranks)


def _cases():
    torch.manual_seed(0)
    x8 = torch.randn(4, 8)
    return [
        ("everything", lambda: Everything(), (x8,), {}),
        ("everything_mask", lambda: Everything(), (x8,), {"mask": torch.rand(4, 8) > 0.5}),
        ("pfcn", lambda: ParallelFCN(12), (torch.randn(2, 12 * 20),), {}),
        ("heads", lambda: MultiTaskHeads(), (torch.randn(8, 64),), {}),
        ("inception", lambda: Inception3(num_classes=10), (torch.randn(1, 3, 75, 75),), {}),
        ("nasnet", lambda: NASNetCells(channels=8, cells=2, num_classes=10), (torch.randn(1, 3, 32, 32),), {}),
        ("randwire", lambda: RandWire(), (torch.randn(1, 3, 32, 32),), {}),
    ]


@pytest.mark.parametrize("name,make,args,kwargs", _cases(), ids=[c[0] for c in _cases()])
def test_fast_tracer_makes_the_graph_fx_makes(name, make, args, kwargs, monkeypatch):
    torch.manual_seed(0)
    model = make().eval()
    slow = _trace(model, args, kwargs, False, monkeypatch)
    fast = _trace(model, args, kwargs, True, monkeypatch)
    assert _describe(fast.graph) == _describe(slow.graph)
    assert fast.graph.python_code("self").src == slow.graph.python_code("self").src
    assert fast.module_ids == slow.module_ids and fast.inlined_leaf_calls == slow.inlined_leaf_calls
    assert any("nn_module_stack" in n.meta for n in fast.graph.nodes)


def test_the_fast_paths_ran_and_hand_the_rest_to_fx(monkeypatch):
    calls = collections.Counter()
    for name in ("create_arg", "create_node", "call_module"):
        original = getattr(fx.Tracer, name) if name != "create_node" else fx.proxy.TracerBase.create_node

        def counted(self, *a, _original=original, _name=name, **k):
            calls[_name] += 1
            return _original(self, *a, **k)

        owner = fx.proxy.TracerBase if name == "create_node" else fx.Tracer
        monkeypatch.setattr(owner, name, counted)
    model = Everything().eval()
    _trace(model, (torch.randn(4, 8),), {}, True, monkeypatch)
    fast = dict(calls)
    calls.clear()
    _trace(model, (torch.randn(4, 8),), {}, False, monkeypatch)
    slow = dict(calls)
    # fx is asked only for what the fast paths do not know: the tensors (buffer, parameter
    # lookups), the named tuple, the placeholders and output made with fx's own calls.
    assert 0 < fast["create_arg"] < slow["create_arg"] / 3
    assert fast.get("create_node", 0) < slow["create_node"] / 2
    assert fast.get("call_module", 0) == 0 < slow["call_module"]


@pytest.mark.parametrize(
    "make,x", [(lambda: Everything(), torch.randn(4, 8)), (lambda: ParallelFCN(16), torch.randn(3, 320))]
)
def test_a_model_traced_the_fast_way_runs_as_eager(make, x):
    torch.manual_seed(0)
    model = make().eval()
    sm = ss.StreamScheduledModule(make().eval(), executor="serial")
    sm.module.load_state_dict(model.state_dict())
    if hasattr(model, "const"):
        sm.module.const = model.const
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn_like(x)
            assert_close(sm(x), model(x))
    assert_path(sm, "plan:serial")


def test_a_module_stack_is_each_nodes_own(monkeypatch):
    # Two nodes made in one module's forward get equal stacks, not one shared dict.
    model = Everything().eval()
    traced = _trace(model, (torch.randn(4, 8),), {}, True, monkeypatch)
    stacks = [n.meta["nn_module_stack"] for n in traced.graph.nodes if "nn_module_stack" in n.meta]
    assert len({id(s) for s in stacks}) == len(stacks)
    inner = [n for n in traced.graph.nodes if n.op == "call_module" and n.target == "inner.fc"]
    assert [list(n.meta["nn_module_stack"]) for n in inner] == [["inner", "inner.fc"], ["inner@1", "inner.fc@1"]]
    assert operator.eq(type(stacks[0]), collections.OrderedDict)


def test_copied_nodes_have_their_own_meta_and_are_found_by_op(monkeypatch):
    # planner.copy_graph sets arguments and meta without Node.__setattr__.
    traced = _trace(Everything().eval(), (torch.randn(4, 8),), {}, True, monkeypatch)
    copied, _ = planner.copy_graph(traced.graph, {})
    for a, b in zip(traced.graph.nodes, copied.nodes):
        if b.op != "output":
            assert b.meta == a.meta and b.meta is not a.meta
            assert repr(b.args) == repr(a.args) and repr(b.kwargs) == repr(a.kwargs)
    for op, target in [("call_module", None), ("call_function", operator.getitem), ("placeholder", None)]:
        found = [n.name for n in copied.find_nodes(op=op, target=target)]
        assert found and found == [n.name for n in traced.graph.find_nodes(op=op, target=target)]
    copied.lint()


class _RankBlock(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.m = inner

    def forward(self, x):
        y = self.m(x)
        return y.sum(-1) if y.dim() == 3 else y * 2  # the rank a leaf call gives decides


class _TwoRanks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = _RankBlock(nn.Embedding(10, 4))  # rank + 1
        self.b = _RankBlock(nn.Linear(4, 4))  # same rank; the same attribute name "m"

    def forward(self, idx, x):
        return self.a(idx), self.b(x)


def test_ranks_read_each_module_call_from_its_own_path(monkeypatch):
    # The rank tracker reads each path (prefix) once per trace: "a.m" and "b.m" are
    # different modules whose ranks differ.
    torch.manual_seed(0)
    model = _TwoRanks().eval()
    idx, x = torch.randint(0, 10, (2, 3)), torch.randn(2, 4)
    traced = _trace(model, (idx, x), {}, True, monkeypatch)
    assert not traced.opaque
    code = traced.graph.python_code("self").src
    assert "sum" in code and "mul" in code
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(2):
            idx, x = torch.randint(0, 10, (2, 3)), torch.randn(2, 4)
            out, ref = sm(idx, x), model(idx, x)
            assert_close(out[0], ref[0])
            assert_close(out[1], ref[1])
    assert_path(sm, "plan:serial")


class _Flagged(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale, self.mode, self.sizes = 0.5, "fast", [1, 2]
        self.table, self.fn = {"a": 1}, torch.relu
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.weight * self.scale


def test_structure_signature_of_a_childless_module_is_the_generic_one():
    # propose.structure_signature reads a module without children directly, not
    # through named_modules(); the signature is the same.
    from streamsched.passes.fusion import propose

    def generic(m):
        return tuple(
            (
                name,
                type(sub),
                sub.training,
                sub.extra_repr(),
                tuple(sorted((k, propose._value_sig(v)) for k, v in propose._own_attributes(sub))),
            )
            for name, sub in m.named_modules()
        )

    modules = [nn.Linear(4, 3), nn.ReLU(), nn.BatchNorm1d(3).train(), nn.Conv2d(2, 2, 3, padding=1), _Flagged()]
    modules += [nn.Sequential(nn.Linear(2, 2), nn.Tanh()), _RankBlock(nn.Linear(2, 2))]
    for m in modules:
        assert propose.structure_signature(m) == generic(m), type(m)
    a, b = _Flagged(), _Flagged()
    b.scale = 0.25
    assert propose.structure_signature(a) != propose.structure_signature(b)
    assert propose.structure_signature(nn.ReLU().train()) != propose.structure_signature(nn.ReLU().eval())


class _OwnChildren(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(2, 2)

    def children(self):
        return iter(())  # claims none: has_children follows the class's own answer


def test_children_read_off_the_module_table_as_children_gives_them():
    from streamsched.frontend.nodes import children_of, has_children

    shared = nn.ReLU()
    twice = nn.Module()
    twice.first, twice.gone, twice.second = shared, None, shared  # one child under two names, one None
    only_none = nn.Module()
    only_none.gone = None
    cases = [
        nn.Linear(2, 2),
        nn.Sequential(nn.Linear(2, 2), nn.Tanh()),
        twice,
        only_none,
        _OwnChildren(),
        ParallelFCN(3),
    ]
    for m in cases:
        assert children_of(m) == list(m.children()), type(m)
        assert has_children(m) == (next(m.children(), None) is not None), type(m)
    assert children_of(twice) == [shared]
    assert not has_children(only_none) and not has_children(_OwnChildren())


def test_the_effect_recorder_names_a_new_storage_at_a_dead_ones_address_anew():
    # EffectRecorder.key_of asks torch whether the weak reference it keeps per address
    # expired without StorageWeakRef.expired()'s two Python frames (a raw weak reference,
    # the int StorageWeakRef wraps, where torch offers them).
    from torch.multiprocessing.reductions import StorageWeakRef

    from streamsched.frontend.effects import EffectRecorder

    rec = EffectRecorder()

    def weak(storage):
        return storage._weak_ref() if rec._raw else StorageWeakRef(storage)

    gone = torch.empty(4)
    dead = weak(gone.untyped_storage())
    del gone
    assert torch.UntypedStorage._expired(dead) if rec._raw else dead.expired()
    b, c = torch.randn(4), torch.randn(4)
    rec._ids[b.untyped_storage()._cdata] = (99, dead)  # an earlier storage at b's address, freed
    rec._ids[c.untyped_storage()._cdata] = (77, weak(c.untyped_storage()))  # c itself, alive
    assert rec.key_of(c) == 77 and rec.key_of(c[1:]) == 77
    fresh = rec.key_of(b)
    assert fresh not in (77, 99) and rec.key_of(b.view(2, 2)) == fresh
    rec.release()
