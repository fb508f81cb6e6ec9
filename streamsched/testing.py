"""Tools for testing code that uses streamsched (and streamsched itself).

- :func:`check_happens_before`: replay a :class:`SyncLog` and report every read not
  ordered after its write, every wait on an unrecorded event, every release of memory
  another stream may still read, and a missing join.
- :func:`assert_schedule_clean`: run a wrapped module once with logging and fail with a
  readable message if the checker finds anything.

Example::

    >>> sm = StreamScheduledModule(model, sync_log=True)      # doctest: +SKIP
    >>> sm(x); sm(x)                                            # doctest: +SKIP
    >>> check_happens_before(sm.last_sync_log)                  # doctest: +SKIP
    []
"""

from __future__ import annotations

from typing import Any

from .runtime.synclog import Race, SyncEntry, SyncLog, check_happens_before

__all__ = ["check_happens_before", "assert_schedule_clean", "SyncLog", "SyncEntry", "Race"]


def assert_schedule_clean(module: Any, *args: Any, **kwargs: Any) -> SyncLog:
    """Call ``module`` (a StreamScheduledModule built with ``sync_log=True``) twice (the
    first call plans) and raise ``AssertionError`` listing every problem in the log."""
    module(*args, **kwargs)
    module(*args, **kwargs)
    log = module.last_sync_log
    if log is None:
        raise AssertionError("no SyncLog recorded: build the module with sync_log=True")
    names = {t.id: t.name for t in module.plan.tasks} if module.plan else {}
    races = check_happens_before(log, names)
    if races:
        raise AssertionError("schedule problems:\n  " + "\n  ".join(map(str, races)))
    return log
