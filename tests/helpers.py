"""Shared test helpers: comparisons with useful failure messages, and small models."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path


def flatten(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in sorted(value) for t in flatten(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten(v)]
    return []


def assert_close(actual: Any, expected: Any, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """Compare nested outputs; on failure say where the worst mismatch is and how much fails."""
    a_list, e_list = flatten(actual), flatten(expected)
    assert len(a_list) == len(e_list), f"{what}: {len(a_list)} tensors vs {len(e_list)} expected"
    for i, (a, e) in enumerate(zip(a_list, e_list)):
        assert a.shape == e.shape, f"{what}[{i}]: shape {tuple(a.shape)} vs {tuple(e.shape)}"
        assert a.dtype == e.dtype, f"{what}[{i}]: dtype {a.dtype} vs {e.dtype}"
        a64, e64 = a.detach().double().cpu(), e.detach().double().cpu()
        bad = ~torch.isclose(a64, e64, atol=atol, rtol=rtol, equal_nan=True)
        if bad.any():
            diff = (a64 - e64).abs().nan_to_num(float("inf"))
            worst = int(diff.argmax())
            idx = tuple(int(j) for j in torch.unravel_index(torch.tensor(worst), a.shape))
            raise AssertionError(
                f"{what}[{i}]: {int(bad.sum())}/{bad.numel()} elements differ "
                f"({100.0 * float(bad.float().mean()):.2f}%); worst at {idx}: "
                f"{float(a64.flatten()[worst])} vs {float(e64.flatten()[worst])}"
            )


def called_on(sm: ss.StreamScheduledModule, path: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``sm`` and assert which way the call ran (``"recorded"``, ``"plan"`` for any
    executor, ``"plan:threads"``, ``"as-written"`` ...): a comparison of its output with
    eager then names the path it checked, and cannot land on another one unnoticed."""
    out = sm(*args, **kwargs)
    assert_path(sm, path)
    return out


