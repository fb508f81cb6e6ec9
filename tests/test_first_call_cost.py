"""The first call's bookkeeping, made cheaper without changing what it finds.

- planning resolves each module path once (``frontend.nodes.submodule`` inside
  ``resolving_submodules``), and follows a re-wiring made meanwhile;
- ``planner.copy_graph`` makes the same graph as ``Graph.graph_copy``;
- the effect recorder records, op by op, what ``op_accesses`` and ``fresh_outputs`` say
  (the same storages, given the same ids in the same order).
"""

import copy
import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import streamsched as ss
from benchmarks.zoo import Inception3, MultiTaskHeads, ParallelFCN
from streamsched.frontend import effects as effects_mod
from streamsched.frontend import node_meta
from streamsched.frontend.effects import EffectRecorder, fresh_outputs, op_accesses
from streamsched.frontend.nodes import node_label, resolving_submodules, submodule
from streamsched.ir.cost import device_model_for, estimate_node_cost
from streamsched.planning import planner
from streamsched.testing import assert_path

from .helpers import assert_close

# The recorded call and the plan's calls are compared with eager from the first call on.
pytestmark = pytest.mark.usefixtures("plan_first_calls")

# --- module paths ----------------------------------------------------------------------


def test_submodule_resolves_as_get_submodule_does_and_follows_a_rewiring():
    model = ParallelFCN(3)
    ss.StreamScheduledModule(model)  # its modules are tracked: re-wiring moves the generation
    paths = ["", "mlps", "mlps.0", "mlps.2.fc1", "mlps.1.relu"]
    with resolving_submodules(model):
        for path in paths:
            assert submodule(model, path) is model.get_submodule(path)
            assert submodule(model, path) is model.get_submodule(path)  # resolved before
        for bad in ("mlps.3", "mlps.0.fc3", "mlps.0.fc1.weight", "nothing.at.all"):
            with pytest.raises(AttributeError):
                submodule(model, bad)
        old = model.mlps[0].fc1
        assert submodule(model, "mlps.0.fc1") is old
        model.mlps[0].fc1 = nn.Linear(20, 10)
        assert submodule(model, "mlps.0.fc1") is model.mlps[0].fc1 is not old
        model.mlps[1] = nn.Sequential()
        with pytest.raises(AttributeError):
            submodule(model, "mlps.1.relu")
        other = ParallelFCN(2)
        assert submodule(other, "mlps.1.fc2") is other.mlps[1].fc2  # another root: not cached
    assert submodule(model, "mlps.2.fc2") is model.mlps[2].fc2


def test_the_whole_planning_call_resolves_each_module_path_once(monkeypatch):
    # The trace, the recording call, planning and the checks after it (whether the plan
    # runs code of the model's, Traced.runs_models_code) share the resolutions. Each
    # planning pass used to walk get_submodule per node (7 walks per path), and later the
    # check after planning did (3 per member); now a path's parent is resolved once and
    # its children are one attribute lookup each.
    torch.manual_seed(0)
    model = ParallelFCN(64).eval()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    calls: list[str] = []
    original = nn.Module.get_submodule

    def counted(self, target):
        calls.append(target)
        return original(self, target)

    x = torch.randn(4, 64 * 20)
    with torch.no_grad():
        monkeypatch.setattr(nn.Module, "get_submodule", counted)
        try:
            out = sm(x)
        finally:
            monkeypatch.setattr(nn.Module, "get_submodule", original)
        assert_path(sm, "recorded")
        assert_close(out, model(x))
        fresh = torch.randn(4, 64 * 20)
        assert_close(sm(fresh), model(fresh))
        assert_path(sm, "plan")
    assert [g.size for g in sm.plan.fused_groups] == [64, 64, 64]
    assert len(calls) <= 64 * 3 // 10, f"{len(calls)} get_submodule calls for {64 * 3} paths"


# --- copy_graph ------------------------------------------------------------------------


