"""The shortcut for calls of a signature whose plan runs as one generated function.

A small fused model's plan (an ensemble of critics: five batched kernels) costs tens of
microseconds, and the full call path (binding, the plan key, the LRU lookup, the
checks of the state the traces read, the runner's frames) about five more of them. A
hand-written stacked model pays none of that. Once a signature's plan runs the serial
program's one function and nothing else (``Runner.direct``: no sync log, chaos, nested
site or CUDA graph, its trial decided), its later calls with the same layout and shapes
take this shortcut.

What makes the full path choose that plan is checked here too, each in its cheapest
form:

- by the layout's generated check (``settled_calls.tensor_layout_check``): as many
  positional arguments, each a plain tensor with the signature's dtype, device and grad
  flag, the grad mode and autocast state; then the shapes, from a table of the layout's
  hot shapes (what the plan key holds besides: the modules' modes and hooks move the
  generation);
- by the caller: the global generation (a module re-wired, a mode switched, a hook or a
  watched flag set anywhere in the model), as for the settled as-written calls;
- per call, under the wrapper's lock, by :meth:`streamsched.runner.Runner.hot`
  (``Runner.hot_state_holds``): the plan's verdict unchanged since its function was
  chosen (a trial's or a size bucket's decision replaces it), no state written by an
  earlier call, no churn window, no saved-tensor hooks (activation checkpointing), no
  NVTX tool listening, the model not moved or cast, the dtypes of the state the traces
  read unchanged; then the plan still in the wrapper's cache (its recency kept there),
  and the fused stacks' guard.

A call that fails a per-call check drops the table and takes the full path, which
registers its signature again once that state allows; so do ``sm.invalidate()``, a
re-trace and an observer installed (``WrapperState.unsettle``). Only calls of positional
plain tensors register: their leaves are the arguments themselves, in order.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .frontend.trace_guard import autocast_state
from .settled_calls import SizeTable, tensor_layout_check, tensor_meta

__all__ = ["MISS", "HotEntry", "HotPlans", "MAX_HOT_SHAPES", "hot_eligible"]

# What Runner.hot returns where the full path must take the call.
MISS = object()

# Shapes one layout keeps hot (a workload cycling through more sizes takes the full
# path for some: the table is cleared when full, and refilled by the full path).
MAX_HOT_SHAPES = 16


class HotEntry:
    """One hot shape: its plan (a ``state.Compiled``), the ``direct`` tuple it ran by when
    it was registered, its key in the wrapper's plan cache, the cache's count of moves
    when it was last moved to the end there (``LRU.moves``), and ``(key, compiled)``:
    what the full path keeps of the previous call (``WrapperState.hot``)."""

    __slots__ = ("compiled", "direct", "key", "moves", "pair")

    def __init__(self, compiled: Any, key: Any):
        self.compiled = compiled
        self.direct = compiled.direct
        self.key = key
        self.moves = -1
        self.pair = (key, compiled)


class HotPlans:
    """A layout's check, the generation it was made at, and its table of hot shapes."""

    __slots__ = ("generation", "admits", "sizes")

    def __init__(self, generation: int, args: tuple):
        self.generation = generation
        self.admits: Callable[[tuple, dict, Optional[dict]], Any] = tensor_layout_check(
            tuple(("tensor", tensor_meta(a)) for a in args), (), torch.is_grad_enabled(), autocast_state()
        )
        self.sizes = SizeTable()

    def add(self, args: tuple, entry: HotEntry) -> None:
        sizes = self.sizes
        if len(sizes) >= MAX_HOT_SHAPES:
            sizes.clear()
        sizes[tuple([a.shape for a in args])] = entry


def hot_eligible(compiled: Any, observer: Any) -> bool:
    """Whether calls of ``compiled`` may take the shortcut, as far as the plan goes: a plan
    (not a record of calls run as written) with nothing for the full path to do around
    its program (no observer, output checks, trial, model code run inside, or
    aliasing-dependent order). What may change from call to call is
    ``Runner.hot_state_holds``'s."""
    return not (
        compiled.as_written  # (an AsWritten record has no program)
        or observer is not None
        or compiled.checks
        or compiled.trial is not None
        or compiled.runs_models_code
        or compiled.alias_pattern is not None
    )
