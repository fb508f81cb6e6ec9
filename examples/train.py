"""Train a branchy model eagerly and wrapped in streamsched, side by side, and compare.

Both copies start from the same parameters and see the same batches in the same order
(a synthetic task with a learnable answer); each step runs both, alternating which goes
first so that machine noise hits them alike. Printed: the two loss curves every
``--print-every`` steps, the largest difference between the curves and between the
final parameters, and the median time per training step (forward, backward, AdamW).

    python examples/train.py                          # towers + heads, 300 steps, CPU or CUDA
    python examples/train.py --model nasnet --steps 500 --device cuda
    python examples/train.py --executor threads --no-fuse

Models: ``towers`` (defined below: towers of different depths plus an ensemble of
identical heads, regression; the default, about a minute on a 2-core CPU) or ``nasnet``
(benchmarks.zoo.NASNetCells, 10-way classification of 16x16 images; its depthwise
convolutions are slow on CPU, so give it a GPU or fewer steps).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
# The repository root (benchmarks.zoo), last: streamsched is the installed one as before.
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _timing import add_threads_option, apply_threads, cpu_threads, threads_note  # noqa: E402

import streamsched as ss  # noqa: E402
from benchmarks.zoo import NASNetCells  # noqa: E402


class TowersAndHeads(nn.Module):
    """Towers of depths 1..``towers`` over one input, summed, then ``heads`` identical heads.

    The towers are independent branches of different lengths (streams); the heads are
    structurally identical (fused into batched kernels).
    """

    def __init__(self, d_in: int = 64, width: int = 256, towers: int = 4, heads: int = 8):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d_in, width), *[m for _ in range(depth) for m in (nn.GELU(), nn.Linear(width, width))]
            )
            for depth in range(towers)
        )
        self.heads = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 64), nn.ReLU(), nn.Linear(64, 1)) for _ in range(heads)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.towers[0](x)
        for tower in self.towers[1:]:
            h = h + tower(x)
        return torch.cat([head(h) for head in self.heads], dim=1)


@dataclass
class Task:
    """A model and a synthetic dataset whose targets a fixed random teacher produced."""

    model: nn.Module
    inputs: torch.Tensor
    targets: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def make_task(name: str, samples: int, generator: torch.Generator) -> Task:
    if name == "nasnet":
        model = NASNetCells(16, 2, num_classes=10)
        x = torch.randn(samples, 3, 16, 16, generator=generator)
        teacher = torch.randn(3 * 4 * 4, 10, generator=generator)
        labels = (F.avg_pool2d(x, 4).flatten(1) @ teacher).argmax(dim=1)
        return Task(model, x, labels, F.cross_entropy)
    model = TowersAndHeads()
    x = torch.randn(samples, 64, generator=generator)
    teacher = torch.randn(64, 8, generator=generator) / 8
    y = torch.tanh(x @ teacher) + 0.05 * torch.randn(samples, 8, generator=generator)
    return Task(model, x, y, F.mse_loss)


class Trainer:
    """One model, its optimizer, and a record of its losses and step times."""

    def __init__(self, model: nn.Module, loss: Callable, lr: float, device: torch.device):
        self.model = model
        self.loss = loss
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr)
        self.device = device
        self.losses: list[float] = []
        self.times_ms: list[float] = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        sync(self.device)
        start = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        sync(self.device)
        self.times_ms.append((time.perf_counter() - start) * 1e3)
        self.losses.append(float(loss.detach()))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=["towers", "nasnet"], default="towers")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--print-every", type=int, default=25)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--executor", choices=["auto", "serial", "threads", "streams"], default="auto")
    parser.add_argument("--no-fuse", action="store_true", help="do not batch identical branches")
    parser.add_argument("--seed", type=int, default=0)
    add_threads_option(parser)
    args = parser.parse_args()
    apply_threads(args)
    if args.steps < 1 or args.batch < 1 or args.print_every < 1:
        parser.error("--steps, --batch and --print-every must be positive")
    device = torch.device(args.device)

    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    task = make_task(args.model, samples=64 * args.batch, generator=generator)
    eager_model = task.model.to(device)
    wrapped_model = copy.deepcopy(eager_model)  # the same initial parameters
    sm = ss.StreamScheduledModule(wrapped_model, executor=args.executor, fuse=not args.no_fuse)
    eager = Trainer(eager_model, task.loss, args.lr, device)
    wrapped = Trainer(sm, task.loss, args.lr, device)

    print(
        f"streamsched {ss.__version__} ({ss.runtime_info()['runtime']} runtime), torch {torch.__version__}, "
        f"device {device}, {cpu_threads()}"
    )
    print(f"{args.model}: {sum(p.numel() for p in eager_model.parameters()):,} parameters, batch {args.batch}")
    print(f"{'step':>6} {'eager loss':>12} {'streamsched loss':>17} {'difference':>11}")
    order = torch.randperm(len(task.inputs), generator=generator)
    for step in range(args.steps):
        start = (step * args.batch) % len(order)
        if start + args.batch > len(order):  # a new epoch, a new shuffle, the same for both
            order = torch.randperm(len(task.inputs), generator=generator)
            start = 0
        index = order[start : start + args.batch]
        x, y = task.inputs[index].to(device), task.targets[index].to(device)
        pair = (eager, wrapped) if step % 2 == 0 else (wrapped, eager)
        for trainer in pair:
            trainer.step(x, y)
        if step == 0:
            streams, groups = sm.plan.num_streams, len(sm.plan.fused_groups)
            print(
                f"       (plan: {sm.plan.executor}, {streams} stream{'s' if streams != 1 else ''}, "
                f"{groups} fused group{'s' if groups != 1 else ''}, {len(sm.plan.tasks)} tasks)"
            )
        if step % args.print_every == 0 or step == args.steps - 1:
            e, w = eager.losses[-1], wrapped.losses[-1]
            print(f"{step:>6} {e:>12.6f} {w:>17.6f} {abs(e - w):>11.2e}")

    curve_diff = max(abs(e - w) for e, w in zip(eager.losses, wrapped.losses))
    param_diff = max(
        float((p_e.detach() - p_w.detach()).abs().max())
        for p_e, p_w in zip(eager_model.parameters(), wrapped_model.parameters())
    )
    # The first step of the wrapped model traces and plans: leave it out of the timing.
    t_eager = statistics.median(eager.times_ms[1:] or eager.times_ms)
    t_wrapped = statistics.median(wrapped.times_ms[1:] or wrapped.times_ms)
    print(f"max |loss difference| over {args.steps} steps: {curve_diff:.3e}")
    print(f"max |parameter difference| after training: {param_diff:.3e}")
    if curve_diff or param_diff:
        # Equal without fusion; a fused kernel sums in another order, and training
        # carries the last-bit differences from step to step.
        print(
            "  (fused kernels add up in another order than the loop: each step differs in the last bits, "
            "and training carries that on; with --no-fuse the serial schedule trains bit for bit as eager)"
            if sm.plan.fused_groups
            else "  (the executor sums some gradients in another order: float rounding)"
        )
    print(
        f"loss: {eager.losses[0]:.4f} -> {eager.losses[-1]:.4f} (eager), "
        f"{wrapped.losses[0]:.4f} -> {wrapped.losses[-1]:.4f} (streamsched)"
    )
    print(
        f"time per step (median): eager {t_eager:.2f} ms, streamsched {t_wrapped:.2f} ms "
        f"-> {t_eager / t_wrapped:.2f}x  [{sm.plan.executor}, {threads_note(device)}]"
    )
    print(f"(first step of streamsched, with tracing and planning: {wrapped.times_ms[0]:.1f} ms)")


if __name__ == "__main__":
    main()