def _graph_copy(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    new.output(new.graph_copy(graph, {}))
    return new


def _describe(graph: fx.Graph) -> list:
    return [
        (n.op, n.name, n.target, n.args, dict(n.kwargs), n.type, [u.name for u in n.users], n.meta) for n in graph.nodes
    ]


def _as_text(described: list) -> list:
    """Nodes of two graphs compare by name: their descriptions as text."""
    return [repr(d) for d in described]


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: ParallelFCN(8), torch.randn(2, 160)),
        (lambda: MultiTaskHeads(), torch.randn(4, 64)),
        (lambda: Inception3(num_classes=10).eval(), torch.randn(1, 3, 80, 80)),
    ],
    ids=["parallel_fcn", "heads", "inception"],
)
def test_copy_graph_makes_what_graph_copy_makes(make, x):
    torch.manual_seed(0)
    model = make()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    with torch.no_grad():
        out = sm(x)
        assert_path(sm, "recorded")
        ref = model(x)
    flat = out if isinstance(out, torch.Tensor) else torch.cat([v.flatten() for _, v in sorted(out.items())])
    flat_ref = ref if isinstance(ref, torch.Tensor) else torch.cat([v.flatten() for _, v in sorted(ref.items())])
    assert_close(flat, flat_ref)
    traced = next(iter(sm._ss.traces.values()))
    graph = traced.graph
    if isinstance(model, ParallelFCN):
        assert any(n.kwargs for n in graph.nodes), "no node with keyword arguments to copy"
    metas = {n: i for i, n in enumerate(graph.nodes)}
    copied, copied_metas = planner.copy_graph(graph, metas)
    reference = _graph_copy(graph)
    assert _as_text(_describe(copied)) == _as_text(_describe(reference))
    assert copied.python_code("self").src == reference.python_code("self").src
    assert all(a is not b for a, b in zip(copied.nodes, graph.nodes))
    copied.lint()
    # Metadata of every value (the output node is made anew, as graph_copy's caller makes it).
    kept = [n for n in copied.nodes if n.op != "output"]
    assert [copied_metas[n] for n in kept] == [metas[n] for n in graph.nodes if n.op != "output"]


# --- the effect recorder -----------------------------------------------------------------


