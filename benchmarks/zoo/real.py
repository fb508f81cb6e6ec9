"""Real models: torchvision, timm and Hugging Face transformers models built with random
weights from their configurations (nothing is downloaded), two ensembles of them, and
the inputs they are called with.

Used by the real-model test suite (``tests/models/zoo.py``: tiny sizes) and the
real-model benchmark (``benchmarks/real_models_bench.py``: larger ones); each keeps its
own list of models and sizes, built with these. torchvision, timm and transformers are
imported when a model is built, so importing this module needs torch alone (they are
installed in ``.venv-cuda``: ``make test-models``).
"""

from __future__ import annotations

import os
from typing import Any, Callable

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

__all__ = [
    "Inputs",
    "timm_model",
    "torchvision_model",
    "hf_model",
    "ResNetEnsemble",
    "MLPEnsemble",
    "images",
    "vectors",
    "tokens",
]

Inputs = tuple[tuple, dict]
"""A call's ``(args, kwargs)``."""


# --- models -------------------------------------------------------------------------------


def timm_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A builder of timm's ``name`` with random weights (``kwargs`` go to ``create_model``)."""

    def build() -> nn.Module:
        import timm  # optional: the real-model environment has it

        return timm.create_model(name, pretrained=False, **kwargs)

    return build


def torchvision_model(name: str, **kwargs: Any) -> Callable[[], nn.Module]:
    """A builder of ``torchvision.models.<name>`` with random weights."""

    def build() -> nn.Module:
        import torchvision  # optional: the real-model environment has it

        return getattr(torchvision.models, name)(weights=None, **kwargs)

    return build


def hf_model(config_name: str, model_name: str, **config: Any) -> Callable[[], nn.Module]:
    """A builder of ``transformers.<model_name>(transformers.<config_name>(**config))``."""

    def build() -> nn.Module:
        import transformers  # optional: the real-model environment has it

        return getattr(transformers, model_name)(getattr(transformers, config_name)(**config))

    return build


class ResNetEnsemble(nn.Module):
    """``n`` resnet18s (timm's, or torchvision's with ``source="torchvision"``) reading one
    image; their logits stacked ``[n, B, num_classes]``."""

    def __init__(self, n: int = 3, num_classes: int = 10, source: str = "timm"):
        super().__init__()
        if source == "timm":
            make = timm_model("resnet18", num_classes=num_classes)
        elif source == "torchvision":
            make = torchvision_model("resnet18", num_classes=num_classes)
        else:
            raise ValueError(f"ResNetEnsemble: source is timm or torchvision, got {source!r}")
        self.members = nn.ModuleList(make() for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([m(x) for m in self.members])


class MLPEnsemble(nn.Module):
    """``n`` MLPs ``d_in-hidden-hidden-d_out`` (ReLU, then ``activation``) reading one input,
    like the critics of an RL agent. Returns ``(mean, stacked)`` outputs, or the stacked
    outputs ``[n, B, d_out]`` alone with ``mean=False``."""

    def __init__(
        self,
        n: int = 8,
        d_in: int = 24,
        hidden: int = 64,
        d_out: int = 4,
        activation: Callable[[], nn.Module] = nn.Tanh,
        mean: bool = True,
    ):
        super().__init__()
        self.mean = mean
        self.members = nn.ModuleList(
            nn.Sequential(
                nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, hidden), activation(), nn.Linear(hidden, d_out)
            )
            for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> Any:
        outs = torch.stack([m(x) for m in self.members])
        return (outs.mean(0), outs) if self.mean else outs


# --- inputs: (args, kwargs) from a seed (the same seed gives the same inputs) ----------------


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def images(batch: int, size: int) -> Callable[[int], Inputs]:
    """Standard normal images ``[batch, 3, size, size]``."""

    def make(seed: int) -> Inputs:
        return (torch.randn(batch, 3, size, size, generator=_generator(seed)),), {}

    return make


def vectors(batch: int, d: int) -> Callable[[int], Inputs]:
    """Standard normal vectors ``[batch, d]``."""

    def make(seed: int) -> Inputs:
        return (torch.randn(batch, d, generator=_generator(seed)),), {}

    return make


def tokens(
    batch: int, length: int, vocab: int, padded: bool = True, token_types: bool = False, use_cache: bool = True
) -> Callable[[int], Inputs]:
    """Keyword inputs of a transformers model: ``input_ids`` and an ``attention_mask``
    (with ``padded``, the last 3 positions of the second row are padding), and
    ``token_type_ids`` and ``use_cache=False`` when asked for."""

    def make(seed: int) -> Inputs:
        g = _generator(seed)
        ids = torch.randint(0, vocab, (batch, length), generator=g)
        mask = torch.ones(batch, length, dtype=torch.long)
        if padded:
            mask[1, length - 3 :] = 0
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
        if token_types:
            kwargs["token_type_ids"] = torch.randint(0, 2, (batch, length), generator=g)
        if not use_cache:
            kwargs["use_cache"] = False
        return (), kwargs

    return make
