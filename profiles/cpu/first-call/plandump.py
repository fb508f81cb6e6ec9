# Plan text, plan fields, scheduled tasks, rewritten graph and assignment of eight zoo cases,
# and their outputs: python plandump.py TREE OUT (writes OUT and OUT.<case>.pt). Compare
# two trees' OUT files byte for byte and their .pt files with torch.equal.
import copy
import sys
import warnings

sys.path.insert(0, sys.argv[1])
warnings.simplefilter("ignore")
import torch  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble, Inception3, MultiTaskHeads, NASNetCells, ParallelFCN, RandWire  # noqa: E402

torch.set_num_threads(1)
out = []


def flat(v):
    if isinstance(v, torch.Tensor):
        return [v]
    keys = sorted(v) if isinstance(v, dict) else range(len(v))
    return [t for k in keys for t in flat(v[k])]


def scheduled(compiled):
    """Each task's (name, nodes, cost) and (issue order, streams, waits, records), from the
    flat task list of a Schedule (or, in trees from before it, the task graph and the
    assignment), in one form for both."""
    s = compiled.schedule
    if hasattr(s, "issue_order"):
        tasks = [(t.name, [n.name for n in t.nodes], t.cost_us) for t in s.tasks]
        return tasks, (
            s.issue_order(),
            [t.stream for t in s.tasks],
            [list(t.waits) for t in s.tasks],
            [t.records for t in s.tasks],
        )
    a = s.assignment
    tasks = [(t.name, [n.name for n in t.nodes], t.cost) for t in s.task_graph.tasks]
    return tasks, (list(a.order), list(a.stream), [list(w) for w in a.waits], list(a.records))


def case(name, make, x, grad=False, **config):
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, **config)
    with torch.enable_grad() if grad else torch.no_grad():
        y, y2, ref = sm(x), sm(x), reference(x)
    compiled = sm._ss.last
    out.append(f"=== {name}")
    out.append(str(sm.plan))
    out.append(repr(sm.plan.model_dump()))
    tasks, assignment = scheduled(compiled) if hasattr(compiled, "schedule") else ([], None)
    out.append(repr([(name, nodes, round(cost, 6)) for name, nodes, cost in tasks]))
    out.append(str(compiled.graph))
    out.append(repr(assignment))
    for a, b, r in zip(flat(y), flat(y2), flat(ref)):
        out.append(f"max err vs eager: {float((a - r).abs().max()):.3e} {float((b - r).abs().max()):.3e}")
    torch.save([t.detach() for t in flat(y)], f"{sys.argv[2]}.{name}.pt")


torch.manual_seed(1)
case("pfcn1000", lambda: ParallelFCN(1000).eval(), torch.randn(1, 20000))
case("pfcn64_nofuse", lambda: ParallelFCN(64).eval(), torch.randn(4, 64 * 20), fuse=False)
case("pfcn64_grad", lambda: ParallelFCN(64), torch.randn(4, 64 * 20), grad=True)
case("critics", lambda: CriticEnsemble(32).eval(), torch.randn(16, 23))
case("heads", lambda: MultiTaskHeads().eval(), torch.randn(8, 64))
case("inception", lambda: Inception3(num_classes=10).eval(), torch.randn(1, 3, 96, 96))
case("nasnet", lambda: NASNetCells(channels=16, cells=2, num_classes=10).eval(), torch.randn(1, 3, 32, 32))
case("randwire", lambda: RandWire().eval(), torch.randn(1, 3, 32, 32))
open(sys.argv[2], "w").write("\n".join(out))
