"""Stream backends for branches launched onto streams: CUDA streams, and their simulation on CPU.

Both backends take the same decisions (fork, record, wait, ``record_stream``, join); the
simulated one runs each branch at once in the calling thread, so that the CUDA logic is
exercised and logged on CPU.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from ..chaos import Chaos
from .lanes import _LANES


class _CudaStreams:
    """A pool of CUDA streams on one device, shared by every eager-dispatch call."""

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: list[torch.cuda.Stream] = []
        self._lane_of: dict[int, int] = {}

    def stream(self, lane: int) -> torch.cuda.Stream:
        while len(self._pool) < lane:
            s = torch.cuda.Stream(device=self.device)
            self._pool.append(s)
            self._lane_of[s.cuda_stream] = len(self._pool)
        return self._pool[lane - 1]

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def key(self, stream: torch.cuda.Stream) -> int:
        return stream.cuda_stream

    def lane_of(self, stream: torch.cuda.Stream) -> int:
        # The caller's stream, or any stream the user made current, is stream 0 of the log.
        return self._lane_of.get(stream.cuda_stream, 0)

    def fork(self, side: torch.cuda.Stream, caller: torch.cuda.Stream) -> None:
        side.wait_stream(caller)

    def use(self, stream: torch.cuda.Stream) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        # Memory on other devices is not allocated through this device's streams.
        if tensor.is_cuda and tensor.device == self.device:
            tensor.record_stream(stream)

    def join(self, caller: torch.cuda.Stream, side: torch.cuda.Stream) -> None:
        caller.wait_stream(side)

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.gpu_delay(lane)


class _SimulatedStreams:
    """Streams as lane numbers: work runs at once in the calling thread while every
    decision is still taken and logged, so the CUDA logic is exercised on CPU."""

    is_cuda = False

    def __init__(self) -> None:
        self._local = threading.local()

    def stream(self, lane: int) -> int:
        return lane

    def current(self) -> int:
        current = getattr(self._local, "stream", None)
        return _LANES.current_lane() if current is None else current

    def key(self, stream: int) -> int:
        return stream

    def lane_of(self, stream: int) -> int:
        return stream

    def fork(self, side: int, caller: int) -> None:
        pass

    @contextlib.contextmanager
    def use(self, stream: int) -> Iterator[None]:
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield
        finally:
            self._local.stream = previous

    def record(self, stream: int) -> None:
        return None

    def wait(self, stream: int, event: Any) -> None:
        pass

    def record_stream(self, tensor: torch.Tensor, stream: int) -> None:
        pass

    def join(self, caller: int, side: int) -> None:
        pass

    def chaos(self, chaos: Chaos, lane: int) -> None:
        chaos.delay(lane)


_SIMULATED = _SimulatedStreams()
_CUDA_STREAMS: dict[torch.device, _CudaStreams] = {}
_CUDA_LOCK = threading.Lock()


def _cuda_streams(device: torch.device) -> _CudaStreams:
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _CUDA_LOCK:
        backend = _CUDA_STREAMS.get(device)
        if backend is None:
            backend = _CUDA_STREAMS[device] = _CudaStreams(device)
    return backend
