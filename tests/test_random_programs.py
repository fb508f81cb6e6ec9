"""Random small models made of in-place, aliasing and state-writing statements, called
as eager and wrapped with the same inputs in random modes.

Each model runs three linear layers around a few statements drawn from ``STATEMENTS``:
in-place writes to its input and to intermediates, views and transposes, a value used
twice, item assignment, a buffer and a Python counter written in the forward, a tensor
stored on the module and read on the next call, a parameter written in place under
``no_grad``, ``.data`` writes; it returns a tensor, a tuple, a list or a dict, some of
whose entries are views of others or of the input. Every call of the wrapper must equal
eager's: the outputs (values, types, which alias the input), the input after the call,
the counter, the buffer, the stored tensor, the parameters, whether it raised, and, in
grad mode, every gradient (parameters and input). A call (or a backward) that raises in
eager raises in the wrapper too, and the next calls still agree.

The calls are drawn so that sizes repeat (batch 2 or 3): under ``executor="serial"``
most calls after a signature's first run its plan, and the test asserts that plans did
run (a check that lands on the model as written proves nothing about the schedule).
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from typing import Any

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close, flatten

D = 8

STATEMENTS = (
    "x.add_(1)",
    "y = x.relu_()",
    "y = y.mul_(2)",
    "self.count += 1",
    "self.buf.add_(y.detach().mean())",
    "y = y.view(-1, D)[:, :D]",
    "y = y.t().t()",
    "z = y; y = y + z",
    "y[:, 0] = 0",
    "y = torch.cat([y, y], 1)[:, :D]",
    "with torch.no_grad(): self.lin_a.weight.mul_(0.999)",
    "y = y.clone().sigmoid_()",
    "self.last = y.detach()",
    "y = y + self.last if self.last is not None and self.last.shape == y.shape else y",
    "y = torch.where(y > 0, y, y * 0.1)",
    "y = y.contiguous()",
    "y.data.mul_(1.0)",
    "y = y.expand(2, *y.shape)[0]",
)

RETURNS = (
    "return self.lin_b(y) + self.lin_c(y)",
    "return (self.lin_b(y), self.lin_c(x))",
    "return y, self.lin_b(y)",
    "return self.lin_b(y), x",
    "return [self.lin_b(y), self.lin_c(y)]",
    "return {'a': self.lin_b(y), 'b': y}",
)


class Program(nn.Module):
    """Three linear layers, a buffer, a counter and a stored tensor; ``forward`` is
    replaced per instance's class (see :func:`make_program`)."""

    def __init__(self):
        super().__init__()
        self.lin_a = nn.Linear(D, D)
        self.lin_b = nn.Linear(D, D)
        self.lin_c = nn.Linear(D, D)
        self.register_buffer("buf", torch.zeros(()))
        self.count = 0
        self.last: Any = None


def make_program(rng: random.Random) -> tuple[nn.Module, str]:
    """A :class:`Program` subclass whose forward is 2-5 random statements; the model and
    its forward's source."""
    lines = ["def forward(self, x):", "    y = self.lin_a(x)"]
    lines += ["    " + rng.choice(STATEMENTS) for _ in range(rng.randint(2, 5))]
    lines.append("    " + rng.choice(RETURNS))
    source = "\n".join(lines)
    namespace: dict[str, Any] = {"torch": torch, "D": D}
    exec(compile(source, "<random program>", "exec"), namespace)
    cls = type("RandomProgram", (Program,), {"forward": namespace["forward"]})
    return cls(), source


def call(model: nn.Module, x: torch.Tensor, grad: bool) -> tuple[Any, Any]:
    """``(output, None)`` or ``(None, the exception)``."""
    try:
        with torch.set_grad_enabled(grad):
            return model(x), None
    except Exception as exc:  # noqa: BLE001 - compared with eager's
        return None, exc


