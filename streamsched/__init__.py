"""streamsched: run the independent parts of a PyTorch model side by side on one GPU.

Wrap a model and call it as before::

    import streamsched as ss
    sm = ss.StreamScheduledModule(model)      # defaults are good
    y = sm(x)                                 # same result as model(x), forward and backward
    print(sm.plan)                            # what ran where, and why

See ``SchedulerConfig`` for the options and ``@streamsched.branch`` to mark the parts of
a model that tracing should treat as opaque tasks.
"""

from __future__ import annotations

from ._native import runtime_info
from ._version import __version__
from .branch import branch
from .config import SchedulerConfig
from .errors import (
    ConfigError,
    ExtensionError,
    HooksWarning,
    PlanError,
    ProfileMismatchError,
    StreamSchedError,
    TraceError,
    UntraceableWarning,
)
from .module import StreamScheduledModule
from .observe import Timeline, timeline
from .planning.plan import FusedGroupInfo, Plan, PlannedTask
from .prefetch import Prefetcher

__all__ = [
    "StreamScheduledModule",
    "SchedulerConfig",
    "runtime_info",
    "timeline",
    "Prefetcher",
    "Timeline",
    "branch",
    "Plan",
    "PlannedTask",
    "FusedGroupInfo",
    "StreamSchedError",
    "ConfigError",
    "TraceError",
    "UntraceableWarning",
    "HooksWarning",
    "PlanError",
    "ExtensionError",
    "ProfileMismatchError",
    "__version__",
]
