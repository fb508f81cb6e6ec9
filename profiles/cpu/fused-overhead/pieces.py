# Per-call pieces of the CriticEnsemble(32) fused call, CPU time (see README.md).
import sys
import time
import warnings

import torch
import torch.nn.functional as F

import streamsched as ss
from benchmarks.zoo import CriticEnsemble

warnings.simplefilter("ignore")
torch.set_num_threads(1)
torch.manual_seed(0)
m = CriticEnsemble(32).eval()
x = torch.randn(16, 23)
sm = ss.StreamScheduledModule(m, executor="serial")


def bench(fn, n=2000, reps=7):
    best = 1e9
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - t) / n)
    return best * 1e6


with torch.no_grad():
    for _ in range(3):
        sm(x)
    sch = sm._ss.last
    p = sch.program
    ks = [n.target for n in sch.graph.nodes if n.op == "call_function"]
    Ls = [[c.net[i] for c in m.critics] for i in (0, 2, 4)]
    W = [torch.stack([lin.weight.t() for lin in L]).contiguous() for L in Ls]
    B = [torch.stack([lin.bias for lin in L]).unsqueeze(1).contiguous() for L in Ls]

    def hand(x):
        h = torch.baddbmm(B[0], x.expand(32, *x.shape), W[0]).relu_()
        h = torch.baddbmm(B[1], h, W[1]).relu_()
        return torch.baddbmm(B[2], h, W[2])

    w0 = ks[0].weight.stack.reshape(2048, 23)
    b0 = ks[0].bias.stack.reshape(2048)
    w1 = ks[2].weight.stack.transpose(1, 2)
    b1 = ks[2].bias.stack.unsqueeze(1)
    w2 = ks[4].weight.stack.transpose(1, 2)
    b2 = ks[4].bias.stack.unsqueeze(1)

    def rawops(x):
        h = torch.relu(F.linear(x, w0, b0))
        h = torch.relu(torch.baddbmm(b1, h.view(16, 32, 64).movedim(1, 0), w1))
        return torch.baddbmm(b2, h, w2).contiguous()

    def rawops_inplace(x):
        h = F.linear(x, w0, b0).relu_()
        h = torch.baddbmm(b1, h.view(16, 32, 64).movedim(1, 0), w1).relu_()
        return torch.baddbmm(b2, h, w2).contiguous()

    # load + run_serial + output: the program's pieces as the executors with a log or
    # observer run them; p.call is the one function the serial executor runs otherwise.
    def program_only():
        env = p.load([x])
        p.run_serial(env)
        return p.output(env)

    def run_path():
        return sm._run(sch, [x])

    def checks():
        for s in p.stacks:
            s.check()

    assert torch.equal(rawops(x), sm(x)) and torch.allclose(hand(x), sm(x), atol=1e-5)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    res = {}
    for _ in range(rounds):
        for name, fn in [
            ("sm(x)", lambda: sm(x)),
            ("_run", run_path),
            ("program", program_only),
            ("call", lambda: p.call([x])),
            ("rawops", lambda: rawops(x)),
            ("rawops_inplace", lambda: rawops_inplace(x)),
            ("hand", lambda: hand(x)),
            ("checks", checks),
            ("forward", lambda: sm.forward(x)),
        ]:
            res[name] = min(res.get(name, 1e9), bench(fn))
    for k, v in res.items():
        print(f"{k:16s} {v:8.1f} us")
