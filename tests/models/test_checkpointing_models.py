"""Real models trained with activation checkpointing on, as their libraries switch it on
(timm's ``set_grad_checkpointing``, transformers' ``gradient_checkpointing_enable`` in
both of its modes): outputs, every gradient and the tensors autograd keeps outside the
checkpointed regions equal eager's (a region traced through would keep its activations,
and a wrapper inside a region must recompute what its forward saved)."""

from __future__ import annotations

import copy

import pytest
import torch

import streamsched as ss
from streamsched.testing import last_path

from ..helpers import saving

VOCAB = 96


def _logits(out):
    return out if torch.is_tensor(out) else out.logits


def _check(model: torch.nn.Module, make_input, steps: int = 4) -> list[str]:
    model.train()
    ref = copy.deepcopy(model)
    sm = ss.StreamScheduledModule(model)
    paths = []
    for step in range(steps):
        x = make_input(step)
        (out, kept), (expected, kept_ref) = saving(sm, x), saving(ref, x)
        paths.append(last_path(sm))
        torch.testing.assert_close(_logits(out), _logits(expected), atol=1e-5, rtol=1e-4)
        assert kept <= kept_ref, f"step {step}: {kept} tensors kept for backward, eager keeps {kept_ref}"
        _logits(out).float().square().mean().backward()
        _logits(expected).float().square().mean().backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(
                    p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
                )
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
    assert any(p.startswith("plan:") for p in paths), paths
    return paths


@pytest.mark.parametrize("name", ["resnet18", "vit_tiny_patch16_224"])
def test_timm_grad_checkpointing(name):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    kwargs = {"img_size": 64} if name.startswith("vit") else {}
    model = timm.create_model(name, num_classes=10, **kwargs)
    model.set_grad_checkpointing(True)
    _check(model, lambda step: torch.randn(2, 3, 64, 64))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_transformers_gradient_checkpointing(family, reentrant):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
        model = transformers.LlamaForCausalLM(cfg)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    _check(model, lambda step: torch.randint(0, VOCAB, (2, 8 + step % 2)))
