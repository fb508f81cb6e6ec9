"""Simulated time on the emulated device: kernel durations from the cost model, streams
that overlap, and the makespan of what ran.

Kernels still run at once on the CPU; next to that, each stream keeps a clock (when the
work queued on it so far would finish on a GPU). A kernel starts when its stream is free
and the host has issued it, and lasts the cost model's estimate (``ir.cost.GPU_MODEL``:
its launch time plus the roofline time of the kernel's FLOPs and bytes). An event
records its stream's clock; a wait moves the waiting stream's clock up to the event's.
The host is infinitely fast except where it synchronises: a stream, event or device
synchronisation, or a kernel whose result the host reads, moves the host clock to that
work's end, and nothing issued later starts before it.

So two streams overlap in simulated time exactly where no wait orders them, which is
what a plan says when it puts two tasks on different streams. Every figure here is
simulated: it says what the schedule allows, not what a GPU measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..ir import cost

__all__ = ["KernelSpan", "Timeline", "kernel_us"]

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot"}
_CONV = {"convolution", "_convolution", "conv1d", "conv2d", "conv3d", "cudnn_convolution"}


def _nbytes(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        try:
            total += t.numel() * t.element_size()
        except (RuntimeError, NotImplementedError):
            pass
    return total


def _flops(base: str, args: tuple, outs: list[torch.Tensor]) -> float:
    out = outs[0] if outs else None
    if out is None:
        return 0.0
    if base in _MATMUL:
        # The inner dimension is the last of the first matrix operand.
        mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 1]
        if base in ("addmm", "baddbmm", "addbmm", "addmv") and len(mats) >= 2:
            mats = mats[1:]
        if mats:
            return 2.0 * out.numel() * mats[0].shape[-1]
    if base in _CONV and len(args) >= 2 and isinstance(args[1], torch.Tensor):
        weight = args[1]
        return 2.0 * out.numel() * math.prod(weight.shape[1:])
    if base == "convolution_backward" and len(args) >= 3 and isinstance(args[2], torch.Tensor):
        grad_out, weight = args[0], args[2]
        if isinstance(grad_out, torch.Tensor):
            return 4.0 * grad_out.numel() * math.prod(weight.shape[1:])
    return float(sum(t.numel() for t in outs))


def kernel_us(
    func: Any, args: tuple, reads: list[torch.Tensor], writes: list[torch.Tensor], outs: list[torch.Tensor]
) -> float:
    """The simulated duration of one kernel, in microseconds (see the module docstring)."""
    model = cost.GPU_MODEL
    name = getattr(func, "_schema", None)
    base = name.name.split("::")[-1] if name is not None else str(func)
    flops = _flops(base, args, outs)
    moved = _nbytes(reads) + _nbytes(writes) + _nbytes(outs)
    return model.launch_us + max(flops / model.flops_per_us, moved / model.bytes_per_us)


@dataclass(frozen=True)
class KernelSpan:
    """One kernel in simulated time."""

    stream: str  # the stream's name ("stream 3 of cuda:0")
    stream_key: int
    name: str
    start: float  # microseconds, simulated
    end: float


@dataclass
class Timeline:
    """The kernels issued while it was recording, in simulated time (see the module
    docstring). Every number is simulated, in microseconds."""

    spans: list[KernelSpan] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        """From the first kernel's start to the last one's end."""
        if not self.spans:
            return 0.0
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)

    @property
    def serial_time(self) -> float:
        """The sum of every kernel's duration: the makespan on one stream."""
        return sum(s.end - s.start for s in self.spans)

    @property
    def streams(self) -> list[str]:
        """The streams that ran kernels, in order of first use."""
        return list(dict.fromkeys(s.stream for s in self.spans))

    def max_concurrency(self) -> int:
        """The most streams running a kernel at one instant."""
        points = sorted(
            [(s.start, 1) for s in self.spans if s.end > s.start] + [(s.end, -1) for s in self.spans if s.end > s.start]
        )
        running = best = 0
        for _, step in points:  # an end sorts before a start at the same instant
            running += step
            best = max(best, running)
        return best

    def overlap(self, a: str, b: str) -> float:
        """How long streams ``a`` and ``b`` both ran kernels."""
        total = 0.0
        sa = [s for s in self.spans if s.stream == a]
        sb = [s for s in self.spans if s.stream == b]
        for x in sa:
            for y in sb:
                total += max(0.0, min(x.end, y.end) - max(x.start, y.start))
        return total

    def summary(self) -> str:
        """One line: the simulated makespan against the one-stream time."""
        serial = self.serial_time
        ratio = serial / self.makespan if self.makespan else 1.0
        return (
            f"simulated: makespan {self.makespan:.1f} us on {len(self.streams)} stream(s), "
            f"{serial:.1f} us of kernels ({ratio:.2f}x overlap), {len(self.spans)} kernels"
        )


class Clocks:
    """The per-stream and host clocks of the emulator (see the module docstring)."""

    def __init__(self) -> None:
        self.stream: dict[int, float] = {}
        self.host = 0.0
        self.recording: list[Timeline] = []

    def run(self, skey: int, name: str, label: str, duration: float, host_reads: bool = False) -> None:
        start = max(self.stream.get(skey, 0.0), self.host)
        end = start + duration
        self.stream[skey] = end
        if host_reads:
            self.host = max(self.host, end)
        if self.recording and duration > 0:
            span = KernelSpan(label, skey, name, start, end)
            for t in self.recording:
                t.spans.append(span)

    def at(self, skey: int) -> float:
        return self.stream.get(skey, 0.0)

    def wait(self, skey: int, until: float) -> None:
        if until > self.stream.get(skey, 0.0):
            self.stream[skey] = until

    def host_waits(self, until: float) -> None:
        self.host = max(self.host, until)

    @property
    def timing(self) -> bool:
        return bool(self.recording)


def critical_path(durations: dict[int, float], deps: dict[int, Any]) -> float:
    """The longest chain of captured kernels (node ids ascend in capture order)."""
    finish: dict[int, float] = {}
    for nid in sorted(durations):
        finish[nid] = durations[nid] + max((finish.get(d, 0.0) for d in deps.get(nid, ())), default=0.0)
    return max(finish.values(), default=0.0)


def outputs_of(value: Any) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            out.extend(outputs_of(v))
    return out
