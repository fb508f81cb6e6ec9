"""How one call runs its branches: inline, on CPU lanes or on (CUDA or simulated) streams.

:func:`_choose_mode` decides from the configuration and the device; under
``executor="auto"`` on CPU, :class:`_AutoHistory` times calls inline and on lanes and
keeps the faster.
"""

from __future__ import annotations

import collections
import os
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import torch

from .lanes import _LANES

if TYPE_CHECKING:
    from .launch import _Launch


# A branch must save about this much (estimated microseconds, CPU) before lanes are used
# under executor="auto"; a thread hand-off costs some tens of microseconds per branch.
_MIN_SAVING_US = 1000.0
_HANDOFF_US = 40.0
# Calls of one call structure timed in each way of running CPU branches before "auto" decides,
# and how often (in calls) it re-times the way it does not use.
_MEASURED_CALLS = 3
_RETIME_EVERY = 64


def _bound(config: Any, device_type: str) -> int:
    """Streams (the caller's included) one call may use, as ``num_streams`` counts them."""
    if config.num_streams != "auto":
        return int(config.num_streams)
    if device_type == "cuda":
        return 8
    return max(1, min(8, (os.cpu_count() or 1) + 1))


_AUTO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module state -> call structure -> _AutoHistory


class _Mode(NamedTuple):
    """How one call runs its branches."""

    cpu: str  # CPU branches: "lanes", "streams" (simulated) or "inline"
    why: str  # the second half of the plan's reason
    bound: int  # streams the call may use, the caller's included
    history: Optional[_AutoHistory] = None  # where executor="auto" records this call's timing


class _AutoHistory:
    """Recent timings of one call structure, for ``executor="auto"`` on CPU.

    Whether CPU lanes pay cannot be told in advance: PyTorch may already spread each
    kernel over every core, and a hand-off costs tens of microseconds. So "auto" measures:
    the first calls run their branches inline and time them (uncontended); if running them
    side by side could save a millisecond, the next calls try lanes; from then on the mode
    whose fastest recent call was faster is used (lanes must win by 10%). The first calls
    of each path through a forward pay for warm-up, so now and then one call re-times the
    mode not in use: a decision taken on cold timings does not stick.
    """

    def __init__(self) -> None:
        self.wall_us: dict[str, collections.deque] = {m: collections.deque(maxlen=4) for m in ("inline", "lanes")}
        self.branch_us: collections.deque = collections.deque(maxlen=4)  # (count, total) of inline calls
        self.settled_calls = 0

    def record(self, mode: str, wall_us: float, launches: list[_Launch]) -> None:
        if not launches:
            return  # nothing ran aside: the mode made no difference
        self.wall_us[mode].append(wall_us)
        if mode == "inline":
            self.branch_us.append((len(launches), sum(launch.cost_us for launch in launches)))

    def decide(self, lanes: int) -> tuple[str, str]:
        """``("inline" | "lanes", why)`` for the next call."""
        inline, launched = self.wall_us["inline"], self.wall_us["lanes"]
        if len(inline) < _MEASURED_CALLS:
            return "inline", "the first calls with this call structure run their branches inline, timed"
        # The cheapest recent call: early calls pay for warm-up, and any call for noise.
        count, total_us = min(self.branch_us, key=lambda b: b[1])
        parallel_us = total_us / max(1, min(lanes, count)) + _HANDOFF_US * count
        if total_us - parallel_us <= _MIN_SAVING_US:
            return "inline", (
                f"CPU lanes would not pay: {count} branch(es) take {total_us:.0f} us in all "
                f"(estimated {parallel_us:.0f} us on {lanes} lane(s), with hand-offs)"
            )
        if len(launched) < _MEASURED_CALLS:
            return "lanes", (
                f"trying {lanes} CPU lane(s): {count} branch(es) take {total_us:.0f} us in all inline "
                f"(estimated {parallel_us:.0f} us side by side)"
            )
        best_inline, best_lanes = min(inline), min(launched)
        timings = f"{best_lanes / 1e3:.2f} ms per call on {lanes} lane(s) vs {best_inline / 1e3:.2f} ms inline"
        mode, why = ("lanes", "faster") if best_lanes < 0.9 * best_inline else ("inline", "no faster")
        self.settled_calls += 1
        if self.settled_calls % _RETIME_EVERY == 0:
            other = "inline" if mode == "lanes" else "lanes"
            return other, f"re-timing {other} (one call in {_RETIME_EVERY}): so far {timings}"
        return mode, f"CPU lanes measured {why}: {timings}"


def _auto_history(sm: Any, spec: Any) -> _AutoHistory:
    per_module = _AUTO.get(sm._ss)
    if per_module is None:
        per_module = _AUTO[sm._ss] = collections.OrderedDict()
    history = per_module.get(spec.key)
    if history is None:
        history = per_module[spec.key] = _AutoHistory()
    per_module.move_to_end(spec.key)
    while len(per_module) > sm.config.plan_cache_size:
        per_module.popitem(last=False)
    return history


def _choose_mode(sm: Any, spec: Any, device: torch.device) -> _Mode:
    config = sm.config
    cuda_bound = _bound(config, "cuda")
    if _LANES.current_lane() != 0:
        return _Mode("inline", "called from inside a launched branch: its own branches run inline there", 1)
    if config.executor == "serial":
        return _Mode("inline", "branches run inline (executor='serial')", 1)
    if device.type == "cuda":
        return _Mode("streams", f"branches issued onto up to {cuda_bound - 1} pool CUDA stream(s)", cuda_bound)
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
        return _Mode("lanes", f"branches launched on {lanes} CPU lane(s) (executor='threads')", bound)
    history = _auto_history(sm, spec)
    mode, why = history.decide(lanes)
    return _Mode(mode, why, bound, history)
