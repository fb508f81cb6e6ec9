"""Coarsening: cheap nodes join the task of their producer or their consumer.

A view, a ``getitem`` or a tiny pointwise op is not worth a stream switch and an event.
Such a node joins the task that produced *all* its task inputs (it can only run after
that task anyway), or else the single task that consumes it.

Both merges keep every task *convex* (no path leaves a task and comes back into it),
which is exactly what keeps the contracted graph acyclic: a node merged into its
producer depends on nothing outside that task, and a node merged into its consumer
feeds nothing outside it.
"""

from __future__ import annotations

import logging

from ..ir.graph import TaskGraph

__all__ = ["coarsen"]

log = logging.getLogger(__name__)


def coarsen(tg: TaskGraph, cheap_us: float) -> TaskGraph:
    """Merge glue tasks and tasks cheaper than ``cheap_us`` into a neighbour, repeating
    until nothing changes (a merge can leave another task with a single producer)."""
    while True:
        out = _coarsen_once(tg, cheap_us)
        if len(out) == len(tg):
            return out
        tg = out


def _coarsen_once(tg: TaskGraph, cheap_us: float) -> TaskGraph:
    n = len(tg)
    parent = list(range(n))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def cheap(t: int) -> bool:
        task = tg.tasks[t]
        return task.glue or task.cost < cheap_us

    merged = [False] * n
    absorbed: dict[int, list[int]] = {t: [t] for t in range(n)}
    # Forward sweep: into the producer group when all inputs come from one group.
    for v in range(n):
        if not cheap(v) or not tg.preds[v]:
            continue
        groups = {find(u) for u in tg.preds[v]}
        if len(groups) == 1:
            root = groups.pop()
            parent[v] = root
            absorbed[root].append(v)
            merged[v] = True
    # Backward sweep: a cheap group whose every consumer lies in one group joins it.
    for v in range(n - 1, -1, -1):
        if merged[v] or not cheap(v):
            continue
        consumers = {find(w) for m in absorbed[v] for w in tg.succs[m]} - {v}
        if len(consumers) == 1:
            target = consumers.pop()
            parent[v] = target
            absorbed[target].extend(absorbed.pop(v))
            merged[v] = True

    members: dict[int, list[int]] = {}
    for t in range(n):
        members.setdefault(find(t), []).append(t)
    groups = list(members.values())
    log.debug("coarsen: %d tasks -> %d", n, len(groups))
    return tg.contracted(groups)
