"""Probe (GPU run only): where the stream sanitizer's report on the timeline test comes from."""
from __future__ import annotations

import pytest
import torch

import streamsched as ss
from streamsched.observe import timeline

from .helpers import ConvTowers


def _show(sm):
    for t in sm.plan.tasks:
        print("task", t.id, getattr(t, "name", "?"), "stream", t.stream, "waits", getattr(t, "waits", "?"))


@pytest.mark.cuda
@pytest.mark.parametrize("observe", ["plain", "timeline", "synced"])
def test_probe(observe, tmp_path):
    model = ConvTowers().cuda().eval()
    sm = ss.StreamScheduledModule(model, executor="streams", num_streams=4, min_task_cost=0.0)
    x = torch.randn(8, 8, 64, 64, device="cuda")
    with torch.no_grad():
        for i in range(3):
            sm(x)
        _show(sm)
        print("runtime", ss.runtime_info().get("runtime"))
        if observe == "timeline":
            timeline(sm, x, runs=3, path=tmp_path / "t")
        else:
            for i in range(4):
                if observe == "synced":
                    torch.cuda.synchronize()
                sm(x)
    print("PROBE", observe, "passed")
