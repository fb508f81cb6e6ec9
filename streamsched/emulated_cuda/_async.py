"""The asynchronous mode of the emulated device: kernels queued per stream, run later.

In the default mode every kernel runs when it is issued, and a missing wait is only
*reported* (the race checker). With ``EmulatedCuda(asynchronous=True)`` a kernel issued
on a stream is queued instead, as a GPU queues it, and runs at a synchronisation point,
in a random order that respects only what CUDA guarantees: the order of its stream and
the event waits (``wait_event``/``wait_stream``, device-to-device copy barriers). A
consumer that misses its wait may then run before its producer and read what its input
held before: fresh memory is filled with garbage (NaN for floating point, the largest
value for integers, ``True`` for booleans) when it is allocated, so the mistake shows as a
wrong value, not only as a report.

What a queued kernel needs at issue is its outputs' shapes: the operator runs on meta
tensors of its arguments' geometry (no data), its fresh outputs are allocated (and filled
with garbage), and the work queued runs the operator on the real tensors later and copies
its results into them. Tensors are taken at issue as CUDA takes kernel arguments: by
address and geometry (a later ``resize_``/``set_``/``t_`` of the Python tensor does not
move a queued kernel), host memory by value unless it is pinned (a copy from pageable
memory is staged when it is issued; one from pinned memory reads it when it runs).

Synchronisation points run what they wait for, and only that:
``Stream.synchronize`` and a host read on a stream (``.item()``, ``.cpu()``, a blocking
copy, an output of data-dependent size) the work its stream is ordered after,
``Event.synchronize`` the work before the event, ``torch.cuda.synchronize`` every
stream of the device, leaving the emulated device everything. ``Stream.query`` and
``Event.query`` answer ``False`` while that work is queued (and then run it: a device
polled makes progress), ``True`` after. Work issued from other threads (each entering the
device's modes with :meth:`EmulatedCuda.attach`) joins the same queues.

Kernels that still run when issued (after the work their stream is ordered after): those
whose result the host reads (above), random kernels (they draw from the host generator in
issue order, as the default mode does), kernels without a meta implementation, a copy
to pageable host memory (CUDA makes it synchronous), kernels on a capturing stream (a
capture runs them as the default mode does). :attr:`WorkQueue.immediate` counts the
random ones and those without a meta kernel, by operator. Allocation (``empty``, its
memory filled with garbage) and metadata changes (``set_``, ``resize_``, views, an
output sharing its input's memory that the schema does not declare, as
``_unsafe_view``'s) happen at once and read nothing.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
import torch.utils._pytree as pytree

from ._core import CudaError, _storage, quiet

__all__ = ["WorkQueue", "defer", "garbage_fill", "runs_at_issue", "Immediate"]

_META = torch.device("meta")
_RANDOM = torch.Tag.nondeterministic_seeded
_INPLACE_VIEW = torch.Tag.inplace_view


class _Work:
    __slots__ = ("wid", "stream", "name", "run", "deps", "holds")

    def __init__(self, wid: int, stream: Any, name: str, run: Callable[[], None], deps: frozenset, holds: list):
        self.wid = wid
        self.stream = stream
        self.name = name
        self.run = run
        self.deps = deps
        self.holds = holds


class WorkQueue:
    """The queued kernels of every emulated stream and what orders them.

    ``frontier[stream key]`` is the set of queued work the stream's next kernel must
    follow: the stream's last kernel and the work of every event it waited on since.
    An event takes its stream's frontier when recorded. Work that ran leaves
    :attr:`pending`; a frontier naming it no longer orders anything."""

    def __init__(self, rng: Any):
        self.rng = rng
        self.pending: dict[int, _Work] = {}
        self.frontier: dict[int, frozenset] = {}
        self._wids = itertools.count(1)
        self.deferred = 0
        """How many kernels were queued and ran later."""
        self.holds: dict[int, dict[int, int]] = {}
        """Device memory queued work holds: allocation stream key -> {storage: references}.
        Memory the host has dropped but queued work still uses stays alive until that work
        ran; the emulator counts it as freed by the host (``Emulator._host_released``) when
        only these references and the storage's Python object are left."""
        self.released: set[int] = set()
        """Storages freed by the host while queued work held them."""
        self.immediate: dict[str, int] = {}
        """Kernels that ran when issued though the host did not wait for them (random
        kernels, kernels without a meta kernel), by operator."""

    # --- ordering ------------------------------------------------------------------------

    def _live(self, marks: frozenset) -> frozenset:
        pending = self.pending
        return frozenset(w for w in marks if w in pending)

    def issue(self, stream: Any, name: str, run: Callable[[], None], holds: Optional[list] = None) -> int:
        """Queue ``run`` on ``stream``; ``holds``: the (allocation stream key, storage) of
        each reference to device memory it keeps."""
        wid = next(self._wids)
        deps = self._live(self.frontier.get(stream.skey, frozenset()))
        holds = holds or []
        for skey, cdata in holds:
            held = self.holds.setdefault(skey, {})
            held[cdata] = held.get(cdata, 0) + 1
        self.pending[wid] = _Work(wid, stream, name, run, deps, holds)
        self.frontier[stream.skey] = frozenset((wid,))
        self.deferred += 1
        return wid

    def marks(self, stream: Any) -> frozenset:
        """What an event recorded on ``stream`` now stands for."""
        return self._live(self.frontier.get(stream.skey, frozenset()))

    def wait(self, stream: Any, marks: frozenset) -> None:
        """``stream``'s later work follows ``marks`` (an event wait, a copy barrier)."""
        live = self._live(marks)
        if live:
            self.frontier[stream.skey] = self._live(self.frontier.get(stream.skey, frozenset())) | live

    def busy(self, marks: frozenset) -> bool:
        """Whether any work ``marks`` stands for is still queued (its dependencies run
        before it, so the marks themselves say)."""
        return any(w in self.pending for w in marks)

    def stream_marks(self, streams: Any) -> frozenset:
        out: frozenset = frozenset()
        for s in streams:
            out = out | self.frontier.get(s.skey, frozenset())
        return out

    # --- running -------------------------------------------------------------------------

    def run_until(self, marks: frozenset) -> None:
        """Run the queued work ``marks`` stands for, and what it follows, in a random
        order consistent with stream order and event waits."""
        pending = self.pending
        todo = [w for w in marks if w in pending]
        if not todo:
            return
        needed: set[int] = set()
        while todo:
            w = todo.pop()
            if w in needed:
                continue
            needed.add(w)
            todo.extend(d for d in pending[w].deps if d in pending and d not in needed)
        self._run(needed)

    def run_all(self) -> None:
        self._run(set(self.pending))

    def _run(self, needed: set[int]) -> None:
        pending = self.pending
        indegree: dict[int, int] = {}
        users: dict[int, list[int]] = {}
        for w in needed:
            deps = [d for d in pending[w].deps if d in needed]
            indegree[w] = len(deps)
            for d in deps:
                users.setdefault(d, []).append(w)
        ready = sorted(w for w, n in indegree.items() if n == 0)
        failed: Optional[tuple[_Work, BaseException]] = None
        rng = self.rng
        while ready:
            w = ready.pop(rng.randrange(len(ready)))
            work = pending.pop(w)
            try:
                work.run()
            except Exception as e:  # noqa: BLE001 - raised at the synchronisation point below
                if failed is None:
                    failed = (work, e)
            for skey, cdata in work.holds:
                held = self.holds[skey]
                held[cdata] -= 1
                if not held[cdata]:
                    del held[cdata]
            work.run = _DONE  # its references go now
            for u in users.get(w, ()):
                indegree[u] -= 1
                if indegree[u] == 0:
                    ready.append(u)
        if failed is not None:
            work, err = failed
            raise CudaError(
                f"CUDA error: a kernel failed asynchronously ({work.name} on the {work.stream.name}), "
                f"reported at this synchronisation: {type(err).__name__}: {err}"
            ) from err


