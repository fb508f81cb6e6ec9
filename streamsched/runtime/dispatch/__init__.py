"""Eager dispatch: run a model that cannot be traced, with its branch calls launched side by side.

When ``torch.fx`` cannot trace a model (``if x.sum() > 0:``, ``.item()``, lists whose length
depends on data) and the wrapper was built with ``strict=False``, each call runs the
model's own ``forward`` in the calling thread. Every call of a ``@streamsched.branch``
function or method made during that forward is *launched* instead of run inline, and
returns at once a :class:`PendingValue` that stands for the branch's result:

- CPU: the branch runs on a small pool of worker threads (lanes ``1..k``; the caller is
  lane 0). Grad mode, inference mode and autocast are carried into the lane. The pending
  value waits for the branch the first time it is used. ``executor="threads"`` always
  does this; ``"auto"`` first times a few calls inline and on lanes and keeps the faster
  (see :class:`~streamsched.planning.choice.LaneHistory`); ``"serial"`` runs every branch
  inline, as eager does.
- CUDA: the branch is issued at once from the calling thread onto a pool stream that
  first waits for the caller's stream; an event is recorded after it. The first use on
  a stream makes that stream wait on the event and ``record_stream``s the result there.

A pending value is used like the value itself: it speaks the ``__torch_function__``
protocol (``torch.cat([a, b])``, ``self.head(a)``), forwards attributes (``a.shape``,
``a.relu()``), operators, indexing, iteration, ``bool``/``float``/``int``. Indexing a
pending tuple (``out[0]``) stays pending; unpacking one (``a, b = branch(x)``) stays
pending when the branch's result is on CUDA or its return annotation is a fixed-length
``tuple[...]``, and waits for the branch otherwise.

Before the call returns, every pending value in the forward's output is resolved, every
branch launched in the call is joined, and the earliest failing branch's exception
(the one eager execution would have met first) is raised.

Two hazards of running a branch beside the code after its call are handled:

- the forward writing in place to a tensor a running branch reads (``h.relu_()`` after
  ``self.tower(h)``): a ``TorchFunctionMode`` sees the write and waits for that branch
  first, as eager order requires;
- a branch writing in place to one of its own arguments: the code after its call may
  already have read the old value, so this is an :class:`EagerDispatchError` that names
  the branch.

Each call records a :class:`~streamsched.planning.plan.Plan` (``mode="eager-dispatch"``: one task
per launched branch, with its lane or stream) and, with ``sync_log=True``, a
:class:`~streamsched.runtime.synclog.SyncLog` of every fork, launch, record, wait and
join, which :func:`~streamsched.runtime.synclog.check_happens_before` can replay.

The wrapper hands each call a :class:`DispatchContext` (the model, its configuration, the
call's number and observer, and what dispatch keeps between calls) and records what
:func:`run_eager_dispatch` returns (:class:`DispatchResult`: the output or the exception
to raise, the call's :class:`EagerSchedule`, its SyncLog).

The package, one job per module, each importing only the ones listed after it:

- :mod:`.dispatch`: :func:`run_eager_dispatch`, the flow of one call from start to join;
- :mod:`.call`: ``_EagerCall``, the state of one call, installed as the branch launcher:
  it routes each branch call and gives pending values their results;
- :mod:`.launchers`: launching onto CPU lanes and onto streams, and joining them;
- :mod:`.body`: running a branch's body, with the checks every launch makes;
- :mod:`.calllog`: the call's SyncLog entries and the ids (slots) they name values by;
- :mod:`.reported_plan`: the :class:`~streamsched.planning.plan.Plan` a call reports (:class:`EagerSchedule`);
- :mod:`.policy`: how a call runs its branches (inline, lanes or streams);
- :mod:`.dispatch_context`: :class:`DispatchContext`;
- :mod:`.writes`: the forward's in-place writes that could race a running branch;
- :mod:`.pending`: :class:`PendingValue` and :func:`resolve`;
- :mod:`.launch`: the book-keeping of one launched branch;
- :mod:`.values`: the walkers over call arguments, and which memory a tensor is;
- :mod:`.stream_backends`: the stream backends (:mod:`streamsched.runtime.backends`) branches go to;
- :mod:`.lane_pool`: the pool of CPU worker lanes;
- :mod:`.dispatch_errors`: :class:`EagerDispatchError`.

Example::

    >>> import torch, streamsched as ss
    >>> from torch import nn
    >>> class Gate(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
    ...     @ss.branch
    ...     def tower(self, layer, x):
    ...         return torch.tanh(layer(x))
    ...     def forward(self, x):
    ...         if x.sum() > 0:                       # fx cannot trace this
    ...             return self.tower(self.a, x) + self.tower(self.b, x)
    ...         return self.tower(self.a, x)
    >>> sm = ss.StreamScheduledModule(Gate(), strict=False)
    >>> y = sm(torch.randn(2, 4).abs())
    >>> sm.plan.mode
    'eager-dispatch'
"""

from .dispatch import DispatchResult, run_eager_dispatch
from .dispatch_context import DispatchContext
from .dispatch_errors import EagerDispatchError
from .pending import PendingValue, resolve
from .reported_plan import EagerSchedule

__all__ = [
    "run_eager_dispatch",
    "DispatchContext",
    "DispatchResult",
    "resolve",
    "PendingValue",
    "EagerSchedule",
    "EagerDispatchError",
]
