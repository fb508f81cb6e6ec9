"""Where the CriticEnsemble(32) training step over ``fused_parameters()`` differs from the
hand-written ``StackedCritics`` step, piece by piece, in CPU time of the calling thread.

    python <tree>/profiles/cpu/train-hand/critic_pieces.py ROUNDS

Batch 16, one intra-op thread. Each piece is timed against its counterpart in the same
interleaved rounds (300 calls a sample); prints the median and minimum microseconds a
call. Forward pieces run with grad enabled (the graph they build is freed each call).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import streamsched as ss  # noqa: E402
from benchmarks.zoo import CriticEnsemble, StackedCritics  # noqa: E402
from streamsched.passes.fusion import StackedParameter  # noqa: E402
from streamsched.passes.fusion.kernels import StackedLinear  # noqa: E402
from streamsched.testing import assert_path  # noqa: E402


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 11
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = CriticEnsemble(32).train()
    x = torch.randn(16, 23)
    target = torch.zeros(32, 16, 1)
    sm = ss.StreamScheduledModule(copy.deepcopy(base))
    with torch.no_grad():
        sm(x)
    fused = list(sm.fused_parameters())
    opt = torch.optim.SGD(fused, lr=1e-3)
    hand = StackedCritics(base)
    hopt = torch.optim.SGD(hand.parameters(), lr=1e-3)
    for _ in range(10):
        opt.zero_grad()
        F.mse_loss(sm(x), target).backward()
        opt.step()
        hopt.zero_grad()
        F.mse_loss(hand(x), target).backward()
        hopt.step()
    assert_path(sm, "plan:serial")
    with torch.no_grad():
        assert (sm(x) - hand(x)).abs().max() < 1e-5
    program = sm._ss.last.program.call
    kernels = [program.__globals__[f"_f{i}"] for i in range(5)]
    w = [p.detach().clone().requires_grad_() for p in hand.w]
    b = [p.detach().clone().requires_grad_() for p in hand.b]
    apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, StackedLinear)
    h1 = torch.relu(F.linear(x, w[0].reshape(2048, 23), b[0].reshape(-1))).detach()
    h2 = torch.randn(32, 16, 64)
    bufs = [p._stack.buf for p in fused if isinstance(p, StackedParameter)]
    g_hidden = torch.randn(32, 16, 64)
    xs_hidden = torch.randn(32, 16, 64)
    grad_t = torch.randn(32, 64, 64).transpose(1, 2)

    def each(fn, items):
        return lambda: [fn(i) for i in items]

    pairs = {
        "wrapper: sm(x) | the plan's program": (lambda: sm(x), lambda: program([x])),
        "wide linear kernel | F.linear": (
            lambda: kernels[0].fast(x),
            lambda: F.linear(x, w[0].reshape(2048, 23), b[0].reshape(-1)),
        ),
        "hidden kernel | its ops written out": (
            lambda: kernels[2].fast(h1),
            lambda: apply(h1.reshape(16, 32, 64).movedim(1, 0), w[1], b[1]),
        ),
        "last kernel | its ops written out": (lambda: kernels[4].fast(h2), lambda: apply(h2, w[2], b[2])),
        "StackedLinear hidden | autograd baddbmm": (
            lambda: apply(h2, w[1], b[1]),
            lambda: torch.baddbmm(b[1].unsqueeze(1), h2, w[1].transpose(1, 2)),
        ),
        "StackedLinear last | autograd baddbmm": (
            lambda: apply(h2, w[2], b[2]),
            lambda: torch.baddbmm(b[2].unsqueeze(1), h2, w[2].transpose(1, 2)),
        ),
        "zero_grad: fused | hand": (lambda: opt.zero_grad(), lambda: hopt.zero_grad()),
        "zero_() of the 6 buffers | nothing": (each(torch.Tensor.zero_, bufs), lambda: None),
        "6 x .grad: fused | hand": (
            each(lambda p: p.grad, fused),
            each(lambda p: p.grad, list(hand.parameters())),
        ),
        "hidden weight grad: sink baddbmm_ | bmm + add_": (
            lambda: bufs[2].baddbmm_(g_hidden.transpose(1, 2), xs_hidden),
            lambda: bufs[2].add_(torch.bmm(g_hidden.transpose(1, 2), xs_hidden)),
        ),
        "hand's hidden weight grad: transposed clone | contiguous clone": (
            lambda: grad_t.clone(memory_format=torch.contiguous_format),
            lambda: bufs[2].clone(),
        ),
    }
    samples = {k: ([], []) for k in pairs}
    for fa, fb in pairs.values():
        for _ in range(20):
            fa()
            fb()
    names = list(pairs)
    for r in range(rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                fn = pairs[k][side]
                t0 = time.thread_time()
                for _ in range(300):
                    fn()
                samples[k][side].append((time.thread_time() - t0) / 300 * 1e6)
    print(f"streamsched from {Path(ss.__file__).parent}; load average {os.getloadavg()}")
    print(f"CriticEnsemble(32), batch 16; 1 thread; {rounds} rounds x 300 calls; CPU us per call (median / min)")
    for k, (a, c) in samples.items():
        ma, mc = statistics.median(a), statistics.median(c)
        print(f"  {k:62s} {ma:8.2f} / {min(a):7.2f}  vs {mc:8.2f} / {min(c):7.2f}  diff {ma - mc:+7.2f}")


if __name__ == "__main__":
    main()
