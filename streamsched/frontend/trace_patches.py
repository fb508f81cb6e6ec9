"""Names patched for as long as any thread traces, refusing on the tracing threads only.

A trace must refuse some library calls that fx would run once, at trace time (drawing
Python random numbers, reseeding a generator, activation checkpointing): the names
are replaced by stand-ins that raise on a thread that is tracing and call the original
anywhere else. Patches are installed when the first trace on any thread begins and put
back when the last one ends; traces nest and run on several threads at once.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

__all__ = ["PatchWhileTracing"]


class PatchWhileTracing:
    """One set of patches. ``install()`` patches the names and returns the originals,
    ``{(module, name): original}``; :meth:`tracing` tells a stand-in whether to refuse."""

    def __init__(self, install: Callable[[], dict[tuple[Any, str], Any]]):
        self._install = install
        self._lock = threading.Lock()
        self._threads: dict[int, int] = {}  # thread id -> traces running on it
        self._originals: dict[tuple[Any, str], Any] = {}

    def tracing(self) -> bool:
        """Whether a trace runs on this thread."""
        return bool(self._threads.get(threading.get_ident()))

    def begin(self) -> None:
        thread = threading.get_ident()
        with self._lock:
            self._threads[thread] = self._threads.get(thread, 0) + 1
            if not self._originals:
                self._originals = self._install()

    def end(self) -> None:
        thread = threading.get_ident()
        with self._lock:
            left = self._threads.get(thread, 0) - 1
            if left > 0:
                self._threads[thread] = left
            else:
                self._threads.pop(thread, None)
            if not self._threads:
                for (module, name), original in self._originals.items():
                    setattr(module, name, original)
                self._originals = {}
