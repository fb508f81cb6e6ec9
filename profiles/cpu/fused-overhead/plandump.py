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
for m, x in [(ParallelFCN(1000).eval(), None), (CriticEnsemble(32).eval(), torch.randn(16, 23))]:
    if x is None:
        x = torch.randn(1, m.n * m.d_in)
    sm = ss.StreamScheduledModule(m)
    with torch.no_grad():
        y = sm(x)
    p = sm._ss.last
    out.append(str(sm.plan))
    out.append(repr([(t.name, [n.name for n in t.nodes]) for t in p.task_graph.tasks]))
    out.append(str(p.graph))
    out.append(repr(p.schedule.assignment) if hasattr(p, "schedule") else "")
    torch.save(y, sys.argv[1] + f".{type(m).__name__}.pt")
open(sys.argv[1], "w").write("\n".join(out))
