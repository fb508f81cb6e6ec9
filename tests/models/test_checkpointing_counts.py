"""Real models trained with activation checkpointing turned on the way their libraries
turn it on: timm's ``set_grad_checkpointing()`` (the blocks handed to ``checkpoint_seq``)
and transformers' ``activation_checkpointing_enable()`` on DETR (each encoder and decoder
layer checkpoints its own forward; their children run as nested plans). Every training
step is compared with eager (outputs and every gradient), and the checkpointed layers
must run as often as eager runs them: once more in backward, where a trace that went
through the checkpoint would run them once (``tests/test_checkpointing_patterns.py``
holds small models of both patterns; ``test_checkpointing_models.py`` the tensors kept
for backward)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import streamsched as ss
from streamsched.testing import assert_path

from ..helpers import assert_close


def _timm() -> tuple[nn.Module, torch.Tensor]:
    timm = pytest.importorskip("timm")
    model = timm.create_model("mobilenetv3_small_100", pretrained=False, num_classes=10)
    model.set_grad_checkpointing(True)
    return model, torch.randn(2, 3, 64, 64)


def _detr() -> tuple[nn.Module, torch.Tensor]:
    """Its encoder and decoder layers checkpoint; the layers run as written (opaque),
    their attention and feed-forward children get plans of their own (nested plans),
    which must not run inside the checkpointed region."""
    transformers = pytest.importorskip("transformers")
    backbone = dict(model_type="resnet", embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])
    backbone["out_features"] = ["stage4"]
    config = transformers.DetrConfig(
        use_timm_backbone=False,
        use_pretrained_backbone=False,
        backbone=None,
        backbone_config=backbone,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        num_queries=10,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )
    model = transformers.DetrModel(config)
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, torch.randn(2, 3, 64, 64)


def _main_output(out):
    if isinstance(out, torch.Tensor):
        return out
    return out.logits if "logits" in out else out.last_hidden_state


def _calls(model: nn.Module) -> dict:
    calls = {"n": 0}

    def hook(module, args, out):
        calls["n"] += 1

    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Conv2d)):
            m.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("make", [_timm, _detr], ids=["timm-checkpoint_seq", "detr-nested"])
def test_checkpointed_training_recomputes_as_eager(make):
    torch.manual_seed(0)
    model, example = make()
    model.train()
    eager = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model, executor="serial")
    # Forward hooks make a module run through its own __call__ (a leaf of every trace):
    # DETR is checked without them, as its nested plans run unhooked.
    counting = make is not _detr
    counted_eager, counted = (_calls(eager), _calls(model)) if counting else ({"n": 0}, {"n": 0})
    paths = []
    for step in range(4):
        x = torch.randn_like(example)
        for m in (eager, model):
            for p in m.parameters():
                p.grad = None
        counted_eager["n"] = counted["n"] = 0
        expected = eager(x)
        out = sm(x)
        paths.append(assert_path(sm, "recorded", "plan"))
        expected, out = _main_output(expected), _main_output(out)
        assert_close(out, expected, what=f"step {step} ({paths[-1]})")
        expected.square().mean().backward()
        out.square().mean().backward()
        for (name, p), q in zip(eager.named_parameters(), model.parameters()):
            if p.grad is None:
                assert q.grad is None, f"step {step}: {name}.grad set in the wrapper only"
                continue
            assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, what=f"step {step} ({paths[-1]}): {name}.grad")
        assert counted["n"] == counted_eager["n"], (
            f"step {step} ({paths[-1]}): the layers ran {counted['n']} times, eager {counted_eager['n']}"
        )
    assert paths[-1] == "plan:serial", paths