class _SpelledOut(EffectRecorder):
    """The recorder as op_accesses and fresh_outputs spell it: the reference."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        acc = self._current
        if acc is not None:
            reads, writes = op_accesses(func, args, kwargs)
            for t in reads:
                key = self.key_of(t)
                if key is not None:
                    acc.reads.add(key)
            for t in writes:
                key = self.key_of(t)
                if key is not None and key not in acc.fresh:
                    acc.writes.add(key)
            for t in fresh_outputs(func, out):
                key = self.key_of(t)
                if key is not None:
                    acc.fresh.add(key)
        return out


def _program(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, rec: EffectRecorder) -> None:
    steps = [
        lambda: a + b,
        lambda: a.add_(b),
        lambda: torch.add(a, b, alpha=2),
        lambda: torch.add(a, b, out=c),  # a keyword argument written in place
        lambda: torch.cat([a, b, c], dim=0),  # a list of tensors
        lambda: a.t(),
        lambda: torch.split(c, 1, dim=0),  # several returns, all views
        lambda: torch.max(a, dim=1),  # several fresh returns
        lambda: torch.tensor([1.0, 2.0]),  # lifted
        lambda: torch.where(a > 0, a, b),
        lambda: c[:, :2].zero_(),
        lambda: torch.nn.functional.linear(a, b, bias=c[0]),
        lambda: a.index_put_((torch.tensor([0]),), torch.ones(3)),
    ]
    for i, step in enumerate(steps):
        rec.begin(f"n{i}")
        step()
        rec.end()


def test_the_recorder_records_what_op_accesses_and_fresh_outputs_say():
    assert EffectRecorder.__torch_dispatch__ is not _SpelledOut.__torch_dispatch__
    recorded = []
    for recorder in (EffectRecorder, _SpelledOut):
        torch.manual_seed(0)
        a, b, c = torch.randn(3, 3), torch.randn(3, 3), torch.randn(3, 3)
        with recorder() as rec:
            _program(a, b, c, rec)
        recorded.append(rec.accesses)
    fast, spelled = recorded
    assert list(fast) == list(spelled) and len(fast) == 13
    for name in spelled:
        assert fast[name] == spelled[name], name
    # Storage ids are handed out as storages are first seen: same ids, same order.
    assert fast["n3"].writes and fast["n1"].writes and fast["n4"].reads and fast["n8"].fresh
    effects = effects_mod.Effects.from_accesses(fast)
    assert effects.writes and effects == effects_mod.Effects.from_accesses(spelled)


# --- the benchmark row ---------------------------------------------------------------------


def _load_call_overhead_micro():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "call_overhead_micro.py"
    spec = importlib.util.spec_from_file_location("_bench_script_call_overhead_micro", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_overhead_report_prints_the_first_call_beside_its_goal_and_guards_it(capsys):
    script = _load_call_overhead_micro()
    threads = torch.get_num_threads()
    try:
        code = script.main(
            ["--critics-only", "--rounds", "1", "--first-call-processes", "1", "--max-first-call-s", "0.001"]
        )
    finally:
        torch.set_num_threads(threads)
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("ParallelFCN(1000) first call"))
    seconds = float(line.split("processes: ")[1].split(" s CPU")[0])
    assert seconds > 0.001 and "goal <= 0.3 s" in line
    assert "REGRESSION (guard: <= 0.00 s)" in line and code == 1


def test_the_report_reads_the_first_call_on_the_issues_scale(monkeypatch, capsys):
    """``--issue-scale REV``: the tree at REV, exported from git, and this one each time
    the call (``_calibrated``, stood in for here: the figures are the report's
    arithmetic, not a timing), alternately, as a user's first call and with the
    collector off; each figure is this tree's median over REV's times the issue's 0.62 s."""
    script = _load_call_overhead_micro()
    here = str(Path(script.__file__).resolve().parents[1])
    calls: list[tuple[str, str]] = []

    def calibrated(tree: str, mode: str) -> float:
        calls.append((tree, mode))
        if tree == here:
            return 0.4 if mode == "" else 0.5
        # The exported tree holds the package and the zoo the child imports.
        assert (Path(tree) / "streamsched" / "__init__.py").is_file()
        assert (Path(tree) / "benchmarks" / "zoo" / "__init__.py").is_file()
        return 1.0

    monkeypatch.setattr(script, "_calibrated", calibrated)
    row = script.issue_scale_row("HEAD", 2)
    assert abs(row["user"]["issue_scale_s"] - 0.4 * script.ISSUE_FIRST_CALL_S) < 1e-9
    assert abs(row["work"]["issue_scale_s"] - 0.5 * script.ISSUE_FIRST_CALL_S) < 1e-9
    assert [mode for _, mode in calls] == ["", "", "", "", "--nogc", "--nogc", "--nogc", "--nogc"]
    assert [tree == here for tree, _ in calls] == [False, True] * 4  # alternating, the issue's tree first
    threads = torch.get_num_threads()
    monkeypatch.setattr(script, "first_call_row", lambda n: {"cpu_s": 0.42, "wall_s": 0.42, "samples_cpu_s": [0.42]})
    monkeypatch.setattr(script, "critics_row", lambda rounds: (1.0, 1.0))
    try:
        code = script.main(["--critics-only", "--first-call-processes", "1", "--issue-scale", "HEAD"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "on issue 26's machine, as a user's first call: 0.248 s" in out and "goal <= 0.3 s: met" in out
    assert "the work alone (collector off): 0.310 s" in out and code == 0


# --- costs of fused nodes ------------------------------------------------------------------


class _WideHeads(nn.Module):
    """Heads of different widths on one tensor: one wide group."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(64, w) for w in (8, 512, 2048))

    def forward(self, x):
        return [torch.relu(h(x)) for h in self.heads]


@pytest.mark.parametrize(
    "make, x",
    [
        (lambda: _WideHeads().eval(), torch.randn(64, 64)),
        (lambda: ParallelFCN(16).eval(), torch.randn(2, 320)),
    ],
    ids=["wide", "alike"],
)
def test_a_fused_nodes_cost_is_the_sum_of_its_members_costs(monkeypatch, make, x):
    """Members of one signature are estimated once per output description; a wide
    group's members (different widths) each."""
    captured = {}
    make_schedule = planner.make_schedule

    def watched(traced, metas, *args, **kwargs):
        captured.update(graph=traced.graph, metas=dict(metas), root=traced.root)
        return make_schedule(traced, metas, *args, **kwargs)

    monkeypatch.setattr("streamsched.new_signatures.make_schedule", watched)
    torch.manual_seed(0)
    model = make()
    sm = ss.StreamScheduledModule(copy.deepcopy(model))
    with torch.no_grad():
        out = sm(x)
        assert_path(sm, "recorded")
        ref = model(x)
    for got, want in zip(out if isinstance(out, list) else [out], ref if isinstance(ref, list) else [ref]):
        assert_close(got, want)
    dev = device_model_for(torch.device("cpu"))
    root, metas = captured["root"], captured["metas"]
    by_label = {node_label(n): n for n in captured["graph"].nodes}
    groups = sm.plan.fused_groups
    assert groups and (not isinstance(model, _WideHeads) or groups[0].kernel.startswith("wide")), groups
    fused_nodes = {n.name: n for n in sm._ss.last.graph.nodes}
    for group in groups:
        members = [by_label[label] for label in group.members]
        costs = [
            estimate_node_cost(m, root.get_submodule(m.target) if m.op == "call_module" else None, metas, dev)
            for m in members
        ]
        if group.kernel.startswith("wide"):
            assert len(set(costs)) > 1, "a wide group whose members cost the same tests nothing"
        expected = dev.launch_us + sum(max(0.0, c - dev.launch_us) for c in costs)
        assert node_meta.fixed_cost_us(fused_nodes[group.node]) == pytest.approx(expected, rel=1e-12)


# --- the collector during the recording call -------------------------------------------------


class _CollectorProbe(nn.Module):
    """A leaf task that notes whether the cyclic collector is on when it runs."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: list[bool] = []
        self.fail = fail

    def forward(self, x):
        self.seen.append(gc.isenabled())
        if self.fail:
            raise ValueError("planted failure in forward")
        return self.lin(x)


class _Probed(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.probe = _CollectorProbe(fail)
        self.other = nn.Linear(4, 4)

    def forward(self, x):
        return self.probe(x) + self.other(x)


def test_the_recording_call_runs_with_the_collector_paused_and_restores_it():
    assert gc.isenabled()
    torch.manual_seed(0)
    model = _Probed()
    sm = ss.StreamScheduledModule(copy.deepcopy(model), leaf_modules=(_CollectorProbe,), executor="serial")
    x = torch.randn(2, 4)
    out = sm(x)
    assert_path(sm, "recorded")
    assert_close(out, model(x))
    assert sm.module.probe.seen == [False] and gc.isenabled()
    fresh = torch.randn(2, 4)
    assert_close(sm(fresh), model(fresh))
    assert_path(sm, "plan")
    assert sm.module.probe.seen == [False, True]  # later calls: the collector as it was
    gc.disable()
    try:
        sm2 = ss.StreamScheduledModule(copy.deepcopy(model), leaf_modules=(_CollectorProbe,), executor="serial")
        sm2(x)
        assert not gc.isenabled()  # left off, as it was
    finally:
        gc.enable()
    failing = ss.StreamScheduledModule(_Probed(fail=True), leaf_modules=(_CollectorProbe,), executor="serial")
    with pytest.raises(ValueError, match="planted failure"):
        failing(x)
    # The recording call with the collector paused; then the model as written (which
    # raises the same error: it is the call's) with the collector as it was.
    assert failing.module.probe.seen == [False, True] and gc.isenabled()
