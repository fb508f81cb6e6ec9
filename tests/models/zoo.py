"""The real models of the model suite: timm vision models, ensembles, and Hugging Face
transformers, each built with random weights from its configuration (nothing is
downloaded), with the small inputs it is run on. The builders, ensembles and inputs are
``benchmarks.zoo.real``'s, shared with ``benchmarks/real_models_bench.py``.

Shared by the tests (``tests/models/test_*.py``) and the report (``tests/models/report.py``).
Every dropout probability is 0 (timm's defaults, and set so in the transformers configs):
a fused dropout draws its masks differently from eager, so training steps could not be
compared otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from benchmarks.zoo.real import Inputs, MLPEnsemble, ResNetEnsemble, hf_model, images, timm_model, tokens, vectors


@dataclass(frozen=True)
class ModelSpec:
    name: str
    family: str
    """``timm``, ``ensemble`` or ``transformers``: the package the model needs."""
    build: Callable[[], nn.Module]
    inputs: Callable[[int], Inputs]
    """Fresh inputs ``(args, kwargs)`` from a seed (the same seed gives the same inputs)."""
    note: str = ""
    marks: tuple = field(default_factory=tuple)


# --- timm ---------------------------------------------------------------------------------


def _timm_spec(name: str, size: int = 64, batch: int = 2, note: str = "", marks: tuple = (), **kwargs: Any):
    return ModelSpec(name, "timm", timm_model(name, num_classes=10, **kwargs), images(batch, size), note, marks)


# --- transformers -------------------------------------------------------------------------

VOCAB = 128
_DECODER = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    attention_dropout=0.0,
    # The configs' default token ids point past a 128-token vocabulary.
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _hf_spec(name: str, config_name: str, model_name: str, inputs: Callable[[int], Inputs], note: str = "", **config):
    return ModelSpec(name, "transformers", hf_model(config_name, model_name, **config), inputs, note)


SPECS: list[ModelSpec] = [
    # Branchy CNNs.
    _timm_spec(
        "inception_v3",
        size=107,
        note="107 px: at 75 px (the smallest the stem allows) the last blocks are 1x1 and "
        "train-mode BatchNorm over 2 values makes float32 eager itself 100% off float64",
    ),
    _timm_spec(
        "nasnetalarge",
        note="NASNet-A cells at 8 channels (num_features=192, stem_size=16) instead of 168",
        num_features=192,
        stem_size=16,
    ),
    _timm_spec("inception_v4", size=107),
    _timm_spec(
        "pnasnet5large",
        note="full width (82M parameters: the model has no size argument); the slowest model here",
    ),
    _timm_spec("hrnet_w18_small"),
    _timm_spec("res2net50_14w_8s"),
    _timm_spec("dpn68"),
    _timm_spec("skresnet18"),
    _timm_spec("mixnet_s"),
    _timm_spec("repvgg_a0"),
    _timm_spec("cspresnet50"),
    _timm_spec("cspdarknet53"),
    _timm_spec("densenet121"),
    _timm_spec("resnext26ts"),
    _timm_spec("efficientnet_b0"),
    # Transformers for images.
    _timm_spec("vit_tiny_patch16_224", note="img_size=64", img_size=64),
    _timm_spec(
        "swin_tiny_patch4_window7_224",
        note="img_size=64, window_size=4, no stochastic depth",
        img_size=64,
        window_size=4,
        drop_path_rate=0.0,
    ),
    # Ensembles.
    ModelSpec("resnet18_x3", "ensemble", ResNetEnsemble, images(2, 64), "nn.ModuleList of 3 timm resnet18s"),
    ModelSpec("mlp_x8", "ensemble", MLPEnsemble, vectors(4, 24), "8 MLPs 24-64-64-4, mean and stack"),
    # Hugging Face transformers (tiny configs, random weights).
    _hf_spec(
        "bert",
        "BertConfig",
        "BertModel",
        tokens(2, 16, VOCAB, token_types=True),
        note="2 layers, hidden 32, 4 heads",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    ),
    _hf_spec(
        "llama",
        "LlamaConfig",
        "LlamaForCausalLM",
        tokens(2, 16, VOCAB, use_cache=False),
        note="2 layers, hidden 32, 4 heads, 2 kv heads",
        **_DECODER,
    ),
    _hf_spec(
        "mixtral",
        "MixtralConfig",
        "MixtralForCausalLM",
        tokens(2, 16, VOCAB, use_cache=False),
        note="2 layers, 4 experts, top-2",
        num_local_experts=4,
        num_experts_per_tok=2,
        **_DECODER,
    ),
    _hf_spec(
        "qwen2_moe",
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        tokens(2, 16, VOCAB, use_cache=False),
        note="2 layers, 4 experts, top-2, a shared expert",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        **_DECODER,
    ),
    _hf_spec(
        "gpt2",
        "GPT2Config",
        "GPT2LMHeadModel",
        tokens(2, 16, VOCAB, use_cache=False),
        note="2 layers, n_embd 32, 4 heads",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=1,
        eos_token_id=2,
    ),
]

BY_NAME = {s.name: s for s in SPECS}

# Models without BatchNorm: test_frozen_batchnorm is not collected for them (a check the
# model tier makes in test_training_state keeps the list true).
NO_BATCHNORM = {
    "vit_tiny_patch16_224",
    "swin_tiny_patch4_window7_224",
    "mlp_x8",
    "bert",
    "llama",
    "mixtral",
    "qwen2_moe",
    "gpt2",
}


def specs(*families: str) -> list[ModelSpec]:
    return [s for s in SPECS if s.family in families]


def _random_layers(model: nn.Module) -> list[str]:
    """Dropout-like layers that would draw random numbers in training mode."""
    found = []
    for name, m in model.named_modules():
        # A rate held as a plain float attribute (``attn_pdrop``), whatever the class.
        for attr, value in vars(m).items():
            if "drop" in attr and isinstance(value, float) and value > 0:
                found.append(f"{name} ({type(m).__name__}.{attr} = {value})")
        if "drop" not in type(m).__name__.lower():
            continue
        rate = next((getattr(m, a) for a in ("p", "drop_prob", "drop_rate") if hasattr(m, a)), None)
        if rate is None and any("drop" in type(c).__name__.lower() for c in m.children()):
            continue  # a block named for the dropout it holds (ConvDropoutLayerNorm): its child is checked
        if rate is None or (isinstance(rate, (int, float)) and rate > 0):
            found.append(f"{name} ({type(m).__name__}, rate {rate})")
    return found


def build(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The model with the same random weights every time."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = spec.build()
    random = _random_layers(model)
    if random:
        raise ValueError(f"{spec.name}: training mode would draw random numbers in {', '.join(random[:3])}")
    return model
