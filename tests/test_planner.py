import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streamsched.ir.graph import TaskGraph
from streamsched.planning.assign import assign_streams, chain_cover, compute_waits
from streamsched.planning.matching import maximum_matching
from streamsched.planning.plan import Plan, PlannedTask

from .test_graph import random_dag


def brute_matching_size(n_left, n_right, adj):
    edges = [(u, v) for u in range(n_left) for v in adj[u]]
    best = 0
    for k in range(len(edges), 0, -1):
        for subset in itertools.combinations(edges, k):
            us = [u for u, _ in subset]
            vs = [v for _, v in subset]
            if len(set(us)) == k and len(set(vs)) == k:
                return k
    return best


@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_matching_is_maximum(n_left, n_right, data):
    adj = [sorted(data.draw(st.sets(st.integers(0, n_right - 1), max_size=n_right))) for _ in range(n_left)]
    match = maximum_matching(n_left, n_right, adj)
    used = [v for v in match if v >= 0]
    assert len(used) == len(set(used))
    assert all(v in adj[u] for u, v in enumerate(match) if v >= 0)
    assert len(used) == brute_matching_size(n_left, n_right, adj)


def cross_chain_edges(tg: TaskGraph, chains):
    chain_of = {t: c for c, chain in enumerate(chains) for t in chain}
    reduced = tg.transitive_reduction()
    return sum(1 for v, ps in enumerate(reduced) for u in ps if chain_of[u] != chain_of[v])


def brute_min_cross_edges(tg: TaskGraph) -> int:
    """Fewest reduced edges between chains over every path cover of the reduction."""
    reduced = tg.transitive_reduction()
    edges = [(u, v) for v, ps in enumerate(reduced) for u in ps]
    best_matched = 0
    for k in range(len(edges), 0, -1):
        for subset in itertools.combinations(edges, k):
            if len({u for u, _ in subset}) == k and len({v for _, v in subset}) == k:
                best_matched = k
                break
        if best_matched:
            break
    return len(edges) - best_matched


@pytest.mark.parametrize("seed", range(25))
def test_chain_cover_has_the_fewest_cross_chain_edges(seed):
    tg = random_dag(7, 0.35, seed)
    chains = chain_cover(tg)
    # A partition into chains of the reduction ...
    assert sorted(t for c in chains for t in c) == list(range(len(tg)))
    reduced = tg.transitive_reduction()
    for chain in chains:
        for u, v in zip(chain, chain[1:]):
            assert u in reduced[v]
    # ... with maximum logical concurrency: independent tasks never share a chain ...
    chain_of = {t: c for c, chain in enumerate(chains) for t in chain}
    for a, b in itertools.combinations(range(len(tg)), 2):
        if tg.independent(a, b):
            assert chain_of[a] != chain_of[b]
    # ... and the fewest cross-chain edges (= waits) any path cover has.
    assert cross_chain_edges(tg, chains) == brute_min_cross_edges(tg)


def ordered(preds, stream, order, waits) -> bool:
    """Every cross-stream dependency is ordered by the waits (vector-clock replay)."""
    k = max(stream) + 1
    pos = {t: i for i, t in enumerate(order)}
    seq, counter = {}, [0] * k
    for t in order:
        counter[stream[t]] += 1
        seq[t] = counter[stream[t]]
    clock = [[0] * k for _ in range(k)]
    snap = {}
    for t in order:
        s = stream[t]
        for p in waits[t]:
            assert pos[p] < pos[t]
            clock[s] = [max(a, b) for a, b in zip(clock[s], snap[p])]
        for p in preds[t]:
            if stream[p] != s and clock[s][stream[p]] < seq[p]:
                return False
        clock[s][s] = seq[t]
        snap[t] = list(clock[s])
    return True


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("bound", [1, 2, 3, 8])
def test_assignment_respects_bound_orders_every_edge_and_needs_every_wait(seed, bound):
    tg = random_dag(30, 0.12, seed)
    a = assign_streams(tg, bound)
    assert max(a.stream) < bound and a.num_streams <= bound
    assert sorted(a.order) == list(range(len(tg)))
    pos = {t: i for i, t in enumerate(a.order)}
    assert all(pos[u] < pos[v] for u, v in tg.edges)
    assert ordered(tg.preds, a.stream, a.order, a.waits)
    for t in range(len(tg)):
        for p in a.waits[t]:
            assert a.stream[p] != a.stream[t] and a.records[p]
            fewer = [list(w) for w in a.waits]
            fewer[t].remove(p)
            assert not ordered(tg.preds, a.stream, a.order, fewer), f"wait {p}->{t} is redundant"
    # The critical path runs on the caller's stream without a single event.
    assert all(a.stream[t] == 0 for t in tg.critical_path())


def test_min_task_cost_keeps_tiny_branches_on_their_neighbours_stream():
    # 0 -> (1 heavy, 2 tiny, 3 heavy) -> 4
    tg = TaskGraph.from_edges(5, [(0, 1), (0, 2), (0, 3), (1, 4), (2, 4), (3, 4)], costs=[5, 100, 0.5, 90, 5])
    wide = assign_streams(tg, 8, min_task_cost=0.0)
    assert len({wide.stream[t] for t in (1, 2, 3)}) == 3
    thin = assign_streams(tg, 8, min_task_cost=10.0)
    assert thin.stream[2] == thin.stream[0] and thin.stream[1] != thin.stream[3]


def test_compute_waits_skips_waits_implied_through_another_stream():
    # 0 (s1) -> 1 (s1) ; 0 -> 2 (s0) ; 1 -> 2 : waiting on 1 covers 0.
    preds = [set(), {0}, {0, 1}]
    waits, records = compute_waits(preds, [1, 1, 0], [0, 1, 2], 2)
    assert waits == [[], [], [1]] and records[1] and not records[0]


def test_plan_round_trips_through_json_and_prints_a_table():
    task = PlannedTask(id=0, name="towers.0", nodes=["fc"], stream=0, cost_us=1.5)
    plan = Plan(
        model="M",
        signature="float32[2]",
        device="cpu",
        executor="serial",
        reason="test",
        stream_bound=1,
        num_streams=1,
        order=[0],
        tasks=[task],
        critical_path=[0],
        critical_path_us=1.5,
        est_serial_us=1.5,
        est_parallel_us=1.5,
        cross_stream_waits=0,
    )
    again = Plan.from_json(plan.to_json())
    assert again == plan
    text = str(plan)
    assert "towers.0" in text and "executor serial" in text
    with pytest.raises(Exception, match="not a valid streamsched plan"):
        Plan.from_json('{"model": 1}')


def test_plans_of_a_real_model_round_trip():
    import torch

    import streamsched as ss
    from benchmarks.zoo import Inception3

    sm = ss.StreamScheduledModule(Inception3().eval(), executor="streams")
    with torch.no_grad():
        sm(torch.randn(1, 3, 75, 75))
    plan = sm.plan
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.num_streams > 1 and plan.cross_stream_waits > 0
    text = str(plan)
    assert "Mixed_5b" in text and "fused" in text


def test_ten_thousand_task_plan_is_quick():
    import time

    tg = random_dag(2000, 0.0015, 7)  # the 10,000-task figure is printed by the benchmark
    start = time.perf_counter()
    assign_streams(tg, 8)
    assert time.perf_counter() - start < 10.0
    random.seed(0)
