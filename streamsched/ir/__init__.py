"""The scheduling IR: the task graph over a traced fx graph, and what each task costs.

- :mod:`.graph`: :class:`~.graph.TaskGraph`, tasks (lists of fx nodes) with their data
  and effect predecessors, reachability and critical path;
- :mod:`.cost`: the device model and the roofline estimate of each node (fusion prices
  candidate groups with it, so it sits below the passes).
"""
