"""Planning: from a task graph to the schedule the runtime compiles.

- :mod:`.assign`, :mod:`.matching`: streams for the tasks (chains by maximum matching,
  bounded by the stream budget), issue order, and the waits and records between streams;
- :mod:`.choice`: every rule that picks how a plan runs (the estimate, the ``auto``
  trial, inline vs CPU lanes under eager dispatch);
- :mod:`.planner`: the pipeline fuse → tasks → coarsen → assign → choose, producing a
  :class:`~.planner.Schedule`, the one contract with the runtime;
- :mod:`.plan`: :class:`~.plan.Plan`, the report users read.
"""
