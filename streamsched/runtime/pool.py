"""The executors of one wrapped model: made on first use, kept for its lifetime.

One place turns a plan's executor name and device into the :class:`~.executor.Executor`
that runs it, so that stream pools, CUDA events, native task tables and captured graphs
are made once per model and device, whichever path (a plain call, the ``auto`` trial, a
CUDA graph capture) asks for them.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..planning.plan import Plan
from .executor import Executor
from .graphs import GraphExecutor
from .serial import SerialExecutor
from .streams import CudaBackend, SimulatedBackend, StreamExecutor
from .threads import ThreadExecutor

__all__ = ["ExecutorPool"]


class ExecutorPool:
    """The ``serial``, ``threads``, ``streams`` (one per device) and ``graph`` (one per
    CUDA device) executors of one wrapped model; ``native`` is the extension module or
    None (the Python runtime)."""

    def __init__(self, native: Any = None):
        self.native = native
        self.serial = SerialExecutor()
        self._threads: Optional[ThreadExecutor] = None
        self.streams: dict[str, StreamExecutor] = {}
        self.graphs: dict[str, GraphExecutor] = {}

    def named(self, name: str, device: str) -> Executor:
        """The executor called ``name`` (``serial``, ``threads`` or ``streams``) for
        tensors on ``device``."""
        if name == "serial":
            return self.serial
        if name == "threads":
            if self._threads is None:
                self._threads = ThreadExecutor()
            return self._threads
        return self._streams(device)

    def for_plan(self, plan: Plan) -> Executor:
        """The executor that runs ``plan``'s schedule (its trial's choice, once made)."""
        return self.named(plan.schedule_executor, plan.device)

    def graphs_for(self, device: str, module: torch.nn.Module, config: Any) -> GraphExecutor:
        """The CUDA-graph executor of ``device``, replaying that device's stream schedules."""
        graphs = self.graphs.get(device)
        if graphs is None:
            graphs = GraphExecutor(
                self._streams(device),
                module,
                config.graph_cache_size,
                config.clone_outputs,
                strict=config.cuda_graph is True,
            )
            self.graphs[device] = graphs
        return graphs

    def forget_graphs(self) -> None:
        """Drop every captured graph (the model's weights were converted or replaced)."""
        for graphs in self.graphs.values():
            graphs.forget()

    def _streams(self, device: str) -> StreamExecutor:
        executor = self.streams.get(device)
        if executor is None:
            dev = torch.device(device)
            backend = CudaBackend(dev) if dev.type == "cuda" else SimulatedBackend()
            executor = self.streams[device] = StreamExecutor(backend, native=self.native)
        return executor
