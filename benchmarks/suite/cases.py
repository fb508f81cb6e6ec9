"""The benchmark cases: which model, which sizes, which inputs, on which device.

A *family* is what ``--models`` selects (``parallel_fcn``, ``inception3`` ...); each
family expands into one or more cases (sizes, batch sizes, inference or training).
``--quick`` uses tiny sizes of the same architectures, for tests. On CPU the image
models get a smaller input side than on CUDA so that one run stays in minutes.

Example::

    >>> cases = suite_cases("cpu", quick=True, families=["critic_ensemble"])
    >>> [c.id for c in cases]
    ['critic_ensemble/n4/b3', 'critic_ensemble/n4/b3/train']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch import nn

from benchmarks.zoo import CriticEnsemble, Inception3, MultiTaskHeads, NASNetCells, ParallelFCN, RandWire

__all__ = ["CaseSpec", "FAMILIES", "suite_cases", "parse_families"]

CaseKind = Literal["inference", "train"]


@dataclass(frozen=True)
class CaseSpec:
    """One model at one size on one input shape."""

    id: str
    """Stable identifier, ``family/size/batch`` (keys the JSON and the tables)."""
    family: str
    label: str
    """Human-readable name for the tables."""
    build: Callable[[], nn.Module]
    input_shapes: tuple[tuple[int, ...], ...]
    kind: CaseKind = "inference"
    small: bool = False
    """Whether ``torch.compile`` is included by default (its compile time stays in tens
    of seconds); larger models need ``--compile``."""
    params: dict[str, Any] = field(default_factory=dict)

    def make_inputs(self, device: torch.device, generator: Optional[torch.Generator] = None) -> tuple:
        """Fresh standard-normal inputs of the case's shapes on ``device``."""
        return tuple(torch.randn(*shape, generator=generator).to(device) for shape in self.input_shapes)


def _parallel_fcn(quick: bool, device: str) -> list[CaseSpec]:
    sizes = [8] if quick else [100, 400, 1000]
    batches = [2] if quick else [1, 64]
    cases = []
    for n in sizes:
        for b in batches:
            cases.append(
                CaseSpec(
                    id=f"parallel_fcn/n{n}/b{b}",
                    family="parallel_fcn",
                    label=f"ParallelFCN({n}), batch {b}",
                    build=lambda n=n: ParallelFCN(n),
                    input_shapes=((b, 20 * n),),
                    small=n <= 100,
                    params={"n": n, "batch": b},
                )
            )
    # Training step of the reference case: forward, backward and an SGD step.
    n, b = (8, 4) if quick else (1000, 64)
    cases.append(
        CaseSpec(
            id=f"parallel_fcn/n{n}/b{b}/train",
            family="parallel_fcn",
            label=f"ParallelFCN({n}), batch {b}, training step",
            build=lambda n=n: ParallelFCN(n),
            input_shapes=((b, 20 * n),),
            kind="train",
            params={"n": n, "batch": b},
        )
    )
    return cases


def _critic_ensemble(quick: bool, device: str) -> list[CaseSpec]:
    n, b = (4, 3) if quick else (32, 16)
    return [
        CaseSpec(
            id=f"critic_ensemble/n{n}/b{b}",
            family="critic_ensemble",
            label=f"CriticEnsemble({n}), batch {b}",
            build=lambda: CriticEnsemble(n),
            input_shapes=((b, 23),),
            small=True,
            params={"n": n, "batch": b},
        ),
        # Training step of the ensemble (forward, backward and an SGD step).
        CaseSpec(
            id=f"critic_ensemble/n{n}/b{b}/train",
            family="critic_ensemble",
            label=f"CriticEnsemble({n}), batch {b}, training step",
            build=lambda: CriticEnsemble(n),
            input_shapes=((b, 23),),
            kind="train",
            params={"n": n, "batch": b},
        ),
    ]