def backward(outputs: Any) -> Any:
    """None, or the exception ``backward`` raised."""
    try:
        sum(t.float().pow(2).sum() for t in outputs).backward()
    except RuntimeError as exc:
        return exc
    return None


def check_program(seed: int, executor: str, calls: int = 10) -> Counter:
    """Run one random program eager and wrapped; assert every call agrees. Returns the
    wrapper's paths."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model, source = make_program(rng)
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths: Counter = Counter()
    for i in range(calls):
        where = f"seed {seed}, call {i}, executor {executor}:\n{source}\n"
        training = rng.random() < 0.5
        grad = rng.random() < 0.6
        eager.train(training)
        sm.train(training)
        x = torch.randn(rng.choice([2, 3]), D)
        leaf = grad and rng.random() < 0.5
        x_eager, x_wrapped = x.clone().requires_grad_(leaf), x.clone().requires_grad_(leaf)
        # A leaf that requires grad cannot be written in place: the models take a copy.
        in_eager = x_eager.clone() if leaf else x_eager
        in_wrapped = x_wrapped.clone() if leaf else x_wrapped
        out_eager, err_eager = call(eager, in_eager, grad)
        out_wrapped, err_wrapped = call(sm, in_wrapped, grad)
        paths[last_path(sm)] += 1
        assert (err_eager is None) == (err_wrapped is None), f"{where}eager: {err_eager!r}, wrapper: {err_wrapped!r}"
        if err_eager is not None:
            continue
        got, want = flatten(out_wrapped), flatten(out_eager)
        assert type(out_wrapped) is type(out_eager) and len(got) == len(want), where
        for a, b in zip(got, want):
            assert_close(a, b, what=f"{where}an output ({last_path(sm)})")
            assert (a.data_ptr() == in_wrapped.data_ptr()) == (b.data_ptr() == in_eager.data_ptr()), (
                f"{where}an output aliases the input in one of the two"
            )
            assert a.requires_grad == b.requires_grad, f"{where}requires_grad of an output differs"
        assert_close(in_wrapped, in_eager, what=f"{where}the input after the call")
        state = sm.module
        assert state.count == eager.count, f"{where}the counter differs"
        assert_close(state.buf, eager.buf, what=f"{where}the buffer")
        assert (state.last is None) == (eager.last is None), where
        if state.last is not None:
            assert_close(state.last, eager.last, what=f"{where}the stored tensor")
        for (name, p), q in zip(eager.named_parameters(), state.parameters()):
            assert_close(q, p, what=f"{where}parameter {name}")
        if not grad:
            continue
        roots = [(a, b) for a, b in zip(got, want) if b.requires_grad]
        if not roots:
            continue
        eager.zero_grad()
        state.zero_grad()
        err_eager = backward(b for _, b in roots)
        err_wrapped = backward(a for a, _ in roots)
        # (eager's backward may refuse a value its forward wrote after autograd saved it)
        assert (err_eager is None) == (err_wrapped is None), f"{where}backward: eager {err_eager!r}, {err_wrapped!r}"
        if err_eager is not None:
            continue
        for (name, p), q in zip(eager.named_parameters(), state.parameters()):
            assert (p.grad is None) == (q.grad is None), f"{where}{name}.grad is None in one of the two"
            if p.grad is not None:
                assert_close(q.grad, p.grad, what=f"{where}{name}.grad")
        if leaf:
            assert_close(x_wrapped.grad, x_eager.grad, what=f"{where}the input's gradient")
    return paths


@pytest.mark.parametrize("executor", ["auto", "serial"])
def test_random_programs_equal_eager(executor):
    paths: Counter = Counter()
    for seed in range(40):
        paths.update(check_program(seed, executor))
    # The schedule was exercised: plans ran, and recording calls.
    assert paths["recorded"] >= 20, paths
    if executor == "serial":
        assert paths["plan:serial"] >= 40, paths
    else:
        assert sum(n for p, n in paths.items() if p.startswith("plan")) >= 5, paths
