"""A forward gets its arguments split as the caller split them (positional or by name),
on every path: the trace, the schedule, eager dispatch and the model as written. A
decorated ``forward(*args, **kwargs)`` (``functools.wraps`` shows the inner signature)
may treat the two differently, as transformers' checkpointing layer does: it checkpoints
only what comes positionally."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close


def _positional_doubled(forward):
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *(a * 2 for a in args), **kwargs)

    return wrapper


class Decorated(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.heads = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 4)) for _ in range(4))

    @_positional_doubled
    def forward(self, x: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
        if shift is not None:
            x = x + shift
        return torch.cat([h(x) for h in self.heads], dim=1)


@pytest.mark.parametrize("executor", ["auto", "serial", "threads"])
@pytest.mark.parametrize("call", ["positional", "keyword", "mixed"])
def test_a_decorated_forward_gets_the_callers_split(executor, call):
    torch.manual_seed(0)
    model = Decorated().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = set()
    for _ in range(8):
        x, shift = torch.randn(5, 16), torch.randn(5, 16)
        if call == "positional":
            args, kwargs = (x, shift), {}
        elif call == "keyword":
            args, kwargs = (), {"x": x, "shift": shift}
        else:
            args, kwargs = (x,), {"shift": shift}
        assert_close(sm(*args, **kwargs), model(*args, **kwargs))
        paths.add(last_path(sm))
    assert any(p.startswith("plan:") for p in paths), paths
