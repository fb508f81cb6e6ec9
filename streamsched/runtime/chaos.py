"""Chaos mode: random delays before tasks, so a missing wait shows up as a wrong answer.

On CPU lanes the delay is a ``time.sleep``; on CUDA streams it is a spin kernel
(``torch.cuda._sleep``) enqueued on the task's stream, which delays the GPU work
without blocking the host. Deterministic for a given seed and call number.
"""

from __future__ import annotations

import random
import time

import torch

__all__ = ["Chaos"]


class Chaos:
    """Per-call source of random delays; ``lane`` keeps each lane's sequence independent."""

    def __init__(self, seed: int, call: int, max_delay_s: float = 0.002):
        self.seed = seed
        self.call = call
        self.max_delay_s = max_delay_s
        self._rngs: dict[int, random.Random] = {}

    def _rng(self, lane: int) -> random.Random:
        rng = self._rngs.get(lane)
        if rng is None:
            rng = random.Random(hash((self.seed, self.call, lane)))
            self._rngs[lane] = rng
        return rng

    def delay(self, lane: int) -> None:
        rng = self._rng(lane)
        if rng.random() < 0.5:
            time.sleep(rng.random() * self.max_delay_s)

    def gpu_delay(self, lane: int) -> None:
        rng = self._rng(lane)
        if rng.random() < 0.5:
            # About a million cycles at most: long enough to reorder unsynchronised work.
            torch.cuda._sleep(int(rng.random() * 1_000_000))
