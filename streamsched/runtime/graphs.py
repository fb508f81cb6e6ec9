"""Whole-schedule CUDA graphs: the multi-stream plan captured once, replayed per call.

Capture follows ``torch.cuda.graphs``: warm up on the side stream that will capture, then
capture one run of the :class:`~streamsched.runtime.streams.StreamExecutor` inside
``torch.cuda.graph(...)``. The executor forks its pool streams from the capturing stream
and joins them back before the capture ends, so the graph holds every branch with its
cross-stream dependencies as graph edges; one replay launches the whole schedule.

- **Inputs** are copied into static buffers allocated before capture.
- **Outputs** are, by default, cloned after each replay (the caller owns them);
  ``clone_outputs=False`` returns the graph's static outputs, which the next replay
  overwrites.
- **Weights**: the graph reads parameters and buffers at their addresses, so in-place
  updates (optimizer steps, ``load_state_dict``) are seen by the next replay. A
  parameter given new storage (``.to()``, ``p.data = ...``, a storage freed and
  allocated again as FSDP does, a re-stacked fused group) is detected before replay (with
  the native runtime, one C++ loop over the weights' addresses) and the schedule is
  captured again; so is a parameter or
  buffer replaced by another object (``m.fc.weight = nn.Parameter(...)``), checked when
  any module registration happened since the last replay (``_generation``). Tensors that
  ``torch.func.functional_call`` swaps in for a while are not captured: those calls run
  on plain streams and the graphs of the module's own weights are kept, replayed again
  once the swap ends.
- **One graph per input signature** (each plan has its own), at most
  ``graph_cache_size`` alive, sharing one memory pool per module, captured on one capture
  stream per device (PyTorch wants the same stream for captures sharing a pool). A pool
  is shared only while a graph captured into it is alive: once every one is released
  (new weights on the only graph, a failed capture), PyTorch's allocator keeps the pool
  until its cache is emptied and asserts on a capture into it, so the next capture
  starts a new pool.
- **Not captured**: training (grad mode with any input or parameter requiring grad: the
  replays would all chain onto the one autograd graph recorded at capture) and calls
  under autocast (the capture would bake in autocast's cached casts of the weights, which
  later weight updates never reach and whose memory autocast frees on exit). Those calls
  run on plain streams.
- **Failures**: a capture that fails (a CPU synchronisation such as ``.item()`` inside a
  branch, an op that cannot be captured) leaves the module usable: the capture is ended,
  its graph memory pool released, the device's CUDA generator taken out of the capture
  mode ``capture_begin`` put it in (left there, every random kernel of the process outside
  a capture raises), the caller's stream current again, and the error kept
  is the one that broke the capture (not ``cudaStreamEndCapture``'s), so it names the
  task; with ``cuda_graph="auto"`` the plan falls back to plain streams with one warning
  naming that task; with ``cuda_graph=True`` a :class:`CaptureError` is raised.
- **Capture mode** ``"thread_local"``: CUDA's default (``"global"``) fails the capture
  when any other thread makes a call unsafe during capture, such as a ``DataLoader``'s
  pin-memory thread allocating pinned memory.
"""

from __future__ import annotations

import copy
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .. import _generation
from .._native import native
from ..errors import user_stacklevel
from .executor import PerProgram
from .program import Program, failing_node
from .streams import StreamExecutor
from .synclog import SyncLog

_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)

__all__ = ["GraphExecutor", "CaptureError"]


class CaptureError(RuntimeError):
    """A schedule could not be captured into a CUDA graph."""


@dataclass
class _Captured:
    program: Program  # held so its id cannot be reused while the graph is cached
    graph: Any
    static_inputs: list[torch.Tensor]
    static_output: Any
    weights: list[torch.Tensor]
    weight_ptrs: list[int]
    stack_versions: list[int] = field(default_factory=list)
    # The native runtime's check of the weights' addresses, one C++ loop: asked per
    # replay, ``data_ptr()`` on each of a 1,000-member model's 4,000 parameters cost
    # about 1 ms of host time (H200 machine), ten times the replay.
    address_guard: Any = None

    def stale(self, stacks: tuple[Any, ...]) -> bool:
        if [s.rebuilds for s in stacks] != self.stack_versions:
            return True
        if self.address_guard is not None:
            return not self.address_guard.valid()
        return any(t.data_ptr() != p for t, p in zip(self.weights, self.weight_ptrs))


def _address_guard(weights: list[torch.Tensor]) -> Any:
    """The native runtime's ``AddressGuard`` over ``weights``, or None (no extension, or
    a weight without plain storage): :meth:`_Captured.stale` then compares in Python."""
    guard_type = getattr(native(), "AddressGuard", None)
    if guard_type is None:
        return None
    try:
        return guard_type(weights)
    except (RuntimeError, TypeError):
        return None


def _autocast_on() -> bool:
    if _any_autocast is not None:
        return bool(_any_autocast())
    return any(torch.is_autocast_enabled(d) for d in ("cuda", "cpu"))


# Containers and their subclasses (pytree would leave a dict subclass, and the tensors in
# it, uncloned: the caller would get the static buffers the next replay overwrites).
def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        # A shallow copy keeps a dict subclass's type (and attributes), as eager returns it.
        out = copy.copy(value) if type(value) is not dict else {}
        for k, v in value.items():
            out[k] = _map_tensors(v, fn)
        return out
    return value


@dataclass
class _ProgramState:
    """What the graph executor knows of one program besides its captured graph."""

    calls: int = 0
    """Calls that could have replayed (``cuda_graph="auto"`` captures from the second)."""
    failed: Optional[str] = None
    """Why its capture failed (``"auto"``: it runs on plain streams from then on)."""


def _end_generator_capture(stream: Any) -> None:
    """Take the device's CUDA generator out of capture mode after a capture that failed.

    ``CUDAGraph.capture_begin`` puts the generators in capture mode before anything else,
    and only a successful ``capture_end`` takes them out: after a capture that failed,
    every random kernel of the process outside a capture (dropout, ``randn``) raises
    "Offset increment outside graph capture encountered unexpectedly". An empty capture,
    begun and ended on ``stream`` in a pool of its own, ends their capture mode; the
    generator's seed and offset are left as they were."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.stream(stream), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The CUDA Graph is empty")
            # Relaxed: the capture records nothing, so no other thread's call need fail.
            graph.capture_begin(capture_error_mode="relaxed")
            graph.capture_end()
        graph.reset()
    except Exception as exc:  # noqa: BLE001 - the failed capture's error is the one raised
        warnings.warn(
            f"streamsched: could not take the CUDA generator out of capture mode after a failed capture "
            f"({type(exc).__name__}: {exc}); random operations on this device may now fail",
            RuntimeWarning,
            stacklevel=2,
        )


class GraphExecutor:
    """Replays a captured :class:`StreamExecutor` schedule; see the module docstring."""

    name = "graph"

    def __init__(
        self,
        streams: StreamExecutor,
        module: torch.nn.Module,
        cache_size: int,
        clone_outputs: bool,
        strict: bool,
        warmup: int = 3,
    ):
        self.streams = streams
        self.module = module
        self.cache_size = cache_size
        self.clone_outputs = clone_outputs
        self.strict = strict
        self.warmup = warmup
        self.pool = None
        self._graphs: OrderedDict[int, _Captured] = OrderedDict()
        self._streams: dict[Any, Any] = {}  # the capture stream of each device
        self._generation = _generation.current()
        self._known = self._slots()
        # Whether tensors are swapped into the module now (torch.func.functional_call):
        # calls run on streams, uncaptured, and the graphs of its own weights are kept.
        self._swapped = False
        self._state: PerProgram[_ProgramState] = PerProgram()
        # The module's parameters as of a registration generation, with the native check
        # of their requires_grad flags (parameters_need_grad).
        self._own_parameters: tuple[Any, Any, list[torch.Tensor]] = (None, None, [])
        # Whether the last run replayed a graph (not the plain streams: a first call under
        # "auto", a failed capture, a call that logs or observes), for the call's path.
        self.replayed = False

    # --- decisions ------------------------------------------------------------------

    @staticmethod
    def captures(inputs: list[torch.Tensor]) -> bool:
        """Whether a call with these inputs is one a graph can replay: no gradient will
        flow to an input, outside autocast (the module's parameters:
        :meth:`parameters_need_grad`)."""
        if _autocast_on():
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs))

    def parameters_need_grad(self) -> bool:
        """Whether grad mode is on and a parameter of the module requires grad (a call to
        leave uncaptured). A frozen model called without ``no_grad`` asks this of every
        parameter on every call: walking ``parameters()`` of ParallelFCN(1000) took
        milliseconds per replay, so the list is kept per registration generation (a
        parameter added or replaced moves it) and its flags are read in one C++ loop."""
        if not torch.is_grad_enabled():
            return False
        generation = _generation.current()
        known, guard, parameters = self._own_parameters
        if known != generation:
            parameters = list(self.module.parameters())
            guard = _address_guard(parameters)
            self._own_parameters = (generation, guard, parameters)
        if guard is not None:
            return bool(guard.any_requires_grad())
        return any(p.requires_grad for p in parameters)

    def _weights(self) -> list[torch.Tensor]:
        return [t for t in list(self.module.parameters()) + list(self.module.buffers()) if t.is_cuda]

    def _slots(self) -> list[tuple[Any, str, torch.Tensor]]:
        """Every parameter and buffer of the module, as (owner, name, tensor)."""
        return [
            (m, n, t)
            for m in self.module.modules()
            for table in (m._parameters, m._buffers)
            for n, t in table.items()
            if t is not None
        ]

    def _check_weights(self) -> bool:
        """After any module registration anywhere: if a parameter or buffer of the module
        is now another tensor object, every graph reads the old one: forget them all.
        Tensors that ``torch.func.functional_call`` (``torch.nn.utils.stateless``) swapped
        in stand in for a while: nothing is forgotten, and this returns True (the call is
        not to be captured) until the module's own tensors are back."""
        generation = _generation.current()
        if generation == self._generation:
            return self._swapped
        slots = self._slots()
        known = self._known
        swapped = False
        if len(slots) != len(known) or any(a[0] is not b[0] or a[1] != b[1] for a, b in zip(slots, known)):
            self.forget()
            self._known = slots
        else:
            # A tensor swapped in leaves its slot known as the module's own (what comes
            # back when the swap ends); any other new tensor is the module's from now on.
            replaced = False
            now = []
            for (m, n, t), slot in zip(slots, known):
                if t is slot[2]:
                    now.append(slot)
                elif _generation.swapped_in(m, n, t):
                    swapped = True
                    now.append(slot)
                else:
                    replaced = True
                    now.append((m, n, t))
            if replaced:
                self.forget()
                self._known = now
        self._swapped = swapped
        self._generation = generation
        return swapped

    def swapped(self) -> bool:
        """Whether tensors are swapped into the module now (see :meth:`_check_weights`):
        the call runs on streams, as calls that cannot be captured do."""
        return self._check_weights()

    def _capture_stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    # --- capture and replay -----------------------------------------------------------

    def _capture(self, program: Program, inputs: list[torch.Tensor], stacks: tuple[Any, ...]) -> _Captured:
        device = self.streams.backend.device
        if self.pool is None or not self._graphs:
            # Graphs share one pool only while one of them is alive: once every graph
            # captured into a pool is released, PyTorch's allocator keeps the pool (until
            # its cache is emptied) and asserts on a capture into it. Weights changed on
            # the only graph, or a failed capture, start a new pool.
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [x.detach().clone() for x in inputs]
        side = self._capture_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # Warm up on the stream that captures: lazy inits and allocator warm-up happen
            # outside the graph (as torch.cuda.make_graphed_callables does).
            for _ in range(self.warmup):
                self.streams.run(program, static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        static_output = self._record(graph, program, static_inputs, side, device)
        weights = self._weights()
        return _Captured(
            program=program,
            graph=graph,
            static_inputs=static_inputs,
            static_output=static_output,
            weights=weights,
            weight_ptrs=[w.data_ptr() for w in weights],
            stack_versions=[s.rebuilds for s in stacks],
            address_guard=_address_guard(weights),
        )

    def _record(self, graph: Any, program: Program, static_inputs: list[torch.Tensor], side: Any, device: Any) -> Any:
        """One run of the schedule captured into ``graph`` on ``side``.

        What ``torch.cuda.graph`` does, except on failure: there, ``capture_end`` raises
        ``cudaStreamEndCapture``'s error over the one that broke the capture and the
        capture stream stays current. Here the stream is restored in every case, the
        capture is ended and its pool released, and the original error propagates.
        """
        torch.cuda.synchronize(device)
        with torch.cuda.device(device), torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            except BaseException:
                _end_generator_capture(side)
                raise
            try:
                out = self.streams.run(program, static_inputs)
            except BaseException:
                self._abandon(graph, device, side)
                raise
            try:
                graph.capture_end()
            except BaseException:
                self._failed_end(device, side)
                raise
        return out

    def _abandon(self, graph: Any, device: Any, side: Any) -> None:
        try:
            graph.capture_end()
        except Exception:  # noqa: BLE001 - the capture's own error is the one to report
            self._failed_end(device, side)
        else:
            graph.reset()

    def _failed_end(self, device: Any, side: Any) -> None:
        """What a capture whose end failed leaves behind, undone: its memory pool still
        recording and referenced (PyTorch releases it only for graphs that were captured;
        left so, the next capture into the pool fails and its memory is never returned),
        and the CUDA generator in capture mode (:func:`_end_generator_capture`)."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        torch._C._cuda_endAllocateToPool(index, self.pool)
        torch._C._cuda_releasePool(index, self.pool)
        _end_generator_capture(side)

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Any = None,
        observer: Any = None,
    ) -> Any:
        self.replayed = False
        key = id(program)
        stacks = program.stacks
        state = self._state.get(program, lambda _: _ProgramState())
        if log is not None or chaos is not None or observer is not None or state.failed is not None:
            # Logging, chaos and per-task observation need the host to see every task.
            return self.streams.run(program, inputs, log, chaos, observer)
        # (Whether a parameter requires grad in grad mode, the check of a training call,
        # is asked once per call by the runner, which then never gives the call here:
        # Runner.executor_for.)
        if not self.captures(inputs) or self._check_weights():
            return self.streams.run(program, inputs)
        if not self.strict:
            # "auto": capture a signature from its second scheduled call on, so shapes
            # seen once never pay for a capture.
            state.calls += 1
            if state.calls < 2:
                return self.streams.run(program, inputs)
        captured = self._graphs.get(key)
        if captured is not None and captured.stale(stacks):
            del self._graphs[key]
            captured = None
        if captured is None:
            try:
                captured = self._capture(program, inputs, stacks)
            except Exception as exc:  # noqa: BLE001 - reported or re-raised below
                where = failing_node(program, exc)
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                if where:
                    reason += f" (in {where})"
                torch.cuda.synchronize(self.streams.backend.device)
                if self.strict:
                    raise CaptureError(f"could not capture the schedule into a CUDA graph: {reason}") from exc
                state.failed = reason
                warnings.warn(
                    f"streamsched: CUDA graph capture failed, running this plan on plain streams: {reason}",
                    RuntimeWarning,
                    stacklevel=user_stacklevel(),
                )
                return self.streams.run(program, inputs)
            self._graphs[key] = captured
            while len(self._graphs) > self.cache_size:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        for static, x in zip(captured.static_inputs, inputs):
            static.copy_(x, non_blocking=True)
        captured.graph.replay()
        self.replayed = True
        if not self.clone_outputs:
            return captured.static_output
        return _map_tensors(captured.static_output, lambda t: t.clone())

    def forget(self, program: Optional[Program] = None) -> None:
        """Drop the captured graph of ``program``, or every one (weights moved, module
        converted) when None, and what the stream executor made for it. Whether a
        program's capture failed is remembered: it would fail again."""
        if program is None:
            self._graphs.clear()
        else:
            self._graphs.pop(id(program), None)
        self.streams.forget(program)

    def close(self) -> None:
        self.forget()

    def __len__(self) -> int:
        return len(self._graphs)
