"""CPU lanes: the streams of a plan run on a small pool of threads.

Lane 0 runs in the calling thread (as stream 0 is the caller's stream); lanes 1..k-1
run on persistent worker threads. Each lane runs its tasks in issue order; a task whose
producer is on another lane waits on that producer's ``threading.Event``, exactly where
the CUDA executor would wait on a CUDA event. PyTorch releases the GIL inside its
kernels, so independent branches overlap on separate cores.

Thread-local PyTorch state (grad mode, inference mode, autocast) is carried from the
caller into each lane; a call made under state a lane cannot carry (saved-tensor
hooks, Python function or dispatch modes: :func:`lanes_refused`) runs on the calling
thread. An exception in any lane stops every lane at its next task; all
lanes are joined before the earliest failing task's exception (in issue order, as eager
would have met it first) propagates.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Optional

import torch

from .chaos import Chaos
from .executor import PerProgram
from .lanes import LanePool
from .program import CompiledTask, Program, run_task
from .serial import SerialExecutor
from .synclog import NULL_LOG, NullSyncLog, SyncLog

__all__ = ["ThreadExecutor", "lanes_refused"]


_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks
_function_modes = torch._C._len_torch_function_stack
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_mode_stack = torch.overrides._get_current_function_mode_stack
_functorch_active = torch._C._are_functorch_transforms_active


def lanes_refused(own: tuple[type, ...] = ()) -> bool:
    """Whether the calling thread holds PyTorch state a lane cannot take along, so that
    the call's work must stay on it: saved-tensor hooks (activation checkpointing's,
    ``save_on_cpu``), whose pack hook must see every tensor autograd saves; Python
    ``TorchFunctionMode``/``TorchDispatchMode``s (``with torch.device(...)``, a profiler
    or counting mode), which must see every op; and ``torch.func`` transforms
    (``grad``, ``vmap``, ``jvp``), whose wrapped tensors a lane's ops would escape.
    ``own``: function modes of the caller's own that need not follow the work (eager
    dispatch's write guard). (Grad mode, inference mode and autocast are carried:
    :class:`_TorchState`.)"""
    if _top_saved_tensors_hooks(False) is not None or _dispatch_modes() > 0 or _functorch_active():
        return True
    if _function_modes() == 0:
        return False
    return any(not isinstance(mode, own) for mode in _function_mode_stack())


class _TorchState:
    """The thread-local PyTorch modes of the calling thread, to re-enter in a lane."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = []
        for device in ("cpu", "cuda"):
            if torch.is_autocast_enabled(device):
                self.autocast.append((device, torch.get_autocast_dtype(device)))

    def enter(self, stack: contextlib.ExitStack) -> None:
        if self.inference:
            stack.enter_context(torch.inference_mode())
        stack.enter_context(torch.set_grad_enabled(self.grad))
        for device, dtype in self.autocast:
            stack.enter_context(torch.autocast(device, dtype=dtype))


class _Call:
    """Shared state of one call across lanes."""

    def __init__(self, env: list, events: dict[int, threading.Event], order: dict[int, int]):
        self.env = env
        self.events = events
        self.order = order
        self.lock = threading.Lock()
        self.errors: list[tuple[int, BaseException]] = []
        self.failed = False

    def fail(self, task_id: int, exc: BaseException) -> None:
        with self.lock:
            self.errors.append((self.order.get(task_id, 1 << 30), exc))
            self.failed = True


def _lane_frees(program: Program) -> dict[int, tuple[int, ...]]:
    """Slots a lane may drop after a task: those read only on that lane, at their last read."""
    readers: dict[int, set[int]] = {}
    last: dict[int, int] = {}
    for task in program.tasks:
        for slot in task.reads:
            if slot >= program.n_slots:  # an in-place storage location: no value to drop
                continue
            readers.setdefault(slot, set()).add(task.stream)
            last[slot] = task.id
    frees: dict[int, list[int]] = {}
    outputs = set(program.output_slots)
    for slot, lanes in readers.items():
        producer = program.slot_producer.get(slot)
        if producer is None:
            continue  # an input or attribute: the caller keeps it alive anyway
        producer_lane = program.tasks_by_id[producer].stream
        if len(lanes) == 1 and slot not in outputs and producer_lane in lanes:
            frees.setdefault(last[slot], []).append(slot)
    return {t: tuple(s) for t, s in frees.items()}


