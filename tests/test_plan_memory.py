"""A plan drops each intermediate value after its last use, as eager does.

Cheap operations are coarsened into few tasks (a small serial plan is often one), and a
task used to hold every value it made until it ended: an inference call kept all its
intermediates alive to the end, several times eager's peak of live activations. The
generated functions now drop each value after the statement that reads it last
(``runtime.program._node_drops``); a task's own function drops the values it alone makes
and reads, so no other stream's use is cut short.

A probe module, a leaf of the trace, asks whether a value made earlier in the call is
still alive when it runs, after that value's last use.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

_MADE: list = []  # weak references to the values Stash made (no module attribute: no state written)


class Stash(nn.Module):
    """Returns ``2 * x`` and keeps a weak reference to it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        _MADE.append(weakref.ref(y))
        return y


class Probe(nn.Module):
    """Records whether the latest value Stash made is still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.alive: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.alive.append(_MADE[-1]() is not None)
        return x + 1


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.side = nn.Linear(8, 8)
        self.stash, self.probe = Stash(), Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.l2(self.stash(self.l1(x)))  # the stashed value's last use (no local holds it)
        s = self.side(x)
        return self.l3(self.probe(b)) + s


@pytest.mark.parametrize(
    "options",
    [{"executor": "serial"}, {"executor": "serial", "sync_log": True}, {"executor": "threads"}],
    ids=["serial-call", "serial-tasks", "threads"],
)
def test_a_value_is_dropped_after_its_last_use(options):
    torch.manual_seed(0)
    model = Model().eval()
    sm = ss.StreamScheduledModule(model, leaf_modules=(Stash, Probe), **options)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(4, 8)
            model.probe.alive.clear()
            expected = model(x)
            assert model.probe.alive == [False]  # eager: gone after its last use
            model.probe.alive.clear()
            assert_close(sm(x), expected)
    assert_path(sm, "plan")
    assert model.probe.alive == [False], f"{options}: the plan kept a dead intermediate alive"
