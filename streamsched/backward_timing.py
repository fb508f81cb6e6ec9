"""How long the backward of one call takes: the training half of the ``auto`` trial.

A schedule's cost can sit in backward (a fused group's gradient routing, a stacked
parameter's gather, streams the engine must join), and a trial that times forwards only
can keep a schedule that makes the training step slower than the model as written. So
when a trial call's output carries gradients, its backward is timed too, from the moment
the first gradient reaches the call's outputs to the moment the last gradient of what the
call read that wants one (its inputs and the model's parameters) is computed:

- the start: a hook on each output that requires grad (the earliest one counts);
- the end: a hook on each of those inputs and parameters; each firing moves the end,
  and the sample is read at the wrapper's next trial call, when the backward is over.
  (Not ``register_multi_grad_hook``: over leaf tensors it makes ``torch.autograd.grad``
  raise.)

On the CPU, the time the system kept the backward's thread off the cores while it was
ready to run (other processes on a loaded machine: ``_clock``) is taken off, as the
forward's timer does: read once at the start and once when the autograd engine finishes
the backward (a callback it runs then), never per end hook. What waited between the last
end and that callback is not in the span: at most that stretch of the wait is left in,
so the figure never drops below the backward's own time (the wait can only be
under-subtracted). A backward run on another thread than its start's keeps the wall time.

On CUDA the ends are CUDA events recorded on the stream running the hook, and the time
is the device's (``elapsed_time``), read after the last one completed. The hooks sit
only on trial calls, are removed when the sample is read (or given up), and change no
value. Removing them leaves nothing behind: ``Tensor.register_hook`` gives a tensor a
hook dict that autograd calls into on every later backward, even once it is empty
(1-4 us per parameter per backward, for the rest of training), so a dict the sample's
hooks leave empty is taken off the tensor again.

The parameters are hooked once per trial, not per call (:class:`ParameterEnds`):
registering the first hook on a tensor costs 40-50 us (its hook dict), and a model of
4,000 parameters paid 0.2 s for it on every training trial call. The samples of the
trial's calls register with those hooks while they wait for their backward.

Example (what the wrapper does on a trial call)::

    >>> sample = BackwardSample.attach(out, [x, *model.parameters()], device=None)  # doctest: +SKIP
    >>> out.sum().backward()                                                       # doctest: +SKIP
    >>> sample.seconds                                                             # doctest: +SKIP
    0.00042
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Optional, Sequence

import torch

from . import _clock

__all__ = ["BackwardSample", "ParameterEnds", "grad_outputs"]


def grad_outputs(value: Any, out: Optional[list] = None) -> list[torch.Tensor]:
    """The tensors in ``value`` (nested tuples, lists, dicts, ``ModelOutput``-like
    mappings and objects with tensor fields are looked into) that require grad."""
    if out is None:
        out = []
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            grad_outputs(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            grad_outputs(v, out)
    return out


def _remove_hooks(handles: list, hooked: list) -> None:
    """Remove ``handles``; take the hook dicts they leave empty off the (weakly) ``hooked``
    tensors: autograd calls into a tensor's hook dict on every backward, even an empty one
    (1-4 us per parameter per backward, for the rest of training)."""
    for handle in handles:
        handle.remove()
    for ref in hooked:
        t = ref()
        # Emptied by the removals above (no hook of anyone else's in it): off the tensor.
        if t is not None and t._backward_hooks is not None and not t._backward_hooks:
            t._backward_hooks = None


class ParameterEnds:
    """One end hook on each of a model's parameters for a whole trial: each firing is an
    end of every sample registered (:meth:`BackwardSample.attach` with ``ends``), until
    :meth:`remove`. The parameters are held weakly, as the samples hold what they hook."""

    __slots__ = ("_refs", "_handles", "samples", "__weakref__")

    # Read by the fused groups' gradient hand-off, as BackwardSample.backward_timer is.
    backward_timer = True

    def __init__(self, params: Sequence[torch.Tensor]):
        self._refs = [weakref.ref(p) for p in params]
        self.samples: list[BackwardSample] = []
        self._handles = [p.register_hook(self._end) for p in params]

    def __len__(self) -> int:
        return len(self._refs)

    def holds(self, params: Sequence[torch.Tensor]) -> bool:
        """Whether these are exactly the tensors hooked (the same objects, in order)."""
        refs = self._refs
        return len(refs) == len(params) and all(r() is p for r, p in zip(refs, params))

    def _end(self, grad: Any) -> None:
        for sample in self.samples:
            sample._end(grad)

    def remove(self) -> None:
        """Take the hooks off (the trial stopped timing backwards, or ended)."""
        handles, self._handles = self._handles, []
        refs, self._refs = self._refs, []
        self.samples = []
        _remove_hooks(handles, refs)


class BackwardSample:
    """The backward time of one trial call, once its backward ran (module docstring)."""

    __slots__ = ("_started", "_ended", "_handles", "_hooked", "_cuda", "_waited", "_finished", "_ends")

    # Read by the fused groups' gradient hand-off (passes/fusion/params.py, an earlier
    # layer): a parameter hooked only by a sample's timers counts as not hooked.
    backward_timer = True

    def __init__(self, cuda: bool):
        self._started: Any = None  # perf_counter seconds, or a CUDA event
        self._ended: Any = None
        self._handles: list = []
        # The hooked tensors (weakly: a sample must not keep a call's outputs, and the
        # graph behind them, alive), to take their emptied hook dicts off.
        self._hooked: list = []
        self._cuda = cuda
        # CPU: (thread, run-queue ns) read at the start, and (thread, run-queue ns, clock)
        # read when the engine finished the backward.
        self._waited: Any = None
        self._finished: Any = None
        self._ends: Optional[ParameterEnds] = None  # the shared parameter hooks it is in

    @classmethod
    def attach(
        cls,
        output: Any,
        reads: Sequence[torch.Tensor],
        device: Optional[torch.device],
        ends: Optional[ParameterEnds] = None,
    ) -> Optional[BackwardSample]:
        """Hook the backward of a call that returned ``output`` and read ``reads`` (and the
        tensors ``ends`` hooks already: the model's parameters, hooked once per trial);
        ``None`` when nothing of it will take part in a backward."""
        outputs = grad_outputs(output)
        wanted = [t for t in reads if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outputs or not (wanted or ends):
            return None
        sample = cls(device is not None and device.type == "cuda")
        handles, hooked = sample._handles, sample._hooked
        for t in outputs:
            handles.append(t.register_hook(sample._start))
            hooked.append(weakref.ref(t))
        for t in wanted:
            handles.append(t.register_hook(sample._end))
            hooked.append(weakref.ref(t))
        if ends:
            ends.samples.append(sample)
            sample._ends = ends
        return sample

    @property
    def seconds(self) -> Optional[float]:
        """The backward's duration, once it ran (``None`` until then)."""
        if self._started is None or self._ended is None:
            return None
        if self._cuda:
            self._ended.synchronize()
            return self._started.elapsed_time(self._ended) / 1e3
        wall = self._ended - self._started
        waited, finished = self._waited, self._finished
        if waited is None or finished is None or waited[0] != finished[0] or None in (waited[1], finished[1]):
            return wall
        # The wait read spans [start, finish]; the stretch after the last end, at most
        # (finish - end) long, may hold part of it: left in, so none is over-subtracted.
        off = (finished[1] - waited[1]) * 1e-9 - max(finished[2] - self._ended, 0.0)
        return wall - off if off > 0.0 else wall

    def _now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, grad: Any) -> None:
        if self._started is not None:
            return
        self._started = self._now()
        if not self._cuda:
            self._waited = (threading.get_ident(), _clock.runqueue_wait_ns())
        try:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        except RuntimeError:  # not inside a backward the engine runs: the wall time stands
            pass

    def _finish(self) -> None:
        """Run by the autograd engine when the backward is done: the sample's end stops
        here (CPU: with the run-queue reading; CUDA: the mark alone)."""
        if self._cuda:
            self._finished = True
            return
        waited = _clock.runqueue_wait_ns()
        self._finished = (threading.get_ident(), waited, time.perf_counter())

    def _end(self, grad: Any) -> None:
        # The parameters' end hooks are shared by the trial's samples and fire in every
        # backward over the model: another call's (another signature's, in a workload
        # mixing them) before this sample is read. Only its own backward's count.
        if self._finished is not None:
            return
        self._ended = self._now()

    def remove(self) -> None:
        """Take the hooks off (once the sample is read, or given up)."""
        handles, self._handles = self._handles, []
        hooked, self._hooked = self._hooked, []
        _remove_hooks(handles, hooked)
        ends, self._ends = self._ends, None
        if ends is not None and self in ends.samples:
            ends.samples.remove(self)
