"""What eager dispatch is given of the wrapped model: the :class:`DispatchContext`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..._lru import LRU
from ...config import SchedulerConfig
from ...frontend.binder import CallBinder


@dataclass(frozen=True)
class DispatchContext:
    """Everything one eager-dispatch call reads of the wrapped model, passed explicitly.

    The wrapper keeps one per model (:meth:`for_model`) and hands each call a copy with
    that call's number and observer (:meth:`for_call`). ``lane_histories`` is the state
    eager dispatch keeps between calls: per call structure (``CallSpec.key``), the
    :class:`~streamsched.planning.choice.LaneHistory` that ``executor="auto"`` decides by
    on CPU, at most ``config.plan_cache_size`` of them; ``leaf_calls``, per call
    structure, the ``(in branches, total, {nested child path: calls})`` leaf-module calls
    counted on its first call (``Plan.coverage``); ``nested_site()`` names the nested
    child being called on this thread, if any (``streamsched.nesting``).
    """

    model: torch.nn.Module
    config: SchedulerConfig
    binder: CallBinder  # the wrapper's binder of forward's arguments
    lane_histories: LRU
    leaf_calls: LRU
    call_number: int = 0  # seeds chaos delays
    observer: Any = None  # push(task, stream) / pop(task, stream) around every branch, or None
    nested_site: Optional[Callable[[], Optional[str]]] = None

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        config: SchedulerConfig,
        binder: CallBinder,
        nested_site: Optional[Callable[[], Optional[str]]] = None,
    ) -> DispatchContext:
        lrus = LRU(config.plan_cache_size), LRU(config.plan_cache_size)
        return cls(model, config, binder, *lrus, nested_site=nested_site)

    def for_call(self, call_number: int, observer: Any) -> DispatchContext:
        return DispatchContext(
            self.model,
            self.config,
            self.binder,
            self.lane_histories,
            self.leaf_calls,
            call_number,
            observer,
            self.nested_site,
        )
