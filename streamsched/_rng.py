"""The random generators' state around a call that may be run again as written.

A call stopped part way (a plan stopped by an output check, a recording call stopped by
what no trace can follow) runs the model as written afterwards: the random numbers its
partial run drew are put back first, so that the run as written draws eager's."""

from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["save_generators", "restore_generators"]


def save_generators(cuda_device: Optional[Any] = None) -> tuple:
    """The CPU generator's state, and ``cuda_device``'s where one is given."""
    cuda = torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None
    return torch.get_rng_state(), cuda_device, cuda


def restore_generators(saved: tuple) -> None:
    """Put back what :func:`save_generators` returned."""
    cpu, device, cuda = saved
    torch.set_rng_state(cpu)
    if device is not None:
        torch.cuda.set_rng_state(cuda, device)
