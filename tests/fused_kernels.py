"""Each fused kernel of a plan checked against its members, one by one, in the plan's dtype.

A fused kernel (``streamsched.passes.fusion.kernels``) does the work of N members in
one call. Where it is wrong, the error shows here first, on the kernel's own inputs,
before any model amplifies it or a float64 comparison of the whole model explains it
away: a float32-only error in a kernel is invisible to a float64 copy of the wrapper.

:func:`fused_kernel_problems` runs the schedule of a wrapper's most recent call node by
node on that call's inputs (an ``fx.Interpreter`` over the plan's rewritten graph), and at
every fused node runs each member on its slice of the kernel's inputs (the member module
itself, or the member's function for elementwise groups) and compares the member's
output with its slice of the kernel's output. The kernel and the members compute the
same sums in another order (``bmm`` vs one ``linear``), so the tolerance is relative to
the size of the member's output: ``KERNEL_RTOL`` of its largest element, about 170 float32
ulps; a 1e-3 error in an output of size 1 is 50 times that.

Nothing the check runs stays: buffers (BatchNorm running statistics, which both the
kernel and its members update in training mode) and the random number generator are
restored afterwards, and it runs without autograd. The buffers are restored in place,
which moves their version counters: run the check after the call's backward (BatchNorm
saves its running statistics for it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

import streamsched as ss
from streamsched.passes.fusion.kernels import (
    BatchNormKernel,
    ConvKernel,
    ElementwiseKernel,
    FusedKernel,
    LayerNormKernel,
    LinearKernel,
    VmapKernel,
    WideKernel,
)
from streamsched.passes.fusion.layout import SHARED, to_stack

__all__ = ["KERNEL_RTOL", "fused_kernel_problems", "assert_fused_kernels_match_members"]

KERNEL_RTOL = 2e-5
"""A member's slice of the kernel's output may differ from the member's own output by
this fraction of the largest element of the member's output (float32: ~170 ulps)."""

_ONE_INPUT = (LinearKernel, ConvKernel, BatchNormKernel, LayerNormKernel)


def _member_inputs(kernel: FusedKernel, args: tuple, i: int) -> tuple[list[Any], dict]:
    """Member ``i``'s positional inputs (and keyword arguments) from the kernel's inputs."""
    n = kernel.n
    if isinstance(kernel, _ONE_INPUT):
        return [to_stack(args[0], kernel.in_layout, n, kernel.in_shape)[i]], {}
    if isinstance(kernel, WideKernel):
        return [args[0]], {}
    if isinstance(kernel, VmapKernel):
        xs = [
            x if layout == SHARED else to_stack(x, layout, n, shape)[i]
            for x, (layout, shape) in zip(args, kernel.inputs)
        ]
        return xs, kernel.kwargs
    if isinstance(kernel, ElementwiseKernel):
        it = iter(args)
        member = []
        for op in kernel.operands:
            if op[0] == "c":
                member.append(op[1])
            else:
                member.append(to_stack(next(it), op[1], n, tuple(op[2]))[i])
        return member, kernel.kwargs
    raise TypeError(f"no member-by-member check for {type(kernel).__name__}: add one to tests/fused_kernels.py")


def _member_output(kernel: FusedKernel, out: torch.Tensor, i: int) -> torch.Tensor:
    """Member ``i``'s slice of the kernel's output."""
    kind, dim = kernel.out_layout
    if kind == "split":
        return torch.split(out, kernel.sizes, dim)[i]
    return to_stack(out, kernel.out_layout, kernel.n, kernel.out_shape)[i]


def _run_member(kernel: FusedKernel, root: torch.nn.Module, i: int, args: list[Any], kwargs: dict) -> Any:
    if isinstance(kernel, ElementwiseKernel):
        return kernel.fn(*args, **kwargs)
    return root.get_submodule(kernel.member_names[i])(*args, **kwargs)


def _compare(label: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{label}: kernel slice {tuple(got.shape)} {got.dtype}, member {tuple(want.shape)} {want.dtype}"
    if want.numel() == 0:
        return None
    if not want.is_floating_point():
        return None if torch.equal(got, want) else f"{label}: integer outputs differ"
    same = (got == want) | (got.isnan() & want.isnan())
    if bool(same.all()):
        return None
    diff = (got.double() - want.double()).abs().nan_to_num(float("inf"))
    diff = torch.where(same, torch.zeros_like(diff), diff)
    scale = float(want.double().abs().nan_to_num(0.0, 0.0, 0.0).max())
    allowed = KERNEL_RTOL * max(scale, 1e-30)
    worst = float(diff.max())
    if worst <= allowed:
        return None
    return (
        f"{label}: max |kernel - member| {worst:.3g} > {allowed:.3g} "
        f"({KERNEL_RTOL:g} of the member's max |out| {scale:.3g})"
    )


class _KernelChecker(fx.Interpreter):
    def __init__(self, root: torch.nn.Module, graph: fx.Graph):
        super().__init__(root, graph=graph)
        self.problems: list[str] = []
        self.checked = 0

    def call_function(self, target: Any, args: tuple, kwargs: dict) -> Any:
        out = super().call_function(target, args, kwargs)
        if isinstance(target, FusedKernel):
            self.checked += 1
            for i in range(target.n):
                member_args, member_kwargs = _member_inputs(target, args, i)
                want = _run_member(target, self.module, i, member_args, member_kwargs)
                label = f"{target.kernel} x{target.n}, member {i} ({target.member_names[i]})"
                problem = _compare(label, _member_output(target, out, i), want)
                if problem:
                    self.problems.append(problem)
        return out


def fused_kernel_problems(sm: ss.StreamScheduledModule, *args: Any, **kwargs: Any) -> tuple[int, list[str]]:
    """``(kernels checked, problems)`` for the plan ``sm``'s most recent call ran, run on
    ``args``/``kwargs`` (that call's inputs, or others of the same signature)."""
    compiled = sm._ss.last
    schedule = getattr(compiled, "schedule", None)
    if schedule is None:
        raise AssertionError("the wrapper's last call has no compiled plan to check (eager dispatch or none yet)")
    leaves, spec = sm._ss.bind(args, kwargs)
    tensors = [leaves[i] for i in spec.tensor_positions]
    state = [(b, b.detach().clone()) for b in sm.module.buffers()]
    checker = _KernelChecker(schedule.root, schedule.graph)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        try:
            checker.run(*tensors)
        finally:
            for b, saved in state:
                b.copy_(saved)
    return checker.checked, checker.problems


def assert_fused_kernels_match_members(sm: ss.StreamScheduledModule, *args: Any, **kwargs: Any) -> int:
    """Raise ``AssertionError`` listing every member whose slice of its kernel's output
    differs from its own output; returns the number of kernels checked."""
    checked, problems = fused_kernel_problems(sm, *args, **kwargs)
    if problems:
        shown = "\n  ".join(problems[:8])
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        raise AssertionError(f"fused kernels differ from their members ({len(problems)}):\n  {shown}{more}")
    return checked
