"""Generated functions of a compiled plan: compiled once per source text, and only when run.

A plan's :class:`~streamsched.runtime.program.Program` holds the same statements up to
three times (one function per task, ``run_serial`` and the whole-call ``call``), and a
workload whose sizes vary compiles one program per size. Python's ``compile`` was most
of a program's cost (7 of 10 ms for a two-layer BERT), and most of what it compiled
never ran: the serial executor runs only ``call``, the stream and thread executors only
the task functions.

- :class:`LazyFunction` keeps a function's source and compiles it on first use.
- :func:`define` compiles a source text once per process (:data:`_CODES`, an LRU):
  programs of one trace at other sizes, and alike layers' nested plans, often generate
  the same text. ``compile`` depends on nothing but the text (and the flags this module
  compiles with), so a cached code object is what compiling again would give; it gets
  the program's own file name (tracebacks and :func:`~.program.failing_node` read it)
  and runs in the program's own globals.
"""

from __future__ import annotations

import linecache
import threading
import types
from typing import Any, Callable, Optional

from .._lru import LRU

__all__ = ["LazyFunction", "define"]

# Source text -> the code object ``compile`` made of it (under a placeholder file name).
_CODES = LRU(256)
_CODES_LOCK = threading.Lock()


def _renamed(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` and every code object nested in it, reading ``filename`` as their file."""
    consts = tuple(_renamed(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


def define(name: str, source: str, filename: str, namespace: dict[str, Any]) -> Callable:
    """The function ``name`` that ``source`` (a module's text, defining it) defines, run
    in a copy of ``namespace``; its code reads ``filename``, whose text is kept in
    ``linecache`` so that tracebacks and debuggers show the generated lines."""
    with _CODES_LOCK:
        code = _CODES.get_fresh(source)
    if code is None:
        code = compile(source, "<streamsched-generated>", "exec")
        with _CODES_LOCK:
            _CODES.put(source, code)
    scope = dict(namespace)
    exec(_renamed(code, filename), scope)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    return scope[name]


class LazyFunction:
    """A generated function's source, compiled by the first :meth:`get`.

    ``namespace`` is the program's table of constants: read when compiling, so an entry
    added to it later (other statements of the same program) is harmless, and dropped
    once compiled. Two threads asking at once may both compile; both get an equal
    function and one is kept."""

    __slots__ = ("name", "source", "filename", "_namespace", "_fn")

    def __init__(self, name: str, source: str, filename: str, namespace: dict[str, Any]):
        self.name = name
        self.source = source
        self.filename = filename
        self._namespace: Optional[dict[str, Any]] = namespace
        self._fn: Optional[Callable] = None

    @classmethod
    def of_body(
        cls, name: str, body: list[str], filename: str, namespace: dict[str, Any], arg: str = "env"
    ) -> LazyFunction:
        """``def name(arg):`` over ``body``'s lines (``pass`` when empty)."""
        lines = [f"def {name}({arg}):"] + [f"    {line}" for line in body or ["pass"]]
        return cls(name, "\n".join(lines) + "\n", filename, namespace)

    def get(self) -> Callable:
        fn = self._fn
        if fn is None:
            namespace = self._namespace
            if namespace is None:  # compiled by another thread meanwhile
                return self._fn  # type: ignore[return-value]
            fn = define(self.name, self.source, self.filename, namespace)
            self._fn, self._namespace = fn, None
        return fn

    @property
    def compiled(self) -> bool:
        return self._fn is not None
