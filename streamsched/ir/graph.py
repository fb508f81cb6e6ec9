"""The IR: a DAG of tasks built from an fx graph.

A task is one or more fx nodes that run in order on one stream; an edge ``a -> b``
means task ``b`` reads a value task ``a`` produced. Graph inputs (placeholders) and
attributes (parameters, buffers) belong to no task: they exist before the call starts.

Reachability is kept as Python ints used as bitsets (bit ``j`` of ``reach[i]`` set when
task ``j`` depends on task ``i`` transitively), which answers "are these independent?"
in O(1) and makes a 10,000-task graph cheap.

Example::

    >>> tg = TaskGraph.from_edges(4, [(0, 1), (0, 2), (1, 3), (2, 3)], costs=[1, 5, 2, 1])
    >>> tg.independent(1, 2), tg.independent(0, 3)
    (True, False)
    >>> tg.critical_path()
    [0, 1, 3]
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from torch import fx

from ..frontend.meta import ValueMeta
from ..frontend.nodes import is_glue, node_label, span_label, submodule
from .cost import DeviceModel, estimate_node_cost

__all__ = ["Task", "TaskGraph"]


@dataclass
class Task:
    """One unit of scheduling: fx nodes run in order on one stream."""

    id: int
    nodes: list[fx.Node] = field(default_factory=list)
    cost: float = 0.0
    glue: bool = False
    label: str = ""

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        compute = [n for n in self.nodes if not is_glue(n)] or self.nodes
        if not compute:
            return f"task{self.id}"
        return span_label(compute)


class TaskGraph:
    """A DAG of tasks with costs, in a topological order (task ids are that order)."""

    def __init__(self, tasks: list[Task], preds: list[set[int]]):
        self.tasks = tasks
        self.preds = preds
        self.succs: list[set[int]] = [set() for _ in tasks]
        for v, ps in enumerate(preds):
            for u in ps:
                if u >= v:
                    raise ValueError(f"task ids must be a topological order: edge {u} -> {v}")
                self.succs[u].add(v)
        self._reach: Optional[list[int]] = None

    # --- construction -------------------------------------------------------------

    @classmethod
    def from_edges(cls, n: int, edges: Iterable[tuple[int, int]], costs: Optional[Sequence[float]] = None) -> TaskGraph:
        """A task graph from bare edges (ids must already be a topological order)."""
        preds: list[set[int]] = [set() for _ in range(n)]
        for u, v in edges:
            preds[v].add(u)
        tasks = [Task(i, cost=float(costs[i]) if costs is not None else 1.0) for i in range(n)]
        return cls(tasks, preds)

    @classmethod
    def from_fx(
        cls,
        graph: fx.Graph,
        root,
        metas: dict[fx.Node, ValueMeta],
        device: DeviceModel,
        measured: Optional[dict[str, float]] = None,
        after: Optional[dict[str, set[str]]] = None,
    ) -> TaskGraph:
        """One task per call node; placeholders, attributes and the output are not tasks.

        ``measured`` maps node labels to measured microseconds (from a profile); they
        replace the estimate where present. ``after`` maps a node's name to the names of
        nodes it must follow beyond its data inputs (in-place effects on shared storage).
        """
        task_of_name: dict[str, int] = {}
        tasks: list[Task] = []
        node_task: dict[fx.Node, int] = {}
        preds: list[set[int]] = []
        for node in graph.nodes:
            if node.op in ("placeholder", "get_attr", "output"):
                continue
            if node.op == "call_module":
                module = submodule(root, node.target)
            else:  # an opaque call handed a module to run (frontend.opaque_functions)
                module = getattr(node.target, "costed_module", None) if node.op == "call_function" else None
            cost = estimate_node_cost(node, module, metas, device)
            if measured is not None:
                cost = measured.get(node_label(node), cost)
            tid = len(tasks)
            tasks.append(Task(tid, [node], cost, glue=is_glue(node)))
            node_task[node] = tid
            task_of_name[node.name] = tid
            deps = {node_task[i] for i in node.all_input_nodes if i in node_task}
            if after:
                deps |= {task_of_name[n] for n in after.get(node.name, ()) if n in task_of_name}
            preds.append(deps)
        return cls(tasks, preds)

    # --- queries ------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.tasks)

    @property
    def edges(self) -> list[tuple[int, int]]:
        return [(u, v) for v, ps in enumerate(self.preds) for u in sorted(ps)]

    @property
    def reach(self) -> list[int]:
        """``reach[i]``: bitset of tasks reachable from ``i`` (excluding ``i``)."""
        if self._reach is None:
            reach = [0] * len(self.tasks)
            for u in range(len(self.tasks) - 1, -1, -1):
                r = 0
                for v in self.succs[u]:
                    r |= (1 << v) | reach[v]
                reach[u] = r
            self._reach = reach
        return self._reach

    def reaches(self, a: int, b: int) -> bool:
        """Whether ``b`` depends (transitively) on ``a``."""
        return bool((self.reach[a] >> b) & 1)

    def independent(self, a: int, b: int) -> bool:
        """Whether neither task depends on the other (they may run at the same time)."""
        return a != b and not self.reaches(a, b) and not self.reaches(b, a)

    def levels(self) -> list[int]:
        """Longest distance (in edges) from a source: tasks of one level are independent."""
        level = [0] * len(self.tasks)
        for v, ps in enumerate(self.preds):
            if ps:
                level[v] = 1 + max(level[u] for u in ps)
        return level

    def width(self) -> int:
        """The most tasks on one level (a lower bound of the graph's true width)."""
        counts: dict[int, int] = {}
        for lv in self.levels():
            counts[lv] = counts.get(lv, 0) + 1
        return max(counts.values(), default=0)

    def transitive_reduction(self) -> list[set[int]]:
        """Predecessor sets with every edge implied by a longer path removed."""
        reach = self.reach
        reduced: list[set[int]] = [set() for _ in self.tasks]
        for u in range(len(self.tasks)):
            succ = self.succs[u]
            if not succ:
                continue
            covered = 0
            for w in succ:
                covered |= reach[w]
            for v in succ:
                if not (covered >> v) & 1:
                    reduced[v].add(u)
        return reduced

    def earliest_finish(self) -> list[float]:
        """Finish time of each task with unlimited streams (ASAP schedule by cost)."""
        finish = [0.0] * len(self.tasks)
        for v, ps in enumerate(self.preds):
            start = max((finish[u] for u in ps), default=0.0)
            finish[v] = start + self.tasks[v].cost
        return finish

    def critical_path(self) -> list[int]:
        """The path of greatest total cost from a source to a sink."""
        if not self.tasks:
            return []
        finish = self.earliest_finish()
        v = max(range(len(self.tasks)), key=lambda i: (finish[i], -i))
        path = [v]
        while self.preds[v]:
            v = max(self.preds[v], key=lambda u: (finish[u], -u))
            path.append(v)
        return path[::-1]

    def total_cost(self) -> float:
        return sum(t.cost for t in self.tasks)

    # --- rewriting ----------------------------------------------------------------

    def contracted(self, groups: list[list[int]]) -> TaskGraph:
        """A new graph in which each group of tasks becomes one task (nodes concatenated).

        ``groups`` must partition the tasks, each group's nodes in a valid order, and the
        contraction must stay acyclic; groups are renumbered in a topological order.
        """
        owner = {}
        for g, members in enumerate(groups):
            for t in members:
                owner[t] = g
        gpreds: list[set[int]] = [set() for _ in groups]
        for v, ps in enumerate(self.preds):
            for u in ps:
                if owner[u] != owner[v]:
                    gpreds[owner[v]].add(owner[u])
        order = _topological_order(len(groups), gpreds, key=lambda g: min(groups[g]))
        new_id = {g: i for i, g in enumerate(order)}
        tasks = []
        preds = []
        for g in order:
            members = sorted(groups[g])
            nodes = [n for t in members for n in self.tasks[t].nodes]
            cost = sum(self.tasks[t].cost for t in members)
            glue = all(self.tasks[t].glue for t in members)
            labels = {self.tasks[t].label for t in members if self.tasks[t].label}
            label = labels.pop() if len(labels) == 1 else ""
            tasks.append(Task(new_id[g], nodes, cost, glue, label))
            preds.append({new_id[p] for p in gpreds[g]})
        return TaskGraph(tasks, preds)


def _topological_order(n: int, preds: list[set[int]], key) -> list[int]:
    """Kahn's algorithm; among ready groups the smallest ``key`` goes first."""
    indeg = [len(p) for p in preds]
    succs: list[list[int]] = [[] for _ in range(n)]
    for v, ps in enumerate(preds):
        for u in ps:
            succs[u].append(v)
    ready = [(key(v), v) for v in range(n) if indeg[v] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        _, u = heapq.heappop(ready)
        order.append(u)
        for v in succs[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(ready, (key(v), v))
    if len(order) != n:
        raise ValueError("contraction created a cycle")
    return order