def _DONE() -> None:
    pass


# --- a kernel, queued ------------------------------------------------------------------------


class _Immediate(Exception):
    """The kernel cannot be queued: run it when issued (``view``: it only makes a view,
    reads nothing)."""

    def __init__(self, view: bool = False):
        super().__init__()
        self.view = view


def garbage_fill(t: torch.Tensor) -> None:
    """What uninitialised device memory holds here: NaN, the largest integer, ``True``."""
    if t.numel() == 0:
        return
    dtype = t.dtype
    if dtype.is_floating_point or dtype.is_complex:
        t.fill_(float("nan"))
    elif dtype == torch.bool:
        t.fill_(True)
    else:
        try:
            t.fill_(torch.iinfo(dtype).max)
        except TypeError:
            pass


def _shadow(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory and geometry in a tensor of its own (no autograd, own version
    counter): what a queued kernel holds instead of the Python tensor."""
    return torch.empty(0, dtype=t.dtype).set_(_storage(t), t.storage_offset(), t.shape, t.stride())


_AT_ISSUE: dict[Any, Optional[str]] = {}


def runs_at_issue(func: Any) -> Optional[str]:
    """``"random"`` for a random kernel, ``"view"`` for an in-place metadata change (both
    run when issued), ``None`` for a kernel that is queued."""
    if func in _AT_ISSUE:
        return _AT_ISSUE[func]
    tags = getattr(func, "tags", ())
    found = "view" if _INPLACE_VIEW in tags else "random" if _RANDOM in tags else None
    _AT_ISSUE[func] = found
    return found


_AT_ONCE = "at-once"
_VIEW = "view"
_PLANS: dict[Any, Any] = {}
"""Per operator and argument geometry: what its outputs are (see :func:`_plan`)."""


def _signature(func: Any, flat: list, spec: Any) -> Optional[tuple]:
    """What the meta kernel's answer depends on: the operator, the arguments' structure,
    every tensor's geometry and identity among the arguments, every other value."""
    sig: list[Any] = [func, spec]
    seen: dict[int, int] = {}
    for v in flat:
        if isinstance(v, torch.Tensor):
            first = seen.setdefault(id(v), len(seen))
            if v.layout != torch.strided or v.is_quantized or v.is_nested:
                return None
            sig.append((first, v.dtype, tuple(v.shape), v.stride()))
        else:
            try:
                hash(v)
            except TypeError:
                return None
            sig.append((type(v), v))
    return tuple(sig)


def _plan(func: Any, flat: list, spec: Any) -> Any:
    """Run ``func`` on meta tensors of the arguments' geometry: ``(outputs, out_spec)``,
    each output ``("arg", i)`` (the i-th argument, an in-place or ``out=`` result),
    ``("fresh", shape, stride, dtype)`` or ``("value", v)``; or :data:`_AT_ONCE` /
    :data:`_VIEW` when the kernel cannot be queued."""
    metas: dict[int, torch.Tensor] = {}
    index_of: dict[int, int] = {}
    in_storages: set[int] = set()
    mflat: list[Any] = []
    for i, v in enumerate(flat):
        if isinstance(v, torch.Tensor):
            m = metas.get(id(v))
            if m is None:
                if v.layout != torch.strided or v.is_quantized or v.is_nested:
                    return _AT_ONCE
                m = metas[id(v)] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=_META)
                index_of[id(m)] = i
                in_storages.add(m.untyped_storage()._cdata)
            mflat.append(m)
        elif isinstance(v, torch.device) and v.type == "cpu":
            mflat.append(_META)
        elif isinstance(v, torch.Generator):
            return _AT_ONCE
        else:
            mflat.append(v)
    margs, mkwargs = pytree.tree_unflatten(mflat, spec)
    try:
        mout = func(*margs, **mkwargs)
    except Exception:  # noqa: BLE001 - no meta kernel, a data-dependent shape: run it now
        return _AT_ONCE
    out_flat, out_spec = pytree.tree_flatten(mout)
    outputs: list[tuple] = []
    for leaf in out_flat:
        if not isinstance(leaf, torch.Tensor):
            outputs.append(("value", leaf))
            continue
        i = index_of.get(id(leaf))
        if i is not None:
            real = flat[i]
            if real.shape != leaf.shape or real.stride() != leaf.stride():
                return _AT_ONCE  # an out= argument resized: its shape changes now
            outputs.append(("arg", i))
        elif leaf.untyped_storage()._cdata in in_storages:
            return _VIEW  # a view the schema does not declare (_unsafe_view)
        else:
            outputs.append(("fresh", tuple(leaf.shape), leaf.stride(), leaf.dtype))
    return outputs, out_spec


