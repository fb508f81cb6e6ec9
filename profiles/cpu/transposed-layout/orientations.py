"""``baddbmm`` over N members' 2-d values in the orientations a fused Linear can take,
CPU time of the calling thread, one intra-op thread, microseconds per call (the fastest
of 5 loops of calls):

    .venv/bin/python profiles/cpu/transposed-layout/orientations.py

For members of ``[M, I]`` -> ``[M, O]`` (N, M, I, O on each line): ``fold:cur``, the input
a fold of one ``[M, N*I]`` tensor viewed ``[N, M, I]`` times the weight stack
``[N, O, I]`` viewed transposed (the stacked kernel's ``xs @ W^T``); ``foldT``, ``W @``
the fold viewed ``[N, I, M]``; ``stack:cur`` and ``stackT``, the same from a contiguous
stack; ``Tcontig``, ``W @ x`` with ``x`` held ``[N, I, M]`` contiguous (a chain in the
transposed layout).
"""

from __future__ import annotations

import time

import torch

CASES = [
    (32, 16, 64, 64),
    (32, 16, 64, 1),
    (1000, 64, 20, 10),
    (1000, 64, 10, 1),
    (8, 64, 64, 64),
    (8, 256, 256, 256),
    (64, 4, 32, 32),
    (256, 16, 16, 16),
    (32, 128, 64, 64),
    (16, 32, 128, 8),
    # few rows
    (64, 1, 32, 32),
    (64, 8, 32, 32),
    (32, 8, 64, 64),
    (1000, 8, 20, 10),
    (1000, 16, 20, 10),
]


def best_us(fn, budget_s: float = 0.02) -> float:
    """Microseconds per call: loops of as many calls as fill ``budget_s``, the fastest of 5."""
    fn()
    start, n = time.thread_time(), 0
    while time.thread_time() - start < budget_s:
        fn()
        n += 1
    best = float("inf")
    for _ in range(5):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n)
    return best * 1e6


def orientations(n: int, m: int, i: int, o: int) -> list[float]:
    """The five timings of one line (see the module's docstring)."""
    x = torch.randn(m, n * i)
    fold = x.view(m, n, i).transpose(0, 1)
    fold_t = x.view(m, n, i).permute(1, 2, 0)
    stack = fold.contiguous()
    stack_t = stack.transpose(1, 2)
    held_t = fold_t.contiguous()
    w = torch.randn(n, o, i)
    b = torch.randn(n, o)
    rows_b, cols_b = b.unsqueeze(1), b.unsqueeze(2)
    wt = w.transpose(1, 2)
    return [
        best_us(lambda: torch.baddbmm(rows_b, fold, wt)),
        best_us(lambda: torch.baddbmm(cols_b, w, fold_t)),
        best_us(lambda: torch.baddbmm(rows_b, stack, wt)),
        best_us(lambda: torch.baddbmm(cols_b, w, stack_t)),
        best_us(lambda: torch.baddbmm(cols_b, w, held_t)),
    ]


def main() -> None:
    torch.set_num_threads(1)
    print("N M I O | fold:cur foldT | stack:cur stackT | Tcontig")
    for n, m, i, o in CASES:
        times = orientations(n, m, i, o)
        print(
            n, m, i, o, "|", " ".join(f"{v:8.1f}" for v in times[:2]), "|",
            " ".join(f"{v:8.1f}" for v in times[2:4]), "|", f"{times[4]:8.1f}",
        )  # fmt: skip


if __name__ == "__main__":
    main()
