"""Arguments that change from call to call, compared with eager PyTorch on fresh inputs:
objects holding tensors (a dataclass batch) under every executor."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from .helpers import assert_close

D = 8


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    y: torch.Tensor


class ReadsABatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Linear(D, D)
        self.right = nn.Linear(D, D)

    def forward(self, batch: Batch):
        return self.left(batch.x) * self.right(batch.y)


@pytest.mark.parametrize(
    "options",
    [{}, {"executor": "serial"}, {"executor": "threads", "min_task_cost": 0.0}, {"sync_log": True}],
    ids=["default", "serial", "threads", "sync_log"],
)
def test_an_object_holding_tensors_runs_as_written_under_every_executor(options):
    # A trace would bake the first call's object in, and with it that call's tensors
    # (graph constants): every later call would compute on them.
    model = ReadsABatch()
    sm = ss.StreamScheduledModule(model, **options)
    for _ in range(4):
        batch = Batch(torch.randn(3, D), torch.randn(3, D))
        assert_close(sm(batch), model(batch), what=f"{options}")
        assert_path(sm, "as-written")


# --- a wrapped function that changes the list it is given ---------------------------


def adapt_window(window: list, size: list) -> list:
    """Shrinks ``window`` to ``size`` where it is larger, in place (torchvision's
    ``_get_window_and_shift_size`` of Swin3D does this to lists the caller made)."""
    for i in range(2):
        if size[i] <= window[i]:
            window[i] = size[i]
    return window


torch.fx.wrap("adapt_window")


class AdaptsItsWindow(nn.Module):
    def __init__(self):
        super().__init__()
        self.window = [4, 4]
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        window = adapt_window(list(self.window), [x.shape[1], x.shape[2]])
        opts = {"scale": 1.0}
        scaled = scale_by(self.lin(x), opts)
        return scaled * window[0] + window[1]


def scale_by(x: torch.Tensor, opts: dict) -> torch.Tensor:
    opts["scale"] = opts["scale"] * 2.0  # changes the dict it is given (the change is its own)
    return x * opts["scale"]


torch.fx.wrap("scale_by")


@pytest.mark.parametrize("executor", ["serial", "threads", "auto"])
def test_a_wrapped_function_may_change_the_list_and_dict_it_is_given(executor):
    """A call node's list and dict arguments are new objects on every call, as the
    forward's own code makes them: the function may change them, and the change stays
    in that call (the recording call passed fx's immutable containers, and crashed)."""
    model = AdaptsItsWindow()
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    for call, shape in enumerate([(2, 3, 5, D)] * 4 + [(2, 6, 2, D)] * 4 + [(2, 3, 5, D)] * 2):
        x = torch.randn(*shape)
        out = sm(x)
        paths.append(assert_path(sm, "recorded", "plan", "as-written"))
        assert_close(out, model(x), what=f"call {call} {shape} ({paths[-1]})")
    assert model.window == [4, 4]
    if executor != "auto":
        assert paths[1].startswith("plan") and paths[-1].startswith("plan"), paths


class AppendsToItsArguments(nn.Module):
    """Branches over ``x``; the forward appends to a list it is given (a cache of past
    outputs), stores into a dict it is given, and reads both back."""

    def __init__(self):
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.other = nn.Sequential(nn.Linear(D, 2 * D), nn.Tanh(), nn.Linear(2 * D, D))

    def forward(self, x, past: list, seen: dict):
        y = torch.stack([h(x) for h in self.heads] + [self.other(x)]).sum(0)
        past.append(y.detach())
        seen["last"] = y.detach()
        return y + torch.stack(past).sum(0)


@pytest.mark.parametrize("options", [{}, {"executor": "serial"}, {"executor": "threads"}], ids=str)
def test_containers_the_forward_appends_to_are_the_callers(options):
    # The traced forward is handed containers rebuilt from the call's leaves: an append
    # there happened once, while tracing, into a list the caller never sees, and every
    # later call of the same structure (an empty list, again) computed on no history.
    model = AppendsToItsArguments()
    sm = ss.StreamScheduledModule(model, **options)
    past_e, past_w, seen_e, seen_w = [], [], {}, {}
    for i in range(24):
        if i % 6 == 0:
            past_e, past_w, seen_e, seen_w = [], [], {}, {}
        x = torch.randn(3, D)
        expected = model(x, past_e, seen_e)
        assert_close(sm(x, past_w, seen_w), expected, what=f"call {i}")
        assert len(past_w) == len(past_e), f"call {i}: the caller's list holds {len(past_w)} items, eager {len(past_e)}"
        assert_close(past_w, past_e, what=f"call {i}: the caller's list")
        assert_close(seen_w["last"], seen_e["last"], what=f"call {i}: the caller's dict")
        # No schedule keeps running in a trace that appended once.
        assert_path(sm, "as-written", "eager-dispatch")
