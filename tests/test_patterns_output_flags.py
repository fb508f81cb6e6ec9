"""A flag that decides only the output's container: the same tensors returned as a dict or
a tuple, under other keys, as a named tuple or a plain one. transformers models do this
with ``config.return_dict`` (``to_tuple()`` of the ``ModelOutput`` where it is False):
set after the first calls, eager returns a tuple. The traced graph returns the output's
leaves, which are the same either way, so the program text alone does not show the
change; every call must return eager's container, whatever path it runs."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close, grads

D = 8

Pair = collections.namedtuple("Pair", ["left", "right"])


class Settings:
    """A plain object a module holds, as a transformers model holds its config."""

    def __init__(self):
        self.return_dict = True


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Linear(D, D)
        self.settings = Settings()
        self.as_dict = True
        self.key = "left"
        self.named = True

    def heads(self, x):
        return self.left(x), torch.relu(self.right(x))


class ModuleFlag(TwoHeads):
    """A plain attribute of the module picks a dict or a tuple."""

    def forward(self, x):
        a, b = self.heads(x)
        return {"left": a, "right": b} if self.as_dict else (a, b)

    def change(self):
        self.as_dict = False


class HeldObjectFlag(TwoHeads):
    """An attribute of an object the module holds picks it (``config.return_dict``)."""

    def forward(self, x):
        a, b = self.heads(x)
        out = {"left": a, "right": b}
        return out if self.settings.return_dict else tuple(out.values())

    def change(self):
        self.settings.return_dict = False


class KeyFlag(TwoHeads):
    """A string attribute names the dict's first key."""

    def forward(self, x):
        a, b = self.heads(x)
        return {self.key: a, "right": b}

    def change(self):
        self.key = "first"


class NamedTupleFlag(TwoHeads):
    """A flag picks a named tuple or a plain one."""

    def forward(self, x):
        a, b = self.heads(x)
        return Pair(a, b) if self.named else (a, b)

    def change(self):
        self.named = False


def _same_container(actual, expected) -> None:
    assert type(actual) is type(expected), f"{type(actual).__name__}, eager {type(expected).__name__}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected), f"keys {list(actual)}, eager {list(expected)}"
    else:
        assert len(actual) == len(expected)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("executor", ["serial", "threads"])
@pytest.mark.parametrize("make", [ModuleFlag, HeldObjectFlag, KeyFlag, NamedTupleFlag], ids=lambda c: c.__name__)
def test_a_flag_that_changes_only_the_output_container_is_seen(make, executor, grad):
    torch.manual_seed(0)
    model, ref = make(), make()
    ref.load_state_dict(model.state_dict())
    sm = ss.StreamScheduledModule(model, executor=executor)
    for call in range(6):
        if call == 3:
            model.change()
            ref.change()
        x = torch.randn(4, D)
        for p in [*model.parameters(), *ref.parameters()]:
            p.grad = None
        with torch.set_grad_enabled(grad):
            expected = ref(x)
            actual = sm(x)
        # The first call records, and so does the first after the change (the trace
        # made for the new container); every other call runs the plan.
        assert_path(sm, "recorded" if call in (0, 3) else "plan")
        _same_container(actual, expected)
        values = list(actual.values()) if isinstance(actual, dict) else list(actual)
        wanted = list(expected.values()) if isinstance(expected, dict) else list(expected)
        assert_close(values, wanted, what=f"call {call}")
        if grad:
            sum((v * v).sum() for v in values).backward()
            sum((v * v).sum() for v in wanted).backward()
            got, want = grads(model), grads(ref)
            for name in want:
                assert_close(got[name], want[name], what=f"grad {name}, call {call}")
