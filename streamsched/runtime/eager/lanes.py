"""The CPU lane pool: worker threads, shared by every call, that run launched branches."""

from __future__ import annotations

import os
import queue
import threading
from typing import Callable


class _LanePool:
    """Worker threads shared by every eager-dispatch call in the process.

    Each lane runs its jobs in submission order. A job waits only on jobs submitted before
    it, so the earliest unfinished job is always at the head of its lane and can run: lanes
    never deadlock on each other, whichever calls share them. A launch goes to the lane
    with the fewest unfinished jobs (an idle one if there is one).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: list[queue.SimpleQueue] = []
        self._unfinished: list[int] = []
        self._next = 0
        self._local = threading.local()
        # A forked child has none of the parent's threads: it starts a pool of its own.
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self._forget_workers)

    def _forget_workers(self) -> None:
        self._lock = threading.Lock()
        self._queues = []
        self._unfinished = []

    def current_lane(self) -> int:
        """The lane of the calling thread (0 outside the pool)."""
        return getattr(self._local, "lane", 0)

    def reserve(self, lanes: int) -> int:
        with self._lock:
            while len(self._queues) < lanes:
                self._start_worker()
            start = self._next % lanes
            best = min(range(lanes), key=lambda i: (self._unfinished[i], (i - start) % lanes))
            self._next = best + 1
            self._unfinished[best] += 1
        return best + 1

    def submit(self, lane: int, job: Callable[[], None]) -> None:
        self._queues[lane - 1].put(job)

    def _start_worker(self) -> None:
        index = len(self._queues)
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._queues.append(jobs)
        self._unfinished.append(0)

        def loop() -> None:
            self._local.lane = index + 1
            while True:
                job = jobs.get()
                try:
                    job()  # a job never raises: it hands its outcome to a future
                finally:
                    with self._lock:
                        self._unfinished[index] -= 1

        threading.Thread(target=loop, name=f"streamsched-eager-{index + 1}", daemon=True).start()


_LANES = _LanePool()
