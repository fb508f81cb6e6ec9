# Dumps the plan, task graph and outputs of ParallelFCN(1000) and CriticEnsemble(32), to diff two trees.
import sys
import warnings

import torch

import streamsched as ss
from benchmarks.zoo import CriticEnsemble, ParallelFCN

warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
out = []


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


for m, x in [(ParallelFCN(1000).eval(), None), (CriticEnsemble(32).eval(), torch.randn(16, 23))]:
    if x is None:
        x = torch.randn(1, m.n * m.d_in)
    sm = ss.StreamScheduledModule(m)
    with torch.no_grad():
        y = sm(x)
    p = sm._ss.last
    out.append(str(sm.plan))
    tasks, assignment = scheduled(p)
    out.append(repr([(name, nodes) for name, nodes, _ in tasks]))
    out.append(str(p.graph))
    out.append(repr(assignment))
    torch.save(y, sys.argv[1] + f".{type(m).__name__}.pt")
open(sys.argv[1], "w").write("\n".join(out))
