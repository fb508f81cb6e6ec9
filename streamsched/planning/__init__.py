"""Planning: from a task graph to the schedule the runtime compiles.

- :mod:`.assign`, :mod:`.matching`: streams for the tasks (chains by maximum matching,
  bounded by the stream budget), issue order, and the waits and records between streams;
- :mod:`.choice`: every rule that picks how a plan runs (the estimate, the ``auto``
  trial, inline vs CPU lanes under eager dispatch);
- :mod:`.pipeline`: planning passes (:class:`~.pipeline.PlanningPass`) over one
  :class:`~.pipeline.PlanningContext`, and the runner that applies them;
- :mod:`.planner`: the passes, in order (fuse → tasks → coarsen → assign → choose → the
  scheduled tasks → the plan), producing a :class:`~.schedule.Schedule`;
- :mod:`.schedule`: :class:`~.schedule.Schedule`, the one contract with the runtime: a
  flat list of :class:`~.schedule.ScheduledTask`;
- :mod:`.plan`: :class:`~.plan.Plan`, the report users read, assembled from the
  scheduled tasks.
"""
