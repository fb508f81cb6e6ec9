"""The entry point: one call of a wrapped model run by eager dispatch, from start to join."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Optional

import torch

from ...branch import _eager_launcher
from ..synclog import SyncLog
from .call import _EagerCall
from .plan import EagerSchedule, _CallRecord
from .policy import _choose_mode
from .writes import _WriteGuard


def run_eager_dispatch(sm: Any, spec: Any, tensors: list[torch.Tensor], reason: BaseException) -> Any:
    """Run one call of ``sm`` (a ``StreamScheduledModule``) by eager dispatch.

    ``spec`` and ``tensors`` describe the call's arguments as ``CallBinder.bind`` split
    them; ``reason`` is the ``TraceError`` that ruled tracing out. Runs the model's own
    ``forward`` in the calling thread with every ``@streamsched.branch`` call launched
    (see the module docstring), and returns its output with every pending value resolved.
    Every launched branch has finished (CPU) or been joined into the caller's stream
    (CUDA) when this returns or raises; ``sm.plan`` then describes the call.
    """
    st = sm._ss
    leaves: list[Any] = [None] * spec.treedef.num_leaves
    for pos, value in spec.static_leaves:
        leaves[pos] = value
    for pos, value in zip(spec.tensor_positions, tensors):
        leaves[pos] = value
    args, kwargs = st.binder.rebuild(leaves, spec)

    device = next((t.device for t in tensors), torch.device("cpu"))
    mode = _choose_mode(sm, spec, device)
    log: Optional[SyncLog] = None
    if sm.config.sync_log:
        log = SyncLog()
        st.last_sync_log = log
    call = _EagerCall(sm, tensors, device, log, mode)
    if log is not None:
        log.input_slots = call.input_slots
    # Nothing runs beside the forward when every branch runs inline: no writes to guard.
    guard = contextlib.nullcontext() if call.all_inline else _WriteGuard(call)

    model = sm.module
    output: Any = None
    error: Optional[BaseException] = None
    start = time.perf_counter_ns()
    token = _eager_launcher.set(call)
    try:
        with guard:
            output = call.finish(type(model).forward(model, *args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - re-raised below, after the join
        error = exc
    finally:
        _eager_launcher.reset(token)
        failure = call.join()
        call.open = False
        if mode.history is not None and error is None and failure is None:
            mode.history.record(mode.cpu, (time.perf_counter_ns() - start) / 1e3, call.launches)
        st.last = EagerSchedule(_CallRecord.of(call, tensors, reason, device))
    try:
        # Eager execution would have stopped at the earliest failing branch, before
        # anything the forward did after it: that is the exception to raise (unless the
        # caller was interrupted).
        if failure is not None and (error is None or isinstance(error, Exception)):
            raise failure
        if error is not None:
            raise error
        call.log_output(output)
        return output
    finally:
        call.close()
