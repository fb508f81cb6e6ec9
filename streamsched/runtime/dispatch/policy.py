"""How one call runs its branches: inline, on CPU lanes or on (CUDA or simulated) streams.

:func:`_choose_mode` decides from the configuration and the device; under
``executor="auto"`` on CPU it asks the call structure's
:class:`~streamsched.planning.choice.LaneHistory` (the rule lives there; the call is
timed in :mod:`.dispatch`).
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple, Optional

import torch

from ...config import SchedulerConfig
from ...planning.choice import LaneHistory
from .dispatch_context import DispatchContext
from .lane_pool import _LANES


def _bound(config: SchedulerConfig, device_type: str) -> int:
    """Streams (the caller's included) one call may use, as ``num_streams`` counts them."""
    if config.num_streams != "auto":
        return int(config.num_streams)
    if device_type == "cuda":
        return 8
    return max(1, min(8, (os.cpu_count() or 1) + 1))


class _Mode(NamedTuple):
    """How one call runs its branches."""

    cpu: str  # CPU branches: "lanes", "streams" (simulated) or "inline"
    why: str  # the second half of the plan's reason
    bound: int  # streams the call may use, the caller's included
    history: Optional[LaneHistory] = None  # where executor="auto" records this call's timing


def _lane_history(context: DispatchContext, key: Any) -> LaneHistory:
    history = context.lane_histories.get_fresh(key)
    if history is None:
        history = LaneHistory()
        context.lane_histories.put(key, history)
    return history


def _choose_mode(context: DispatchContext, spec_key: Any, device: torch.device) -> _Mode:
    config = context.config
    cuda_bound = _bound(config, "cuda")
    if _LANES.current_lane() != 0:
        return _Mode("inline", "called from inside a launched branch: its own branches run inline there", 1)
    if config.executor == "serial":
        return _Mode("inline", "branches run inline (executor='serial')", 1)
    if device.type == "cuda":
        return _Mode(
            "streams",
            f"branches issued onto up to {cuda_bound - 1} pool CUDA stream{'s' if cuda_bound != 2 else ''}",
            cuda_bound,
        )
    if config.executor == "streams":
        why = (
            "executor='streams' on CPU: streams are simulated, each branch runs at once in the calling thread while "
            "every synchronisation is still decided and logged"
        )
        return _Mode("streams", why, cuda_bound)
    bound = _bound(config, "cpu")
    lanes = bound - 1
    if lanes < 1:
        return _Mode("inline", "num_streams=1: branches run inline", 1)
    if config.executor == "threads":
        return _Mode(
            "lanes", f"branches launched on {lanes} CPU lane{'s' if lanes != 1 else ''} (executor='threads')", bound
        )
    history = _lane_history(context, spec_key)
    mode, why = history.decide(lanes)
    return _Mode(mode, why, bound, history)
