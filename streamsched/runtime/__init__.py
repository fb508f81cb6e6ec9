"""The runtime: compile a planned :class:`~streamsched.planning.schedule.Schedule` and run it.

- :mod:`.program`: the schedule compiled to Python (one generated function per task);
- :mod:`.executor`: the protocol every executor follows; :mod:`.pool`: the executors of
  one wrapped model;
- executors: :mod:`.serial` (reference), :mod:`.threads` (CPU lanes), :mod:`.streams`
  (CUDA streams, or their simulation), :mod:`.graphs` (the streams schedule captured in a
  CUDA graph); :mod:`.backends`: the stream operations they and eager dispatch issue;
- :mod:`.dispatch`: eager dispatch, for models that cannot be traced;
- :mod:`.synclog`, :mod:`.chaos`: the synchronisation log and its race checker, and
  random delays that shake out missing waits.
"""

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
