"""Maximum bipartite matching (Hopcroft-Karp), iterative so deep graphs cannot overflow
the recursion limit.

Example::

    >>> maximum_matching(3, 3, [[0, 1], [0], [2]])
    [1, 0, 2]
"""

from __future__ import annotations

from collections import deque
from typing import Optional, Sequence

__all__ = ["maximum_matching"]


def maximum_matching(
    n_left: int,
    n_right: int,
    adj: Sequence[Sequence[int]],
    initial: Optional[Sequence[int]] = None,
) -> list[int]:
    """Return ``match[u]`` (a right vertex, or -1) for each left vertex ``u``.

    ``initial`` is a valid partial matching to grow from (augmenting paths may re-route
    it, never shrink it).
    """
    match_l = [-1] * n_left
    match_r = [-1] * n_right
    if initial is not None:
        for u, v in enumerate(initial):
            if v >= 0:
                match_l[u] = v
                match_r[v] = u
    # A greedy start finds most of the matching on the DAGs we see.
    for u in range(n_left):
        if match_l[u] == -1:
            for v in adj[u]:
                if match_r[v] == -1:
                    match_l[u] = v
                    match_r[v] = u
                    break

    while True:
        dist = [-1] * n_left
        queue: deque[int] = deque()
        for u in range(n_left):
            if match_l[u] == -1:
                dist[u] = 0
                queue.append(u)
        found = False
        while queue:
            u = queue.popleft()
            for v in adj[u]:
                w = match_r[v]
                if w == -1:
                    found = True
                elif dist[w] == -1:
                    dist[w] = dist[u] + 1
                    queue.append(w)
        if not found:
            return match_l

        cursor = [0] * n_left
        for root in range(n_left):
            if match_l[root] != -1:
                continue
            stack = [root]
            via: list[int] = []  # via[i]: right vertex taken from stack[i] to stack[i + 1]
            while stack:
                u = stack[-1]
                advanced = False
                edges = adj[u]
                while cursor[u] < len(edges):
                    v = edges[cursor[u]]
                    cursor[u] += 1
                    w = match_r[v]
                    if w == -1:
                        for uu, vv in zip(stack, via + [v]):
                            match_l[uu] = vv
                            match_r[vv] = uu
                        stack = []
                        advanced = True
                        break
                    if dist[w] == dist[u] + 1:
                        via.append(v)
                        stack.append(w)
                        advanced = True
                        break
                if not advanced:
                    dist[u] = -2  # dead end for the rest of this phase
                    stack.pop()
                    if via:
                        via.pop()
