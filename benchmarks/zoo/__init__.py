"""Branchy reference models used by the examples, the tests and the benchmarks.

Defined here (no torchvision needed) so that every environment runs the same networks:

- :class:`ParallelFCN`: N small MLPs, each on its own slice of one input, outputs
  concatenated (the public "1000 MLPs in a loop" report), with hand-written peers
  :class:`GroupedConvFCN` and :class:`StackedFCN`.
- :class:`CriticEnsemble`: N critics reading the same observation, outputs stacked, with
  the hand-written stacked peers :class:`StackedCritics` (trainable) and
  :class:`HandStackedCritics` (inference, weights stored ``[n, in, out]``).
- :class:`MultiTaskHeads`: a shared trunk and heads of different widths.
- :class:`Inception3`: the Inception-v3 architecture.
- :class:`NASNetCells` and :class:`RandWire`: cell-based and random-DAG networks.

:mod:`benchmarks.zoo.real` (not imported here) builds real torchvision, timm and Hugging
Face models with random weights, for the real-model tests and benchmark.
"""

from .ensemble import CriticEnsemble, HandStackedCritics, MultiTaskHeads, StackedCritics
from .inception import Inception3
from .parallel_fcn import GroupedConvFCN, ParallelFCN, StackedFCN
from .random_dag import NASNetCells, RandWire

__all__ = [
    "ParallelFCN",
    "GroupedConvFCN",
    "StackedFCN",
    "CriticEnsemble",
    "StackedCritics",
    "HandStackedCritics",
    "MultiTaskHeads",
    "Inception3",
    "NASNetCells",
    "RandWire",
]
