"""The frontend: from a call of the user's model to a traced graph and what it does.

- :mod:`.binder`, :mod:`.trace`: bind a call to ``forward``'s signature and trace it with
  ``torch.fx`` (branches and opaque submodules stay single nodes) into a
  :class:`~.trace.Traced`;
- :mod:`.meta`: run the traced graph once, node by node, recording each value's shape,
  dtype and device (:class:`~.meta.ValueMeta`);
- :mod:`.effects`: during that run, which storages each node reads and writes in place
  (:class:`~.effects.Effects`);
- :mod:`.trace_guard`, :mod:`.output_tree`, :mod:`.nodes`: no side effects while
  tracing, the output's container types, and what the later layers ask of an fx node.

Nothing here knows about tasks, streams or executors.
"""
