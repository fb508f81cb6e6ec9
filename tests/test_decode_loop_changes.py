"""A decoding loop (the input one row longer every call, three prompts, so lengths come
back) in inference, with the model changed between two calls of the second prompt: a
hook registered on the model or on a child, a forward pre-hook, a child swapped, an
instance ``forward`` set, the weights scaled in place. By then the loop's calls take the
settled shortcut (new sizes, sizes of a settled bucket) and the plans made for the
lengths that came back: every call after the change must see it. Each call is compared
with an eager copy of the model changed the same way, and the paths the calls ran are
asserted (the shortcut and, under the explicit executors, the plans, before and after
the change). Then calls whose batch size is drawn at random every call, and grad mode
switched every call."""

from __future__ import annotations

import copy
import random
from typing import Any, Callable

import pytest
import torch
from torch import nn

import streamsched as ss
from benchmarks.dynamic_bench import TwoBranches
from streamsched.testing import last_path

from .helpers import assert_close

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

EXECUTORS = ["auto", "serial", "threads"]


class Branchy(nn.Module):
    """Four alike MLPs (one fused group) and a heterogeneous branch."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.mlps = nn.ModuleList(nn.Sequential(nn.Linear(d, 32), nn.ReLU(), nn.Linear(32, 8)) for _ in range(4))
        self.a = nn.Sequential(nn.Linear(d, 24), nn.Tanh(), nn.Linear(24, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.mlps] + [self.a(x)]).sum(0)


def _top_hook(m: nn.Module) -> None:
    m.register_forward_hook(lambda mod, inp, out: out * 3)


def _top_pre_hook(m: nn.Module) -> None:
    m.register_forward_pre_hook(lambda mod, inp: (inp[0] * 2,))


def _child_hook(m: nn.Module) -> None:
    m.a[2].register_forward_hook(lambda mod, inp, out: out + 1)


def _swap(m: nn.Module) -> None:
    torch.manual_seed(5)
    m.a[2] = nn.Linear(m.a[2].in_features, 8)


def _instance_forward(m: nn.Module) -> None:
    forward = type(m).forward
    m.forward = lambda x: forward(m, x) * 2


def _scale_weights(m: nn.Module) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(1.5)


CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "top_hook": _top_hook,
    "top_pre_hook": _top_pre_hook,
    "child_hook": _child_hook,
    "swap": _swap,
    "instance_forward": _instance_forward,
    "scale_weights": _scale_weights,
}

# Three prompts of 12 lengths each (1 to 12 rows: fewer than the plans kept, 16). The
# change lands mid-first-prompt (where, under auto, every call so far and the next one
# took the shortcut for a new size) or mid-second-prompt (lengths that came back: plans).
PROMPT = 12
LENGTHS = [n for _ in range(3) for n in range(1, PROMPT + 1)]
CHANGES_AT = {"first_prompt": PROMPT // 2, "second_prompt": PROMPT + PROMPT // 2}


def _loop(
    make: Callable[[], nn.Module], executor: str, change: Callable[[nn.Module], None], change_at: int
) -> tuple[list[str], list[str]]:
    """Run the loop on a wrapper and on an eager copy, changing both before call
    ``change_at``;
    every call compared. The paths before and after the change."""
    torch.manual_seed(0)
    model = make().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    with torch.no_grad():
        for call, n in enumerate(LENGTHS):
            if call == change_at:
                change(model)
                change(reference)
            x = torch.randn(n, 16)
            actual = sm(x)
            paths.append(last_path(sm))
            assert_close(actual, reference(x), what=f"call {call} ({n} rows), {paths[-1]}")
    return paths[:change_at], paths[change_at:]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("where", sorted(CHANGES_AT))
@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("make", [TwoBranches, Branchy], ids=lambda m: m.__name__)
def test_a_change_mid_loop_is_seen_by_the_next_call(make, change, where, executor):
    before, after = _loop(make, executor, CHANGES[change], CHANGES_AT[where])
    if executor == "auto":
        # New lengths run as written by the shortcut from the first prompt on: a change
        # in the first prompt lands where the shortcut, and no full path, ran every call.
        assert before[:PROMPT] == ["as-written"] * min(PROMPT, len(before)), before
    else:
        # Each new length is recorded, the lengths that come back run their plans.
        assert before[:PROMPT] == ["recorded"] * min(PROMPT, len(before)), before
        assert all(p.startswith("plan:") for p in before[PROMPT:]), before
    # Whatever path the calls after the change ran (the plans are re-checked, some
    # changes run the model as written from then on), each was compared above; the
    # lengths of the third prompt, all met before the change, ran some path the wrapper
    # reports.
    assert all(after), after
    if change in ("scale_weights", "child_hook", "swap") and executor != "auto":
        # Nothing here makes the model unplannable: the plans (made again where the
        # change re-wired the model) run in the third prompt.
        assert any(p.startswith("plan:") for p in after[-PROMPT:]), after


def _random_batches(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 64) for _ in range(count)]


@pytest.mark.parametrize("executor", EXECUTORS)
def test_a_batch_size_drawn_at_random_every_call(executor):
    """A batch size new or met at random, every call (the last batch of every epoch, a
    server's batches): each call equals eager's, under the shortcut, the plans and the
    calls run as written alike."""
    torch.manual_seed(0)
    model = Branchy().eval()
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths = []
    with torch.no_grad():
        for call, n in enumerate(_random_batches(1, 160)):
            x = torch.randn(n, 16)
            actual = sm(x)
            paths.append(last_path(sm))
            assert_close(actual, model(x), what=f"call {call} ({n} rows), {paths[-1]}")
    if executor == "auto":
        assert "as-written" in paths and any(p.startswith("plan:") for p in paths), paths
    else:
        assert "recorded" in paths and any(p.startswith("plan:") for p in paths), paths


@pytest.mark.parametrize("executor", EXECUTORS)
def test_grad_mode_switched_every_call_with_new_sizes(executor):
    """``no_grad`` and ``enable_grad`` alternating while the batch grows: each call equals
    eager's, its output needs a gradient exactly when eager's does, and the gradients of
    the calls with gradients equal eager's."""
    torch.manual_seed(0)
    model = Branchy().eval()
    reference = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor=executor)
    paths: list[Any] = []
    for call, n in enumerate(LENGTHS):
        x = torch.randn(n, 16)
        grad = call % 2 == 0
        with torch.set_grad_enabled(grad):
            actual, expected = sm(x), reference(x)
        paths.append((grad, last_path(sm)))
        assert actual.requires_grad is expected.requires_grad is grad
        assert_close(actual, expected, what=f"call {call}, {paths[-1]}")
        if grad:
            actual.square().sum().backward()
            expected.square().sum().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert_close(p.grad, q.grad, what=f"grad {name}, call {call}")
                p.grad = q.grad = None
    # A call with gradients at a new size is planned at once (recorded); sizes that come
    # back run their plans (or as written, where a trial decided so).
    assert any(grad and p == "recorded" for grad, p in paths), paths
    assert any(p.startswith("plan:") for _, p in paths), paths
