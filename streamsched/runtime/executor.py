"""The one protocol every executor follows, and the state it keeps per program.

A :class:`~streamsched.runtime.program.Program` is the compiled form of one plan. An
executor decides *how* it runs: ``serial`` (every task in issue order on the caller's
stream), ``threads`` (CPU lanes, one per planned stream), ``streams`` (CUDA streams, or
their simulation on CPU) and ``graph`` (the ``streams`` schedule captured once into a
CUDA graph and replayed). Like :class:`torch.fx.Interpreter`, the protocol names its
override points, and they are the same for all four:

- :meth:`Executor.run` runs one call: ``run(program, inputs, log, chaos, observer)``
  returns the program's flat outputs. ``log`` (a :class:`~.synclog.SyncLog`) records
  every synchronisation decision for the race checker (given none, an executor logs to
  :data:`~.synclog.NULL_LOG`, whose methods do nothing, rather than testing for a log
  at each decision); ``chaos`` delays tasks at random
  to shake out missing waits; ``observer.push(task, stream)`` / ``pop`` bracket each
  task (NVTX ranges, timelines). An executor that cannot honour one of them runs the
  call some way that can (the graph executor runs plain streams under a log).
- :meth:`Executor.forget` drops what the executor keeps for a program (its native
  runtime, events, lane plan, capture), for a program that changed after it ran.
- :meth:`Executor.close` releases the executor's own resources.

What an executor derives from a program and reuses across calls lives in the executor,
in a :class:`PerProgram` table, never on the program: a program is shared by every
executor that may run it (the ``auto`` trial times several on one program).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Generic, Optional, Protocol, TypeVar, runtime_checkable

from .chaos import Chaos
from .program import Program
from .synclog import SyncLog

__all__ = ["Executor", "PerProgram"]

T = TypeVar("T")


@runtime_checkable
class Executor(Protocol):
    """How a compiled :class:`Program` runs; see the module docstring."""

    name: str

    def run(
        self,
        program: Program,
        inputs: list[Any],
        log: Optional[SyncLog] = None,
        chaos: Optional[Chaos] = None,
        observer: Any = None,
    ) -> Any:
        """Run one call of ``program`` on ``inputs`` and return its flat outputs."""
        ...

    def forget(self, program: Optional[Program] = None) -> None:
        """Drop the state kept for ``program`` (for every program when None)."""
        ...

    def close(self) -> None:
        """Release the executor's own resources."""
        ...


class PerProgram(Generic[T]):
    """State an executor derives from each program it runs, dropped with the program.

    Programs come and go with the plan cache (an LRU); a weak table keeps the executor
    from holding them alive.
    """

    def __init__(self) -> None:
        self._table: weakref.WeakKeyDictionary[Program, T] = weakref.WeakKeyDictionary()

    def get(self, program: Program, make: Callable[[Program], T]) -> T:
        value = self._table.get(program)
        if value is None:
            value = self._table[program] = make(program)
        return value

    def forget(self, program: Optional[Program] = None) -> None:
        if program is None:
            self._table.clear()
        else:
            self._table.pop(program, None)