# One threaded call runs at a time (the pool's lock): lanes of two calls never queue
# behind each other, so no call can wait on a lane another call is holding. A call made
# from inside a lane (a wrapped module called by a branch of another) runs its tasks in
# order on that lane instead of waiting for the pool.
_POOL = LanePool("streamsched-lane")
# Set on the thread that runs a plan's lane 0 while it holds the pool: a plan run from
# inside one of its tasks (a wrapped module called by an opaque task, a nested plan) runs
# serially there, as one run from a lane thread does; the pool's lock is not re-entrant.
_caller = threading.local()


class ThreadExecutor:
    """Runs a multi-stream plan on CPU threads, one lane per planned stream."""

    name = "threads"

    def __init__(self) -> None:
        self._frees: PerProgram[dict[int, tuple[int, ...]]] = PerProgram()
        self._serial = SerialExecutor()

    def forget(self, program: Optional[Program] = None) -> None:
        self._frees.forget(program)

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Optional[Chaos] = None,
        observer: Any = None,
    ) -> Any:
        """Run one call; ``observer.push(task, lane)``/``pop`` bracket each task in its lane
        thread (so an observer must be thread-safe)."""
        if _POOL.in_lane() or _POOL.forked_child or getattr(_caller, "running", False) or lanes_refused():
            return self._serial.run(program, inputs, log, chaos, observer)
        with _POOL.lock:
            _caller.running = True
            try:
                return self._run(program, inputs, log, chaos, observer)
            finally:
                _caller.running = False

    def _run(
        self, program: Program, inputs: list[Any], log: Optional[SyncLog], chaos: Optional[Chaos], observer: Any
    ) -> Any:
        if log is None:
            log = NULL_LOG
        lanes: dict[int, list[CompiledTask]] = {}
        for task in program.tasks:
            lanes.setdefault(task.stream, []).append(task)
        env = program.new_env(inputs)
        events = {t.id: threading.Event() for t in program.tasks if t.records}
        call = _Call(env, events, {t.id: i for i, t in enumerate(program.tasks)})
        frees = self._frees.get(program, _lane_frees)
        state = _TorchState()
        side = [lane for lane in sorted(lanes) if lane != 0]
        _POOL.ensure(max(side, default=0))
        done = {lane: threading.Event() for lane in side}

        log.fork(side)
        for lane in side:

            def job(lane: int = lane) -> None:
                try:
                    self._run_lane(call, lane, lanes[lane], frees, state, log, chaos, observer)
                finally:
                    done[lane].set()

            _POOL.submit(lane, job)
        try:
            self._run_lane(call, 0, lanes.get(0, []), frees, None, log, chaos, observer)
        finally:
            # Join every lane before returning or raising, whatever happened.
            for lane in side:
                done[lane].wait()
            log.join(side)
        if call.errors:
            call.errors.sort(key=lambda item: item[0])
            raise call.errors[0][1]
        # A lane's value handed to the caller is the caller's after the join, as a
        # side stream's output is after record_stream on the caller's stream.
        for slot in program.side_outputs:
            log.record_stream(0, slot)
        log.output(program.output_slots)
        return program.output(env)

    @staticmethod
    def _run_lane(
        call: _Call,
        lane: int,
        tasks: list[CompiledTask],
        frees: dict[int, tuple[int, ...]],
        state: Optional[_TorchState],
        log: SyncLog | NullSyncLog,
        chaos: Optional[Chaos],
        observer: Any = None,
    ) -> None:
        env = call.env
        task = None
        with contextlib.ExitStack() as stack:
            if state is not None:
                state.enter(stack)
            try:
                for task in tasks:
                    for producer in task.waits:
                        call.events[producer].wait()
                        log.wait(lane, producer)
                    if call.failed:
                        return
                    if chaos is not None:
                        chaos.delay(lane)
                    run_task(task, env, observer, lane)
                    log.launch(lane, task.id, task.reads, task.writes)
                    if task.records:
                        log.record(lane, task.id)
                        call.events[task.id].set()
                    for slot in frees.get(task.id, ()):
                        env[slot] = None
                        log.free(lane, slot)
            except BaseException as exc:  # noqa: BLE001 - re-raised by the caller
                call.fail(task.id if task is not None else -1, exc)
            finally:
                # Never leave another lane waiting on an event this lane will not set.
                for t in tasks:
                    if t.records and not call.events[t.id].is_set():
                        call.events[t.id].set()

    def close(self) -> None:
        pass
