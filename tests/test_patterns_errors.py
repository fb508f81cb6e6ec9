"""Bad input on one call among good ones, on every way a call can run: the error has
eager's type and message, names the module that raised it, and the next call works."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close

D = 8


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Linear(D, D)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = Tower()
        self.right = Tower()

    def forward(self, x):
        return self.left(x) + self.right(x)


class Untraceable(Pair):
    def forward(self, x):
        if x.sum() > 1e9:  # a value check: fx cannot trace it (eager dispatch)
            return x
        return self.left(x) + self.right(x)


@pytest.mark.parametrize("make", [Pair, Untraceable], ids=["traced", "untraceable"])
@pytest.mark.parametrize("options", [{}, {"executor": "serial"}], ids=["default", "serial"])
def test_a_bad_fifth_call_names_the_module_and_the_sixth_works(make, options):
    model = make()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sm = ss.StreamScheduledModule(model, **options)
        for call in range(8):
            # A batch size of its own on the bad call: under auto, a size first seen
            # runs the model as written.
            x = torch.randn(5, D + 1) if call == 4 else torch.randn(4, D)
            if call != 4:
                assert_close(sm(x), model(x), what=f"call {call} ({last_path(sm)})")
                continue
            with pytest.raises(RuntimeError) as eager:
                model(x)
            with pytest.raises(type(eager.value)) as wrapped:
                sm(x)
            message = str(wrapped.value)
            assert str(eager.value).splitlines()[0] in message
            assert "raised in module 'left.a'" in message, f"{last_path(sm)}: {message}"
