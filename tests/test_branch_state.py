"""State a ``@streamsched.branch`` body reads or writes is not the trace's: the body runs
on every call (one opaque task), so nothing it touches is baked into a plan, and what it
changes must not send the model back through tracing."""

from __future__ import annotations

import torch
from torch import nn

import streamsched as ss
from streamsched.testing import last_path

CALLS: list[int] = []


class Logged(nn.Module):
    seen: list[tuple[bool, bool]] = []

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    @ss.branch
    def note(self, h: torch.Tensor) -> torch.Tensor:
        Logged.seen.append((self.training, torch.is_grad_enabled()))
        CALLS.append(h.shape[0])
        return h * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.note(torch.cat([h(x) for h in self.heads], dim=1))


def test_a_branch_appending_to_class_and_global_lists_is_planned_once():
    torch.manual_seed(0)
    model = Logged().eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    paths = []
    with torch.no_grad():
        for _ in range(8):
            x = torch.randn(2, 8)
            before = len(CALLS)
            torch.testing.assert_close(sm(x), model(x))
            assert len(CALLS) == before + 2  # the branch ran in the wrapped call and in eager
            paths.append(last_path(sm))
    # Recorded once, then the plan: the lists the branch appends to are no trace's state.
    assert paths[0] == "recorded" and set(paths[1:]) == {"plan:serial"}, paths