def saving(module: Any, *args: Any, **kwargs: Any) -> tuple[Any, int]:
    """``module(*args, **kwargs)``, and how many tensors autograd saved for backward
    through this thread's saved-tensor hooks (a checkpointed region's own saves go to
    its innermost hooks; a CPU lane's would escape these)."""
    count = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*args, **kwargs)
    return out, count


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_sgd_steps_match_the_loop(
    sm: nn.Module,
    model: nn.Module,
    ref: nn.Module,
    inputs: list[torch.Tensor],
    set_to_none: bool,
    grads_equal: Any,
    clip_atol: float = 1e-5,
    **sgd: Any,
) -> None:
    """One SGD step per input on ``sm`` (wrapping ``model``) and on ``ref`` (the loop) in
    lockstep: ``zero_grad(set_to_none)``, backward of ``mean(out ** 2)``,
    ``clip_grad_norm_`` (the norms must agree), ``grads_equal(model, ref)``, step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05, **sgd)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, **sgd)
    for x in inputs:
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        sm(x).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        n_new = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        n_ref = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        assert_close(n_new, n_ref, atol=clip_atol)
        grads_equal(model, ref)
        opt.step()
        opt_ref.step()


def check_against_eager(
    model: nn.Module, inputs: tuple, calls: int = 2, backward: bool = True, atol: float = 1e-5, **config: Any
) -> ss.StreamScheduledModule:
    """Run ``model`` eagerly and wrapped (on a deep copy) and compare outputs and grads."""
    reference = copy.deepcopy(model)
    wrapped = ss.StreamScheduledModule(copy.deepcopy(model), **config)
    for call in range(calls):
        for p in list(reference.parameters()) + list(wrapped.parameters()):
            p.grad = None
        xs_ref = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
        xs_new = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
        expected = reference(*xs_ref)
        actual = wrapped(*xs_new)
        assert_close(actual, expected, atol=atol, rtol=atol, what=f"output (call {call})")
        if backward:
            loss_e = sum((t.float() ** 2).sum() for t in flatten(expected))
            loss_a = sum((t.float() ** 2).sum() for t in flatten(actual))
            loss_e.backward()
            loss_a.backward()
            g_e, g_a = grads(reference), grads(wrapped.module)
            assert g_e.keys() == g_a.keys(), f"gradient sets differ: {set(g_e) ^ set(g_a)}"
            for name in g_e:
                assert_close(g_a[name], g_e[name], atol=atol * 10, rtol=atol * 10, what=f"grad {name}")
            for x_ref, x_new in zip(xs_ref, xs_new):
                if x_ref.requires_grad:
                    assert_close(x_new.grad, x_ref.grad, atol=atol * 10, rtol=atol * 10, what="input grad")
    # Buffers (BatchNorm statistics) advance exactly as in eager.
    for (name, b_e), (_, b_a) in zip(reference.named_buffers(), wrapped.module.named_buffers()):
        assert_close(b_a, b_e, atol=atol * 10, rtol=atol * 10, what=f"buffer {name}")
    return wrapped


class Towers(nn.Module):
    """``n`` independent towers of different depths reading one input, summed, then a head."""

    def __init__(self, n: int = 3, d: int = 64):
        super().__init__()
        self.towers = nn.ModuleList(
            nn.Sequential(*[m for _ in range(i + 1) for m in (nn.Linear(d, d), nn.Tanh())]) for i in range(n)
        )
        self.head = nn.Linear(d, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = self.towers[0](x)
        for t in self.towers[1:]:
            total = total + t(x)
        return self.head(total)


class ConvTowers(nn.Module):
    """Inception-like block of heterogeneous conv towers, concatenated."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.a = nn.Sequential(nn.Conv2d(c, 16, 1), nn.BatchNorm2d(16), nn.ReLU())
        self.b = nn.Sequential(nn.Conv2d(c, 8, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16))
        self.c = nn.Sequential(nn.Conv2d(c, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.pool = nn.AvgPool2d(3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(x), self.b(x), self.c(x), self.pool(x)], dim=1)


class RandomDag(nn.Module):
    """A random DAG of Linear / activation / add / cat ops over ``[B, width]`` values.

    ``spec`` is a list of ``(kind, inputs, width)``; every value no op reads is an
    output (concatenated), so every op matters.
    """

    ACTS = {"relu": torch.relu, "tanh": torch.tanh, "gelu": nn.functional.gelu}

    def __init__(self, d_in: int, spec: list[tuple[str, tuple[int, ...], int]]):
        super().__init__()
        self.spec = spec
        widths = [d_in]
        self.layers = nn.ModuleDict()
        for i, (kind, inputs, width) in enumerate(spec):
            if kind == "linear":
                self.layers[str(i)] = nn.Linear(widths[inputs[0]], width)
                widths.append(width)
            elif kind == "cat":
                widths.append(sum(widths[j] for j in inputs))
            else:
                widths.append(widths[inputs[0]])
        used = {j for _, inputs, _ in spec for j in inputs}
        self.outputs = [i for i in range(len(widths)) if i not in used and i > 0] or [len(widths) - 1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values = [x]
        for i, (kind, inputs, _width) in enumerate(self.spec):
            if kind == "linear":
                values.append(self.layers[str(i)](values[inputs[0]]))
            elif kind in self.ACTS:
                values.append(self.ACTS[kind](values[inputs[0]]))
            elif kind == "add":
                values.append(values[inputs[0]] + values[inputs[1]])
            elif kind == "cat":
                values.append(torch.cat([values[j] for j in inputs], dim=1))
        return torch.cat([values[i] for i in self.outputs], dim=1)


def random_dag_spec(draw_int, n_ops: int, d_in: int) -> list[tuple[str, tuple[int, ...], int]]:
    """A valid spec from a source of integers (hypothesis's ``data.draw`` or random)."""
    widths = [d_in]
    spec = []
    kinds = ["linear", "linear", "linear", "relu", "tanh", "gelu", "add", "cat"]
    for _ in range(n_ops):
        kind = kinds[draw_int(0, len(kinds) - 1)]
        a = draw_int(0, len(widths) - 1)
        if kind == "add":
            same = [j for j in range(len(widths)) if widths[j] == widths[a] and j != a]
            if not same:
                kind = "relu"
            else:
                b = same[draw_int(0, len(same) - 1)]
                spec.append((kind, (a, b), widths[a]))
                widths.append(widths[a])
                continue
        if kind == "cat":
            b = draw_int(0, len(widths) - 1)
            spec.append((kind, (a, b), widths[a] + widths[b]))
            widths.append(widths[a] + widths[b])
            continue
        width = [8, 16, 32][draw_int(0, 2)] if kind == "linear" else widths[a]
        spec.append((kind, (a,), width))
        widths.append(width)
    return spec


def step_alongside(
    reference: nn.Module,
    sm: Any,
    model: nn.Module,
    x: torch.Tensor,
    optimizers: list,
    paths: tuple[str, ...],
    what: str,
    **kwargs: Any,
) -> str:
    """One training step of the eager ``reference`` and of ``sm`` (wrapping ``model``) on
    copies of ``x`` that require grad: the wrapper's path must be one of ``paths``; the
    outputs, the input's gradient and every parameter's gradient must equal eager's; then
    each optimizer steps and zeroes. Returns the path."""
    x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
    expected = reference(x_ref, **kwargs)
    actual = sm(x_new, **kwargs)
    path = assert_path(sm, *paths)
    what = f"{what} ({path})"
    assert_close(actual, expected, what=what)
    expected.square().sum().backward()
    actual.square().sum().backward()
    assert_close(x_new.grad, x_ref.grad, what=f"input grad, {what}")
    for (name, p_ref), (_, p_new) in zip(reference.named_parameters(), model.named_parameters()):
        assert_close(p_new.grad, p_ref.grad, what=f"grad {name}, {what}")
    for opt in optimizers:
        opt.step()
        opt.zero_grad()
    return path


def calls_alongside(
    sm: Any,
    model: nn.Module,
    reference: nn.Module,
    trains: list[bool],
    paths: tuple[str, ...],
    what: str,
    width: int,
    check: Any = None,
) -> None:
    """Calls of the eager ``reference`` and of ``sm`` (wrapping ``model``) on one fresh
    input ``[4, width]`` each, in training or eval mode as ``trains`` says (gradients on
    in training): each call's path must be one of ``paths`` and its outputs (a sequence)
    equal eager's; ``check(call, actual, expected)``, where given, asserts more of each
    call; in training, the squares of the outputs that need a gradient are summed and
    backpropagated, and every parameter's gradient must equal eager's."""
    for call, train in enumerate(trains):
        model.train(train)
        reference.train(train)
        x = torch.randn(4, width)
        for p in [*model.parameters(), *reference.parameters()]:
            p.grad = None
        with torch.set_grad_enabled(train):
            expected = reference(x)
            actual = sm(x)
        assert_path(sm, *paths)
        assert_close(actual, expected, what=f"{what}, call {call}")
        if check is not None:
            check(call, actual, expected)
        if train:
            sum((t * t).sum() for t in actual if t.requires_grad).backward()
            sum((t * t).sum() for t in expected if t.requires_grad).backward()
            got, want = grads(model), grads(reference)
            assert got.keys() == want.keys()
            for name in want:
                assert_close(got[name], want[name], what=f"{what}: grad {name}, call {call}")


def spin(seconds: float) -> None:
    """Busy-wait for ``seconds`` of this thread's CPU time (a sleep would hand the core to
    other processes, and on a busy machine the call after it waits for the core to come
    back: that would be timed as the next call's). CPU time, not wall time: the trial
    takes the time a loaded machine keeps the thread off the cores out of its figures,
    so a wall-clock spin, preempted, would look shorter than it was planted."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass
