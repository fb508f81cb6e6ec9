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
  parameter given new storage (``.to()``, ``p.data = ...``, a re-stacked fused group)
  is detected before replay and the schedule is captured again.
- **One graph per input signature** (each plan has its own), at most
  ``graph_cache_size`` alive, in one memory pool per module.
- **Training** (grad mode with tensors that require grad) runs through plain streams:
  the capture covers inference.
- **Failures**: a capture that fails (a CPU synchronisation such as ``.item()`` inside a
  branch, an op that cannot be captured) leaves the module usable: with
  ``cuda_graph="auto"`` the plan falls back to plain streams with one warning naming the
  task that failed; with ``cuda_graph=True`` the error is raised.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from .program import Program, failing_node
from .streams import StreamExecutor
from .synclog import SyncLog

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

    def stale(self, stacks: list[Any]) -> bool:
        if [s.rebuilds for s in stacks] != self.stack_versions:
            return True
        return any(t.data_ptr() != p for t, p in zip(self.weights, self.weight_ptrs))


def _map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_map_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


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

    # --- decisions ------------------------------------------------------------------

    @staticmethod
    def captures(inputs: list[torch.Tensor]) -> bool:
        """Whether this call is one a graph can replay (inference on CUDA tensors)."""
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return False
        return True

    def _weights(self) -> list[torch.Tensor]:
        return [t for t in list(self.module.parameters()) + list(self.module.buffers()) if t.is_cuda]

    # --- capture and replay -----------------------------------------------------------

    def _capture(self, program: Program, inputs: list[torch.Tensor], stacks: list[Any]) -> _Captured:
        device = inputs[0].device if inputs else torch.device("cuda", torch.cuda.current_device())
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_inputs = [x.detach().clone() for x in inputs]
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            # Warm up on the stream that captures: lazy inits and allocator warm-up happen
            # outside the graph (as torch.cuda.make_graphed_callables does).
            for _ in range(self.warmup):
                self.streams.run(program, static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            static_output = self.streams.run(program, static_inputs)
        weights = self._weights()
        return _Captured(
            program=program,
            graph=graph,
            static_inputs=static_inputs,
            static_output=static_output,
            weights=weights,
            weight_ptrs=[w.data_ptr() for w in weights],
            stack_versions=[s.rebuilds for s in stacks],
        )

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Any = None,
        observer: Any = None,
        stacks: Optional[list[Any]] = None,
    ) -> Any:
        key = id(program)
        stacks = stacks or []
        failed = getattr(program, "_graph_failed", None)
        if log is not None or chaos is not None or observer is not None or failed is not None:
            # Logging, chaos and per-task observation need the host to see every task.
            return self.streams.run(program, inputs, log, chaos, observer)
        if not self.strict:
            # "auto": capture a signature from its second scheduled call on, so shapes
            # seen once never pay for a capture.
            seen = getattr(program, "_graph_calls", 0) + 1
            program._graph_calls = seen  # type: ignore[attr-defined]
            if seen < 2:
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
                torch.cuda.synchronize()
                if self.strict:
                    raise CaptureError(f"could not capture the schedule into a CUDA graph: {reason}") from exc
                program._graph_failed = reason  # type: ignore[attr-defined]
                warnings.warn(
                    f"streamsched: CUDA graph capture failed, running this plan on plain streams: {reason}",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return self.streams.run(program, inputs)
            self._graphs[key] = captured
            while len(self._graphs) > self.cache_size:
                self._graphs.popitem(last=False)
        self._graphs.move_to_end(key)
        for static, x in zip(captured.static_inputs, inputs):
            static.copy_(x, non_blocking=True)
        captured.graph.replay()
        if not self.clone_outputs:
            return captured.static_output
        return _map_tensors(captured.static_output, lambda t: t.clone())

    def forget(self) -> None:
        """Drop every captured graph (weights moved, module converted)."""
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)
