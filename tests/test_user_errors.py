"""The user's own errors stay theirs, and warnings point at the user's line.

An exception that the model raises when called directly (eager) too is the model's own:
a wrapped call raises it unchanged, with no advice about tracing. The tracing advice
(``UntraceableWarning``) comes once, on the first call that works, and every warning the
wrapper gives names the line of the user's code that made the call, not a line of
streamsched or PyTorch (whose call path has any number of frames in between).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.errors import user_stacklevel

from .helpers import assert_close


class Picky(nn.Module):
    """Untraceable (data-dependent branch) and raising ValueError for batches over 2,
    as eager does; two branches it schedules under eager dispatch."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] > 2:
            raise ValueError("batch too large for this model")
        return self.a(x) + self.b(x)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


def _eager_error(model: nn.Module, x: torch.Tensor) -> BaseException:
    with pytest.raises(Exception) as info:
        model(x)
    return info.value


def test_an_error_eager_raises_too_comes_without_tracing_advice():
    model = Picky()
    sm = ss.StreamScheduledModule(model)
    big = torch.randn(3, 4)
    expected = _eager_error(model, big)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError) as info:
            sm(big)
    assert type(info.value) is type(expected) and str(info.value) == str(expected)
    assert not [w for w in caught if issubclass(w.category, ss.UntraceableWarning)], [str(w.message) for w in caught]
    assert "branch" not in str(info.value)

    # The first call that works says, once, that the model runs as written, at the
    # caller's line (this file), not a library line.
    x = torch.randn(2, 4)
    with pytest.warns(ss.UntraceableWarning) as record:
        out = sm(x)  # the line the warning must name
    line = _line_of("out = sm(x)  # the line the warning must name")
    assert len(record) == 1
    assert (record[0].filename, record[0].lineno) == (__file__, line)
    assert_close(out, model(x))
    assert sm.plan.mode == "eager-dispatch"  # the call ran under eager dispatch, not a plan
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        y = torch.randn(1, 4)
        assert_close(sm(y), model(y))
        with pytest.raises(ValueError, match="batch too large"):
            sm(big)


def test_strict_trace_error_from_the_models_own_raise_says_so():
    class Mode(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x, mode: str = "a"):
            if mode != "a":
                raise ValueError(f"unknown mode {mode!r}")
            return self.a(x)

    sm = ss.StreamScheduledModule(Mode(), strict=True)
    with pytest.raises(ss.TraceError) as info:
        sm(torch.randn(2, 4), mode="c")
    message = str(info.value)
    assert "unknown mode 'c'" in message and "raised by the model's own code" in message
    # A refusal by fx (control flow on a traced value) is not the model's own raise.
    with pytest.raises(ss.TraceError) as info:
        ss.StreamScheduledModule(Picky(), strict=True)(torch.randn(2, 4))
    assert "raised by the model's own code" not in str(info.value)


def test_hooks_warning_names_the_callers_line():
    model = Hooked()
    model.register_forward_hook(lambda m, i, o: None)
    sm = ss.StreamScheduledModule(model)
    x = torch.randn(2, 4)
    with pytest.warns(ss.HooksWarning) as record:
        out = sm(x)  # hooked call
    assert (record[0].filename, record[0].lineno) == (__file__, _line_of("out = sm(x)  # hooked call"))
    assert_close(out, model(x))


def test_user_stacklevel_skips_library_frames_only():
    def warn_here():
        warnings.warn("from a user function", UserWarning, stacklevel=user_stacklevel())

    with pytest.warns(UserWarning) as record:
        warn_here()
    # Called from user code, the warning names the function that warned (no library frame).
    assert record[0].lineno == _line_of('warnings.warn("from a user function"')


def _line_of(text: str) -> int:
    with open(__file__) as f:
        lines = [i for i, line in enumerate(f, 1) if text in line and "_line_of(" not in line]
    assert len(lines) == 1, (text, lines)
    return lines[0]


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, *, scale: float):
        return self.a(x) * scale


def test_a_misspelt_keyword_is_named_as_eager_names_it_and_the_next_call_works():
    """``sm(x, scal=2.0)``: eager says "unexpected keyword argument 'scal'"; the binder
    reported only the missing ``scale``, which reads as if the keyword had not been given."""
    from .helpers import called_on

    model = Scaled()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(2, 4)
    with pytest.raises(TypeError) as info:
        sm(x, scal=2.0)
    message = str(info.value)
    assert message.startswith("Scaled.forward(): "), message
    assert "unexpected keyword argument 'scal' (did you mean 'scale'?)" in message, message
    with pytest.raises(TypeError, match="unexpected keyword argument 'scal'"):
        model(x, scal=2.0)  # eager's wording
    for path in ("recorded", "plan:serial"):
        x = torch.randn(2, 4)
        assert_close(called_on(sm, path, x, scale=2.0), model(x, scale=2.0))
