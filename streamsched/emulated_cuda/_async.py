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
issue order, as the default mode does), kernels without a meta implementation or whose
outputs share memory with their inputs undeclared, a copy to pageable host memory (CUDA
makes it synchronous), kernels on a capturing stream (a capture runs them as the default
mode does). Allocation (``empty``) and metadata changes (``set_``, ``resize_``, views)
happen at once.
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
    __slots__ = ("wid", "stream", "name", "run", "deps")

    def __init__(self, wid: int, stream: Any, name: str, run: Callable[[], None], deps: frozenset):
        self.wid = wid
        self.stream = stream
        self.name = name
        self.run = run
        self.deps = deps


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
        self.immediate: dict[str, int] = {}
        """Kernels that ran when issued (see the module docstring), by operator."""

    # --- ordering ------------------------------------------------------------------------

    def _live(self, marks: frozenset) -> frozenset:
        pending = self.pending
        return frozenset(w for w in marks if w in pending)

    def issue(self, stream: Any, name: str, run: Callable[[], None]) -> int:
        wid = next(self._wids)
        deps = self._live(self.frontier.get(stream.skey, frozenset()))
        self.pending[wid] = _Work(wid, stream, name, run, deps)
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


def defer(emu: Any, stream: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Queue ``func`` on ``stream`` and return its outputs (fresh ones allocated now,
    filled with garbage until the kernel runs). Raises :class:`_Immediate` when the
    kernel must run now instead (see the module docstring)."""
    metas: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    in_storages: set[int] = set()

    def to_meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            found = metas.get(id(v))
            if found is not None:
                return found[1]
            if v.layout != torch.strided or v.is_quantized or v.is_nested:
                raise _Immediate
            m = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=_META)
            metas[id(v)] = (v, m)
            in_storages.add(m.untyped_storage()._cdata)
            return m
        if isinstance(v, torch.device) and v.type == "cpu":
            return _META
        if isinstance(v, torch.Generator):
            raise _Immediate
        return v

    with quiet():
        try:
            margs = pytree.tree_map(to_meta, args)
            mkwargs = pytree.tree_map(to_meta, kwargs)
            mout = func(*margs, **mkwargs)
        except _Immediate:
            raise
        except Exception as e:  # noqa: BLE001 - no meta kernel, data-dependent shape: run now
            raise _Immediate from e
        real_of = {id(m): v for v, m in metas.values()}
        flat, spec = pytree.tree_flatten(mout)
        outs: list[Any] = []
        fresh: list[tuple[int, torch.Tensor]] = []
        for i, leaf in enumerate(flat):
            if not isinstance(leaf, torch.Tensor):
                outs.append(leaf)
                continue
            real = real_of.get(id(leaf))
            if real is not None:
                if real.shape != leaf.shape or real.stride() != leaf.stride():
                    raise _Immediate  # an out= argument resized: its shape changes now
                outs.append(real)
                continue
            if leaf.untyped_storage()._cdata in in_storages:
                raise _Immediate(view=True)  # a view the schema does not declare (_unsafe_view)
            t = torch.empty_strided(leaf.shape, leaf.stride(), dtype=leaf.dtype)
            garbage_fill(t)
            outs.append(t)
            fresh.append((i, _shadow(t)))

        def held(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if emu.block_of(v) is not None or emu.is_pinned(v):
                try:
                    return _shadow(v)
                except (RuntimeError, NotImplementedError):
                    return v
            return v.clone()  # pageable host memory: staged when the kernel is issued

        dargs = pytree.tree_map(held, args)
        dkwargs = pytree.tree_map(held, kwargs)
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

    emu.work.issue(stream, str(func), run)
    return pytree.tree_unflatten(outs, spec)


Immediate = _Immediate
