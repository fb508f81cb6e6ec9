"""Global torch settings a traced forward asks for (``frontend.state_queries``): the
default dtype, deterministic algorithms, the thread count, and grad and inference mode.
Each is answered once while tracing, and the trace bakes the answer in; a caller that
changes the setting between calls gets eager's branch from then on, on the plan path."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

from .helpers import assert_close

D = 6


class Towers(nn.Module):
    """Three towers summed (a plan with branches), scaled by what ``ask`` returns."""

    def __init__(self, ask):
        super().__init__()
        self.towers = nn.ModuleList(nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D)) for _ in range(3))
        self.ask = ask

    def forward(self, x):
        y = sum(t(x) for t in self.towers)
        return y * self.ask()


@contextlib.contextmanager
def default_dtype(on):
    torch.set_default_dtype(torch.float64 if on else torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(torch.float32)


@contextlib.contextmanager
def deterministic(on):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


@contextlib.contextmanager
def threads(on):
    before = torch.get_num_threads()
    torch.set_num_threads(before + 1 if on else before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _no_grad(on):
    return torch.no_grad() if on else contextlib.nullcontext()


def _inference(on):
    return torch.inference_mode() if on else contextlib.nullcontext()


# (what the forward asks, how the caller changes it)
CASES = {
    "default_dtype": (lambda: 2.0 if torch.get_default_dtype() == torch.float64 else 1.0, default_dtype),
    "deterministic": (lambda: 3.0 if torch.are_deterministic_algorithms_enabled() else 1.0, deterministic),
    "num_threads": (lambda: float(torch.get_num_threads()), threads),
    "grad_mode": (lambda: 3.0 if torch.is_grad_enabled() else 1.0, _no_grad),
    "inference_mode": (lambda: 5.0 if torch.is_inference_mode_enabled() else 1.0, _inference),
}


@pytest.mark.parametrize("executor", ["serial", "auto"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_setting_changed_between_calls_is_seen(case, executor):
    ask, setting = CASES[case]
    torch.manual_seed(0)
    model = Towers(ask).eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call in range(10):
        x = torch.randn(4, D)
        with setting(call >= 5):
            expected = reference(x)
            actual = sm(x)
        paths.append(last_path(sm))
        assert_close(actual, expected, what=f"call {call} ({paths[-1]})")
    # Plans ran before the change and, where the executor was asked for, after it (under
    # ``auto`` the trial may settle on the model as written).
    assert any(p.startswith("plan:") for p in paths[:5]), paths
    if executor == "serial":
        assert any(p.startswith("plan:") for p in paths[5:]), paths


def test_a_setting_the_forward_does_not_ask_for_keeps_the_plan():
    """Only what the traced code asked for is guarded: changing the default dtype or the
    thread count leaves the plan of a forward that asks for neither in place."""
    torch.manual_seed(0)
    model = Towers(lambda: 1.0).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    x = torch.randn(4, D)
    sm(x)
    sm(x)
    assert last_path(sm) == "plan:serial"
    with threads(True):
        sm(x)
    assert last_path(sm) == "plan:serial"
    with deterministic(True):
        sm(x)
    assert last_path(sm) == "plan:serial"


def test_the_stand_ins_are_gone_after_the_trace():
    torch.manual_seed(0)
    get_default_dtype = torch.get_default_dtype
    sm = ss.StreamScheduledModule(Towers(lambda: 2.0 if torch.get_default_dtype() == torch.float64 else 1.0))
    sm(torch.randn(4, D))
    assert torch.get_default_dtype is get_default_dtype
