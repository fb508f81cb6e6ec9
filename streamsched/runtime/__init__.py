"""Executors: ``serial`` (reference), ``threads`` (CPU lanes), ``streams`` (CUDA streams)."""

from .serial import SerialExecutor
from .streams import CudaBackend, SimulatedBackend, StreamExecutor
from .synclog import Race, SyncLog, check_happens_before
from .threads import ThreadExecutor

__all__ = [
    "SerialExecutor",
    "StreamExecutor",
    "CudaBackend",
    "SimulatedBackend",
    "ThreadExecutor",
    "SyncLog",
    "Race",
    "check_happens_before",
]
