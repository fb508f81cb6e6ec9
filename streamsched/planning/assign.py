"""Stream assignment, after Nimble (Kwon et al., NeurIPS 2020), on a bounded pool.

1. **Transitive reduction.** An edge implied by a longer path needs no wait of its own.
2. **Path cover by maximum matching.** Split each task ``v`` into ``v_out`` and ``v_in``;
   each reduced edge ``u -> v`` joins ``u_out`` to ``v_in``. A maximum matching picks,
   for as many edges as possible, "``v`` follows ``u`` on ``u``'s stream". The chains
   it forms put any two independent tasks on different chains (maximum logical
   concurrency) and leave exactly ``|E_reduced| - |matching|`` reduced edges between
   chains, the fewest cross-stream waits any such assignment can have.
   The critical path's edges are matched first and kept, so the longest dependent
   sequence runs on the caller's stream without a single event.
3. **Packing** the chains onto at most ``bound`` streams: chains whose estimated
   activity windows do not overlap share a stream; a chain cheaper than
   ``min_task_cost`` joins the stream of the chain it depends on.
4. **Issue order** by list scheduling on the estimated costs, so each stream gets work
   early, and an estimated makespan.
5. **Waits** from vector clocks over the issue order: a task waits on a producer's
   event only when no earlier wait already orders it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from ..ir.graph import TaskGraph
from .matching import maximum_matching

__all__ = ["Assignment", "assign_streams", "chain_cover", "compute_waits"]


@dataclass
class Assignment:
    """Where each task runs, in what order it is issued, and what it waits for."""

    stream: list[int]
    order: list[int]
    waits: list[list[int]]
    records: list[bool]
    num_streams: int
    chains: list[list[int]]
    est_parallel_us: float
    est_serial_us: float


def chain_cover(tg: TaskGraph, fixed_path: list[int] | None = None) -> list[list[int]]:
    """Nimble's minimum-wait chain cover of the transitive reduction.

    ``fixed_path`` (the critical path) is kept as one chain; the matching of the rest
    is maximum given that constraint.
    """
    n = len(tg)
    reduced = tg.transitive_reduction()
    adj: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(reduced):
        for u in ps:
            adj[u].append(v)
    for row in adj:
        row.sort()

    initial = [-1] * n
    if fixed_path:
        blocked_left: set[int] = set()
        blocked_right: set[int] = set()
        for u, v in zip(fixed_path, fixed_path[1:]):
            if u in reduced[v]:
                initial[u] = v
                blocked_left.add(u)
                blocked_right.add(v)
        # Pinned pairs stay matched: other vertices may not take their slots.
        adj = [
            ([initial[u]] if u in blocked_left else [v for v in row if v not in blocked_right])
            for u, row in enumerate(adj)
        ]
    match = maximum_matching(n, n, adj, initial)
    has_pred = [False] * n
    for v in match:
        if v >= 0:
            has_pred[v] = True
    chains = []
    for start in range(n):
        if has_pred[start]:
            continue
        chain = [start]
        while match[chain[-1]] >= 0:
            chain.append(match[chain[-1]])
        chains.append(chain)
    return chains


def _pack_chains(
    tg: TaskGraph,
    chains: list[list[int]],
    critical: set[int],
    bound: int,
    min_task_cost: float,
) -> list[int]:
    """Stream of each chain: the critical chain on 0, the rest packed by activity window."""
    finish = tg.earliest_finish()
    start = [finish[t] - tg.tasks[t].cost for t in range(len(tg))]
    chain_of = {}
    for c, chain in enumerate(chains):
        for t in chain:
            chain_of[t] = c
    cost = [sum(tg.tasks[t].cost for t in chain) for chain in chains]
    window = [(start[chain[0]], finish[chain[-1]]) for chain in chains]

    main = (
        max(
            range(len(chains)),
            key=lambda c: (len(critical.intersection(chains[c])), cost[c], -c),
        )
        if chains
        else 0
    )
    stream_of = [-1] * len(chains)
    # Greedy interval packing (chains in order of start): a chain goes to the stream that
    # became free most recently before it starts (best fit, leaving earlier-free streams
    # for chains that start earlier), else to the stream that frees soonest. An unused
    # stream counts as free from the beginning. O(chains x bound).
    free_at = [float("-inf")] * bound
    used = [False] * bound
    if chains:
        stream_of[main] = 0
        free_at[0] = window[main][1]
        used[0] = True

    for c in sorted(range(len(chains)), key=lambda c: (window[c][0], -cost[c], c)):
        if stream_of[c] != -1:
            continue
        begin, end = window[c]
        if cost[c] < min_task_cost or bound == 1:
            # Not worth an event: run beside the chain that feeds it (or the main one).
            feeders = [chain_of[p] for p in tg.preds[chains[c][0]] if stream_of[chain_of[p]] != -1]
            target = stream_of[feeders[0]] if feeders else 0
        else:
            fitting = [s for s in range(bound) if free_at[s] <= begin]
            if fitting:
                # Prefer a stream already in use (fewer streams), then the tightest fit.
                target = max(fitting, key=lambda s: (used[s], free_at[s], -s))
            else:
                target = min(range(bound), key=lambda s: (free_at[s], s))
        stream_of[c] = target
        free_at[target] = max(free_at[target], end)
        used[target] = True
    return stream_of


def _issue_order(tg: TaskGraph, stream: list[int], num_streams: int, launch_us: float) -> tuple[list[int], float]:
    """List-schedule the tasks: returns the issue order and the estimated makespan.

    Issuing is sequential on the host (``launch_us`` per task); a task starts when the
    host has issued it, its inputs are done and its stream is free.
    """
    n = len(tg)
    indeg = [len(p) for p in tg.preds]
    finish = [0.0] * n
    stream_free = [0.0] * num_streams
    host = 0.0
    ready: list[tuple[float, int]] = []
    for t in range(n):
        if indeg[t] == 0:
            heapq.heappush(ready, (0.0, t))
    order = []
    while ready:
        _, t = heapq.heappop(ready)
        order.append(t)
        host += launch_us
        begin = max(host, stream_free[stream[t]], max((finish[p] for p in tg.preds[t]), default=0.0))
        finish[t] = begin + tg.tasks[t].cost
        stream_free[stream[t]] = finish[t]
        for v in tg.succs[t]:
            indeg[v] -= 1
            if indeg[v] == 0:
                est = max(max(finish[p] for p in tg.preds[v]), stream_free[stream[v]])
                heapq.heappush(ready, (est, v))
    return order, max(finish, default=0.0)


def compute_waits(
    preds: list[set[int]], stream: list[int], order: list[int], num_streams: int
) -> tuple[list[list[int]], list[bool]]:
    """The fewest event waits that order every cross-stream dependency.

    A vector clock per stream records, for every other stream, how many of its tasks are
    known to be complete; a producer already covered by an earlier wait (directly or
    through another stream) needs no wait of its own.
    """
    position = {t: i for i, t in enumerate(order)}
    seq = [0] * len(stream)
    counter = [0] * num_streams
    for t in order:
        counter[stream[t]] += 1
        seq[t] = counter[stream[t]]
    clock = [[0] * num_streams for _ in range(num_streams)]
    snapshot: dict[int, list[int]] = {}
    waits: list[list[int]] = [[] for _ in stream]
    records = [False] * len(stream)
    last_on_stream: dict[int, int] = {}
    for t in order:
        s = stream[t]
        vc = clock[s]
        for p in sorted(preds[t], key=lambda p: -position[p]):
            sp = stream[p]
            if sp == s or vc[sp] >= seq[p]:
                continue
            waits[t].append(p)
            records[p] = True
            vc[:] = [max(a, b) for a, b in zip(vc, snapshot[p])]
        vc[s] = seq[t]
        snapshot[t] = list(vc)
        last_on_stream[s] = t
    # The caller's stream joins every side stream at the end: their last tasks record.
    for s, t in last_on_stream.items():
        if s != 0:
            records[t] = True
    return waits, records


def assign_streams(
    tg: TaskGraph,
    bound: int,
    min_task_cost: float = 0.0,
    launch_us: float = 5.0,
    sync_us: float = 2.0,
) -> Assignment:
    """Assign every task of ``tg`` to one of at most ``bound`` streams (0 = caller's)."""
    n = len(tg)
    serial = tg.total_cost() + n * launch_us
    if n == 0:
        return Assignment([], [], [], [], 1, [], 0.0, 0.0)
    critical = tg.critical_path()
    chains = chain_cover(tg, critical) if bound > 1 else [list(range(n))]
    stream_of_chain = _pack_chains(tg, chains, set(critical), bound, min_task_cost)
    stream = [0] * n
    for c, chain in enumerate(chains):
        for t in chain:
            stream[t] = stream_of_chain[c]
    # Renumber: 0 stays the caller's stream, the rest densely in order of first use.
    renumber = {0: 0}
    for t in range(n):
        if stream[t] not in renumber:
            renumber[stream[t]] = len(renumber)
    stream = [renumber[s] for s in stream]
    num_streams = len(renumber)
    order, makespan = _issue_order(tg, stream, num_streams, launch_us)
    waits, records = compute_waits(tg.preds, stream, order, num_streams)
    syncs = sum(len(w) for w in waits) + 2 * (num_streams - 1)
    return Assignment(
        stream=stream,
        order=order,
        waits=waits,
        records=records,
        num_streams=num_streams,
        chains=chains,
        est_parallel_us=makespan + syncs * sync_us,
        est_serial_us=serial,
    )
