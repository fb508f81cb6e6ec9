"""ParallelFCN(1000)'s one-output layer (weight ``[1000, 1, 10]``, 64 rows): ATen's CPU
batched products over the weight as stored (strides ``(10, 10, 1)``) and restrided to
stride 1 on its size-1 dim (``(10, 1, 1)``, the same elements), in the backward's input
gradient (``bmm(grad, w)``) and in the forward (``baddbmm(b, w, x^T)``). CPU time of the
calling thread, median over calls made in turn, one thread; three rounds.

    python profiles/cpu/train-memory/one_output_strides.py
"""

import time

import torch

torch.set_num_threads(1)
rows, members, width = 64, 1000, 10
# The backward's incoming gradient: the output gather's [rows, members] gradient seen as
# [members, rows, 1] (stride 1 over members).
grad = torch.randn(rows, members).t().unsqueeze(2).as_strided((members, rows, 1), (1, members, 1))
w = torch.randn(members, 1, width)
w_unit = w.as_strided(w.shape, (width, 1, 1))
h = torch.randn(members, rows, width)
b = torch.randn(members, 1, 1)
out = torch.empty(members, 1, rows)


def interleaved_us(fns: dict, n: int = 200) -> dict:
    """Median CPU microseconds of each function, the functions called in turn."""
    for f in fns.values():
        f()
    times: dict = {name: [] for name in fns}
    for _ in range(n):
        for name, f in fns.items():
            t0 = time.thread_time()
            f()
            times[name].append(time.thread_time() - t0)
    return {name: sorted(ts)[n // 2] * 1e6 for name, ts in times.items()}


assert torch.equal(torch.bmm(grad, w), torch.bmm(grad, w_unit))
for _ in range(3):
    backward = interleaved_us({"as stored": lambda: torch.bmm(grad, w), "unit": lambda: torch.bmm(grad, w_unit)})
    forward = interleaved_us(
        {
            "as stored": lambda: torch.baddbmm(b, w, h.transpose(1, 2), out=out),
            "unit": lambda: torch.baddbmm(b, w_unit, h.transpose(1, 2), out=out),
        },
        n=20,
    )
    print(
        f"backward bmm(grad, w): as stored {backward['as stored']:.0f} us, unit strides {backward['unit']:.0f} us | "
        f"forward baddbmm(b, w, h^T): as stored {forward['as stored']:.0f} us, unit strides {forward['unit']:.0f} us"
    )
