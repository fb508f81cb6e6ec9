"""The lane pool eager dispatch launches branches on (see :mod:`streamsched.runtime.lanes`)."""

from __future__ import annotations

from ..lanes import LanePool

_LANES = LanePool("streamsched-eager")
