"""The entry point: one call of a wrapped model run by eager dispatch, from start to join."""

from __future__ import annotations

import contextlib
import time
from typing import Any, NamedTuple, Optional

import torch

from ...branch import _eager_launcher
from ...frontend.binder import CallSpec
from ...frontend.leafcalls import counting_dispatch
from ..synclog import SyncLog
from .call import _EagerCall
from .dispatch_context import DispatchContext
from .policy import _choose_mode
from .reported_plan import EagerSchedule
from .writes import _WriteGuard


class DispatchResult(NamedTuple):
    """What one eager-dispatch call leaves for the wrapper to record, raised or not."""

    output: Any  # the forward's output, every pending value resolved (None if it raised)
    schedule: EagerSchedule  # what ``sm.plan`` reports for the call
    sync_log: Optional[SyncLog]  # the call's SyncLog, with ``sync_log=True``
    error: Optional[BaseException]  # what the call raises, once the wrapper recorded the rest

    def result(self) -> Any:
        """The output, or the call's exception raised."""
        if self.error is not None:
            raise self.error
        return self.output


def run_eager_dispatch(
    context: DispatchContext,
    spec: CallSpec,
    tensors: list[torch.Tensor],
    reason: BaseException,
    args: tuple,
    kwargs: dict,
) -> DispatchResult:
    """Run one call of ``context.model`` by eager dispatch.

    ``spec`` and ``tensors`` describe the call's arguments as ``CallBinder.bind`` split
    them, ``args`` and ``kwargs`` are the call's own (the forward gets these: a list or
    dict it is passed and changes is the caller's, as in eager, not a copy rebuilt from
    the leaves); ``reason`` is the ``TraceError`` that ruled tracing out. Runs the model's own
    ``forward`` in the calling thread with every ``@streamsched.branch`` call launched
    (see the package docstring), and returns its output with every pending value
    resolved, or the exception to raise, with the call's record and SyncLog
    (:class:`DispatchResult`). Every launched branch has finished (CPU) or been joined
    into the caller's stream (CUDA) when this returns.
    """
    device = next((t.device for t in tensors), torch.device("cpu"))
    mode = _choose_mode(context, spec.key, device)
    log = SyncLog() if context.config.sync_log else None
    call = _EagerCall(context, tensors, device, log, mode)
    if log is not None:
        log.input_slots = call.input_slots
    # Nothing runs beside the forward when every branch runs inline: no writes to guard.
    guard = contextlib.nullcontext() if call.all_inline else _WriteGuard(call.launches, call.before_write)

    model = context.model
    output: Any = None
    error: Optional[BaseException] = None
    # The first call of a call structure counts its leaf-module calls (Plan.coverage),
    # through the join: a branch on a lane may still be running when forward returns.
    leaf_calls = context.leaf_calls.get_fresh(spec.key)
    counting = counter = None
    if leaf_calls is None:
        counting = counting_dispatch(model, context.config.leaf_modules, context.nested_site)
        counter = counting.__enter__()
    start = time.perf_counter_ns()
    token = _eager_launcher.set(call)
    try:
        with guard:
            output = call.finish(type(model).forward(model, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - handed to the wrapper, after the join
        error = exc
    finally:
        _eager_launcher.reset(token)
        failure = call.join()
        call.open = False
        if counting is not None:
            counting.__exit__(None, None, None)
            nested: dict[str, int] = {}
            for hit in counter.hits:
                if type(hit) is str:
                    nested[hit] = nested.get(hit, 0) + 1
            leaf_calls = (counter.hits.count(True), len(counter.hits), nested)
            if error is None and failure is None:
                context.leaf_calls.put(spec.key, leaf_calls)
        if mode.history is not None and error is None and failure is None:
            # The measuring; the rule that turns it into a choice is mode.history's.
            mode.history.record(mode.cpu, (time.perf_counter_ns() - start) / 1e3, call.launches)
        schedule = EagerSchedule(call.record(tensors, reason, device), leaf_calls)
    # Eager execution would have stopped at the earliest failing branch, before anything
    # the forward did after it: that is the exception to raise (unless the caller was
    # interrupted).
    if failure is not None and (error is None or isinstance(error, Exception)):
        error = failure
    try:
        if error is None:
            call.log_output(output)
    finally:
        call.close()
    return DispatchResult(None if error is not None else output, schedule, log, error)
