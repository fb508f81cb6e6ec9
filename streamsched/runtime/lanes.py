"""Worker threads ("lanes") that run jobs in submission order, shared across calls.

Both CPU executors run on a :class:`LanePool`: the ``threads`` executor puts each planned
stream on a lane of its own, and eager dispatch puts each launched branch on the least
busy lane. A lane runs its jobs one after another, so a job that waits only on jobs
submitted before it can never wait forever on its own lane.

A forked child has none of its parent's threads, and the native libraries it inherited
(OpenMP, BLAS, oneDNN) carry the parent's thread state through the fork: calling them
from several new threads at once is not safe there (a forked child of a long test run
crashed in concurrent matmuls). The pool notices the fork (``os.register_at_fork``) and
marks itself ``forked_child``; both executors then run everything inline in the child,
as plain PyTorch would.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable

import torch

__all__ = ["LanePool"]


class LanePool:
    """Daemon worker threads, lane 1..k, created on first use and kept for the process."""

    def __init__(self, name: str):
        self.name = name
        self.lock = threading.Lock()  # callers' lock (the threads executor: one call at a time)
        self._count_lock = threading.Lock()  # the busy counts only
        self._queues: list[queue.SimpleQueue] = []
        self._unfinished: list[int] = []
        self._next = 0
        self._local = threading.local()
        self.forked_child = False
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_workers)

    def _forget_workers(self) -> None:
        self.forked_child = True
        self.lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._queues = []
        self._unfinished = []

    def current_lane(self) -> int:
        """The lane of the calling thread (0 outside this pool)."""
        return getattr(self._local, "lane", 0)

    def in_lane(self) -> bool:
        return self.current_lane() != 0

    def ensure(self, lanes: int) -> None:
        """Start workers until lanes 1..``lanes`` exist."""
        while len(self._queues) < lanes:
            self._start_worker()

    def reserve(self, lanes: int) -> int:
        """The least busy of lanes 1..``lanes`` (round robin among equals)."""
        with self._count_lock:
            self.ensure(lanes)
            start = self._next % lanes
            best = min(range(lanes), key=lambda i: (self._unfinished[i], (i - start) % lanes))
            self._next = best + 1
        return best + 1

    def submit(self, lane: int, job: Callable[[], None]) -> None:
        """Run ``job`` on ``lane`` after the jobs already there. A job must not raise: it
        hands its outcome over itself (a future, an event)."""
        with self._count_lock:
            self._unfinished[lane - 1] += 1
        # The caller's intra-op thread count travels with the job: PyTorch keeps part of
        # it per thread (OpenMP's and MKL's thread-local settings), and a kernel split
        # over another number of threads sums in another order (not bit for bit eager).
        self._queues[lane - 1].put((torch.get_num_threads(), job))

    def _start_worker(self) -> None:
        index = len(self._queues)
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queues.append(jobs)
        self._unfinished.append(0)

        def loop() -> None:
            self._local.lane = index + 1
            threads = 0
            while True:
                wanted, job = jobs.get()
                if wanted != threads:
                    torch.set_num_threads(wanted)
                    threads = wanted
                try:
                    job()
                finally:
                    with self._count_lock:
                        self._unfinished[index] -= 1

        threading.Thread(target=loop, name=f"{self.name}-{index + 1}", daemon=True).start()
