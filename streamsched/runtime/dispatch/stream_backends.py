"""The stream backends branches are launched onto (:mod:`streamsched.runtime.backends`).

One :class:`~streamsched.runtime.backends.CudaBackend` per CUDA device, shared by every
eager-dispatch call of the process (so ``shared=True``: calls in several threads may
fork from it at once), and one :class:`~streamsched.runtime.backends.SimulatedBackend`
for ``executor="streams"`` on CPU, whose thread without a current stream is the CPU lane
it runs (the caller: lane 0).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..backends import CudaBackend, SimulatedBackend, StreamBackend
from .lane_pool import _LANES

_SIMULATED = SimulatedBackend(default_stream=_LANES.current_lane)
_CUDA_STREAMS: dict[torch.device, CudaBackend] = {}
_CUDA_LOCK = threading.Lock()


def _cuda_streams(device: torch.device) -> CudaBackend:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _CUDA_LOCK:
        backend = _CUDA_STREAMS.get(device)
        if backend is None:
            backend = _CUDA_STREAMS[device] = CudaBackend(device, shared=True)
    return backend


def _record_stream(backend: StreamBackend, tensor: torch.Tensor, stream: Any) -> None:
    # Memory on other devices is not allocated through this device's streams. (The
    # simulation is left out before a tensor property is read: in the forward's thread
    # each read goes through the write guard.)
    if backend.is_cuda and tensor.is_cuda and tensor.device == backend.device:
        backend.record_stream(tensor, stream)
