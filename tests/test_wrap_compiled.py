"""``StreamScheduledModule(torch.compile(model))``: refused, saying what to do.

The compiled module's ``forward`` is dynamo's code (an instance attribute), which fx
cannot trace; run as one call it would leave nothing to schedule, and its state_dict
keys carry ``_orig_mod.``. The two ways that work are in the message (and in
``tests/test_compile.py``)."""

from __future__ import annotations

import pytest
import torch

import streamsched as ss
from streamsched.errors import ConfigError

from .helpers import Towers


def test_wrapping_a_compiled_module_is_refused_with_the_ways_that_work():
    model = Towers()
    compiled = torch.compile(model)  # lazy: nothing compiles until a call
    with pytest.raises(ConfigError) as info:
        ss.StreamScheduledModule(compiled)
    text = str(info.value)
    assert "Towers in an OptimizedModule" in text
    assert "torch.compile(StreamScheduledModule(model))" in text
    assert "torch.compile(tower)" in text


def test_the_module_it_compiled_can_be_wrapped():
    model = Towers()
    compiled = torch.compile(model)
    sm = ss.StreamScheduledModule(compiled._orig_mod, executor="serial")
    x = torch.randn(3, 64)
    sm(x)
    torch.testing.assert_close(sm(x), model(x), rtol=0, atol=0)
    ss.testing.assert_path(sm, "plan:serial")
