"""The time the system kept a thread off the cores while it was ready to run.

On a loaded machine (other processes on the cores) a call's wall time holds waits that
are no cost of the way that ran it. The ``auto`` trial takes them off its CPU figures
(``runner.Runner._timed`` for forwards, ``backward_timing`` for backwards), from Linux's
per-thread ``schedstat``: its second field is the nanoseconds the thread has waited on a
run queue. Elsewhere (no ``/proc``) there is no reading and the wall time stands.

Each thread keeps its own open ``/proc/thread-self/schedstat`` (the path names the thread
that opens it): a ``pread`` of it costs a few microseconds, where opening the file per
reading cost 30 us on a loaded machine, inside the span being timed.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

__all__ = ["runqueue_wait_ns"]

_SCHEDSTAT = "/proc/thread-self/schedstat"


class _OpenFile:
    """One thread's open ``schedstat`` (``fd`` -1: none here), closed with the thread."""

    __slots__ = ("fd", "pid")

    def __init__(self) -> None:
        # A forked child inherits the file, which names the parent's thread: the pid
        # tells it to open its own.
        self.pid = os.getpid()
        try:
            self.fd = os.open(_SCHEDSTAT, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            self.fd = -1

    def __del__(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass


# Per thread: a thread's entry (and its file) goes when the thread ends.
_threads = threading.local()


def runqueue_wait_ns() -> Optional[int]:
    """Nanoseconds the calling thread has waited on a run queue so far (ready to run,
    another task on the core), from Linux's ``schedstat``; ``None`` where there is none.

    >>> waited = runqueue_wait_ns()
    >>> waited is None or waited >= 0
    True
    """
    opened = getattr(_threads, "file", None)
    if opened is None or opened.pid != os.getpid():
        opened = _threads.file = _OpenFile()
    fd = opened.fd
    if fd < 0:
        return None
    try:
        return int(os.pread(fd, 128, 0).split()[1])
    except (OSError, ValueError, IndexError):
        return None
