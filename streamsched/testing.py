"""Tools for testing code that uses streamsched (and streamsched itself).

- :func:`check_happens_before`: replay a :class:`SyncLog` and report every read not
  ordered after its write, every wait on an unrecorded event, every release of memory
  another stream may still read, and a missing join.
- :func:`assert_schedule_clean`: run a wrapped module once with logging and fail with a
  readable message if the checker finds anything.
- :func:`last_path` / :func:`assert_path`: which way a wrapped module's most recent call
  ran: ``"recorded"`` (the first call of a signature, run node by node while shapes and
  effects are recorded), ``"plan:serial"`` / ``"plan:threads"`` / ``"plan:streams"`` (the
  compiled schedule on that executor), ``"graph"`` (a CUDA graph replay), ``"as-written"``
  (the model's own forward) or ``"eager-dispatch"`` (an untraceable forward run with its
  ``@streamsched.branch`` calls dispatched). A test comparing a call with eager asserts the
  path, so that a check of the schedule cannot land on the fallback unnoticed.

Example::

    >>> sm = StreamScheduledModule(model, sync_log=True)      # doctest: +SKIP
    >>> sm(x); sm(x)                                            # doctest: +SKIP
    >>> check_happens_before(sm.last_sync_log)                  # doctest: +SKIP
    []
"""

from __future__ import annotations

from typing import Any

from .runtime.synclog import Race, SyncEntry, SyncLog, check_happens_before

__all__ = [
    "check_happens_before",
    "assert_schedule_clean",
    "last_path",
    "in_trial",
    "assert_path",
    "PATHS",
    "SyncLog",
    "SyncEntry",
    "Race",
]

# Every value :func:`last_path` can return.
PATHS = ("recorded", "plan:serial", "plan:threads", "plan:streams", "graph", "as-written", "eager-dispatch")


def last_path(module: Any) -> str:
    """Which way the most recent call of ``module`` (a StreamScheduledModule) ran: one of
    :data:`PATHS`, or ``""`` before the first call.

    Example::

        >>> sm = StreamScheduledModule(model, executor="serial")   # doctest: +SKIP
        >>> sm(x); last_path(sm)                                     # doctest: +SKIP
        'recorded'
        >>> sm(x); last_path(sm)                                     # doctest: +SKIP
        'plan:serial'
    """
    return module._ss.last_path


def in_trial(module: Any) -> bool:
    """Whether the most recent call of ``module`` (a StreamScheduledModule) ran under the
    ``auto`` executor trial of its signature: the calls after planning that time the ways
    to run the plan (each way in turn) before one is kept.

    Example::

        >>> while in_trial(sm):   # doctest: +SKIP
        ...     sm(x)             # the calls after this one run what the trial kept
    """
    compiled = module._ss.last
    return compiled is not None and getattr(compiled, "trial", None) is not None


def assert_path(module: Any, *expected: str) -> str:
    """Raise ``AssertionError`` unless the most recent call of ``module`` ran one of
    ``expected`` (a prefix such as ``"plan"`` matches every executor); returns the path."""
    path = last_path(module)
    if not any(path == e or path.startswith(e + ":") for e in expected):
        raise AssertionError(f"the last call ran {path!r}, expected {' or '.join(map(repr, expected))}")
    return path


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