def _multitask_heads(quick: bool, device: str) -> list[CaseSpec]:
    b = 4 if quick else 64
    return [
        CaseSpec(
            id=f"multitask_heads/b{b}",
            family="multitask_heads",
            label=f"MultiTaskHeads, batch {b}",
            build=MultiTaskHeads,
            input_shapes=((b, 64),),
            small=True,
            params={"batch": b},
        )
    ]


def _inception3(quick: bool, device: str) -> list[CaseSpec]:
    side = 75 if quick else (299 if device == "cuda" else 149)
    batches = [1] if quick else [1, 8]
    return [
        CaseSpec(
            id=f"inception3/b{b}/s{side}",
            family="inception3",
            label=f"Inception3, batch {b}, {side}x{side}",
            build=Inception3,
            input_shapes=((b, 3, side, side),),
            small=False,
            params={"batch": b, "side": side},
        )
        for b in batches
    ]


def _nasnet_cells(quick: bool, device: str) -> list[CaseSpec]:
    side = 32 if quick else (224 if device == "cuda" else 112)
    channels, cells = (8, 2) if quick else (44, 4)
    return [
        CaseSpec(
            id=f"nasnet_cells/b1/s{side}",
            family="nasnet_cells",
            label=f"NASNetCells({cells} cells, {channels} ch), batch 1, {side}x{side}",
            build=lambda: NASNetCells(channels=channels, cells=cells),
            input_shapes=((1, 3, side, side),),
            small=True,
            params={"batch": 1, "side": side, "channels": channels, "cells": cells},
        )
    ]


def _randwire(quick: bool, device: str) -> list[CaseSpec]:
    side = 32 if quick else (224 if device == "cuda" else 112)
    channels, stages, nodes = (8, 1, 6) if quick else (78, 2, 16)
    return [
        CaseSpec(
            id=f"randwire/b1/s{side}",
            family="randwire",
            label=f"RandWire({stages}x{nodes} nodes, seed 0), batch 1, {side}x{side}",
            build=lambda: RandWire(channels=channels, stages=stages, nodes=nodes, seed=0),
            input_shapes=((1, 3, side, side),),
            small=True,
            params={"batch": 1, "side": side, "channels": channels, "stages": stages, "nodes": nodes, "seed": 0},
        )
    ]


FAMILIES: dict[str, Callable[[bool, str], list[CaseSpec]]] = {
    "parallel_fcn": _parallel_fcn,
    "critic_ensemble": _critic_ensemble,
    "multitask_heads": _multitask_heads,
    "inception3": _inception3,
    "nasnet_cells": _nasnet_cells,
    "randwire": _randwire,
}

# Class names are accepted too (``--models ParallelFCN,Inception3``).
_ALIASES = {
    "parallelfcn": "parallel_fcn",
    "criticensemble": "critic_ensemble",
    "multitaskheads": "multitask_heads",
    "inception": "inception3",
    "nasnetcells": "nasnet_cells",
    "nasnet": "nasnet_cells",
}


def parse_families(text: Optional[str]) -> list[str]:
    """``"parallel_fcn,Inception3"`` -> family names, in suite order; ``None`` = all.

    An unknown name is a ``ValueError`` that lists the known ones.
    """
    if text is None:
        return list(FAMILIES)
    wanted = []
    for raw in text.split(","):
        name = raw.strip()
        if not name:
            continue
        key = name.lower()
        key = _ALIASES.get(key.replace("_", ""), key)
        if key not in FAMILIES:
            raise ValueError(f"benchmarks.suite: unknown model {name!r}; known models: {', '.join(FAMILIES)}")
        wanted.append(key)
    if not wanted:
        raise ValueError(f"benchmarks.suite: --models names no model; known models: {', '.join(FAMILIES)}")
    return [f for f in FAMILIES if f in wanted]


def suite_cases(device: str, quick: bool, families: Sequence[str]) -> list[CaseSpec]:
    """Every case of the given families for ``device`` (``"cpu"`` or ``"cuda"``)."""
    out: list[CaseSpec] = []
    for family in families:
        out.extend(FAMILIES[family](quick, device))
    return out