def defer(emu: Any, stream: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Queue ``func`` on ``stream`` and return its outputs (fresh ones allocated now,
    filled with garbage until the kernel runs). Raises :class:`_Immediate` when the
    kernel must run now instead (see the module docstring)."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    with quiet():
        key = _signature(func, flat, spec)
        plan = _PLANS.get(key) if key is not None else None
        if plan is None:
            plan = _plan(func, flat, spec)
            if key is not None:
                if len(_PLANS) > 8192:
                    _PLANS.clear()
                _PLANS[key] = plan
        if plan is _AT_ONCE:
            raise _Immediate
        if plan is _VIEW:
            raise _Immediate(view=True)
        outputs, out_spec = plan
        outs: list[Any] = []
        fresh: list[tuple[int, torch.Tensor]] = []
        holds: list[tuple[int, int]] = []
        for i, desc in enumerate(outputs):
            if desc[0] == "arg":
                outs.append(flat[desc[1]])
            elif desc[0] == "fresh":
                t = torch.empty_strided(desc[1], desc[2], dtype=desc[3])
                garbage_fill(t)
                outs.append(t)
                shadow = _shadow(t)
                fresh.append((i, shadow))
                holds.append((stream.skey, shadow.untyped_storage()._cdata))
            else:
                outs.append(desc[1])
        held: list[Any] = []
        for v in flat:
            if not isinstance(v, torch.Tensor):
                held.append(v)
                continue
            block = emu.block_of(v)
            if block is not None or emu.is_pinned(v):
                try:
                    held.append(_shadow(v))
                except (RuntimeError, NotImplementedError):
                    held.append(v)
                    continue
                if block is not None:
                    holds.append((block.alloc.skey, block.cdata))
            else:
                held.append(v.clone())  # pageable host memory: staged when the kernel is issued
        dargs, dkwargs = pytree.tree_unflatten(held, spec)
    exclude = torch._C._dispatch_tls_local_exclude_set()

    def run() -> None:
        with quiet(), torch._C._ExcludeDispatchKeyGuard(exclude):
            result = func(*dargs, **dkwargs)
            if fresh:
                flat_result = pytree.tree_leaves(result)
                for i, target in fresh:
                    value = flat_result[i]
                    if value.shape != target.shape and value.numel() == 0:
                        # The host kernel leaves empty what the meta kernel sizes (the
                        # saved statistics of an evaluation-mode batch norm): nothing
                        # reads it.
                        continue
                    target.copy_(value)

    emu.work.issue(stream, str(func), run, holds)
    return pytree.tree_unflatten(outs, out_spec)


Immediate = _Immediate
