"""Real models whose alike members ``frontend.member_replay`` replays (timm's ``Mlp`` in
every block of a ViT, an MLP-Mixer, a ResMLP, a Swin): traced with replay on and off,
every node and the tracer's state must be the same (``tests/test_member_replay.py``),
and the wrapped model's calls must equal eager's."""

from __future__ import annotations

import pytest
import torch

import streamsched as ss
from streamsched.frontend import member_replay
from streamsched.testing import assert_path

from ..helpers import assert_close
from ..test_member_replay import _state, _trace

CASES = {
    "vit_tiny_patch16_224": 11,
    "mixer_s16_224": 15,
    "resmlp_12_224": 11,
    "swin_tiny_patch4_window7_224": 11,
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_replayed_members_trace_as_without_replay(name, monkeypatch):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=10).eval()
    x = torch.randn(1, 3, 224, 224)

    normal, normal_tracer = _trace(model, (x,), False, monkeypatch)
    replayed, tracer = _trace(model, (x,), True, monkeypatch)
    assert _state(replayed, tracer) == _state(normal, normal_tracer)
    assert tracer.members.replayed == CASES[name]


def test_a_replayed_vit_runs_as_eager(monkeypatch):
    timm = pytest.importorskip("timm")
    monkeypatch.setattr(member_replay, "ENABLED", True)
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=10, img_size=64).eval()
    sm = ss.StreamScheduledModule(model, executor="serial")
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 64, 64)
            assert_close(sm(x), model(x), atol=1e-4, rtol=1e-4)
    assert_path(sm, "plan:serial")
