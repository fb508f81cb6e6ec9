"""The two PyTorch modes of the emulated device.

- :class:`PlacementMode` (a ``TorchFunctionMode``) sees calls before autograd: device
  arguments (``device="cuda:1"``, ``.to("cuda")``, ``.cuda()``, ``.cpu()``) are
  rewritten to the CPU, and the device they named is handed down to the kernel mode.
- :class:`KernelMode` (a ``TorchDispatchMode``) sees every kernel: it runs it on the CPU
  tensors, registers the storages it allocates as memory of the emulated device, and
  tells the emulator which stream launched it and which storages it read and wrote
  (from the operator schema: ``alias_info.is_write`` marks a written argument, a return
  without alias information is fresh memory the kernel writes, an argument aliased by a
  return and not written is only looked at).
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ._async import Immediate, defer, garbage_fill, runs_at_issue
from ._core import Emulator, _Block, _Stream, quiet, storage_id, tensors_in
from ._timing import kernel_us

aten = torch.ops.aten

_CPU = torch.device("cpu")
_ACCUMULATE = (aten.add.Tensor, aten.add_.Tensor)
_GRAPH_TASK = torch._C._current_graph_task_id
_GRAD_ENABLED = torch.is_grad_enabled

# --- operator facts, cached per overload --------------------------------------------------

_ALLOC_ONLY = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "empty_permuted"}
# Kernels whose result the host must see before it can go on: a copy to the host and a
# stream synchronisation, as PyTorch does on CUDA (outputs of data-dependent size, values
# returned to Python).
_HOST_SYNC = {
    "_local_scalar_dense",
    "equal",
    "is_nonzero",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "bincount",
    "allclose",
}
# Operators that may legitimately mix devices (copies, indexing with host indices).
_MIXED_OK_PREFIXES = ("copy", "_copy", "_to_copy", "index", "_index", "set_", "record_stream", "_foreach", "lift")


class _OpInfo:
    __slots__ = ("args", "view_only", "alloc_only", "has_device", "sync", "name", "mixed_ok", "foreach_writes")

    def __init__(self, func: Any):
        schema = func._schema
        base = schema.name.split("::")[-1]
        self.name = str(func)
        self.args: list[tuple[str, str]] = []
        writes = False
        for a in schema.arguments:
            ai = a.alias_info
            if ai is not None and ai.is_write:
                kind = "w"
                writes = True
            elif ai is not None:
                kind = "m"
            else:
                kind = "r"
            self.args.append((a.name, kind))
        returns = list(schema.returns)
        self.view_only = bool(returns) and not writes and all(r.alias_info is not None for r in returns)
        self.alloc_only = base in _ALLOC_ONLY
        self.has_device = any(a.name == "device" for a in schema.arguments)
        self.sync = base in _HOST_SYNC or (base == "repeat_interleave" and schema.overload_name == "Tensor")
        self.mixed_ok = base.startswith(_MIXED_OK_PREFIXES)
        self.foreach_writes = writes and base.startswith("_foreach_")


_INFO: dict[Any, _OpInfo] = {}


def _info(func: Any) -> _OpInfo:
    info = _INFO.get(func)
    if info is None:
        info = _INFO[func] = _OpInfo(func)
    return info


def _accesses(info: _OpInfo, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    reads: list[torch.Tensor] = []
    writes: list[torch.Tensor] = []
    n = len(args)
    for i, (name, kind) in enumerate(info.args):
        if kind == "m":
            continue
        v = args[i] if i < n else kwargs.get(name)
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            (writes if kind == "w" else reads).append(v)
        elif isinstance(v, (list, tuple)):
            for t in v:
                if isinstance(t, torch.Tensor):
                    (writes if kind == "w" else reads).append(t)
    return reads, writes


def _blocks(emu: Emulator, tensors: list[torch.Tensor]) -> list[_Block]:
    out = []
    for t in tensors:
        b = emu.block_of(t)
        if b is not None:
            out.append(b)
    return out


# --- the kernel mode ------------------------------------------------------------------------


class KernelMode(TorchDispatchMode):
    def __init__(self, emu: Emulator):
        super().__init__()
        self.emu = emu

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        with _NO_TORCH_FUNCTION():
            handler = _SPECIAL.get(func) or _generic
            if _info(func).foreach_writes:
                return _foreach_in_place(handler, self.emu, func, args, kwargs)
            return handler(self.emu, func, args, kwargs)


def _foreach_in_place(handler: Any, emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    """An in-place ``_foreach_`` op (``_foreach_add_``, SGD's and Adam's default step on
    CUDA) moves the version counter of every tensor it writes, as it does on the CPU and
    on CUDA. Run below a dispatch mode it moved none (its per-tensor fallback runs under
    the version-counting layer): a guard reading a counter (a kept view of a weight an
    optimizer steps) saw no change on the emulated device where a GPU shows one."""
    written = [t for t in _accesses(_info(func), args, kwargs)[1] if not t.is_inference()]
    before = [t._version for t in written]
    out = handler(emu, func, args, kwargs)
    for t, version in zip(written, before):
        if t._version == version:
            _increment_version(t)
    return out


# TorchDispatchMode wraps __torch_dispatch__ in dynamo's "disable" per subclass; the mode
# never runs under dynamo, and the wrapper is a large share of the per-kernel cost.
KernelMode.__torch_dispatch__ = (
    KernelMode.__dict__["__torch_dispatch__"].__wrapped__
    if hasattr(KernelMode.__dict__["__torch_dispatch__"], "__wrapped__")
    else KernelMode.__dict__["__torch_dispatch__"]
)
_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_increment_version = torch.autograd.graph.increment_version


def _device_of_inputs(emu: Emulator, info: _OpInfo, tensors: list[torch.Tensor]) -> Optional[int]:
    found: Optional[int] = None
    host = None
    for t in tensors:
        d = emu.device_of(t)
        if d is None:
            if t.dim() > 0 and host is None and t.device.type == "cpu":
                host = t
            continue
        if found is None:
            found = d
        elif d != found and not info.mixed_ok:
            raise RuntimeError(
                f"Expected all tensors to be on the same device, but found at least two devices, "
                f"cuda:{found} and cuda:{d}! ({info.name})"
            )
    if found is not None and host is not None and not info.mixed_ok:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"cuda:{found} and cpu! ({info.name})"
        )
    return found


def _target_index(emu: Emulator) -> Optional[int]:
    t = emu.target()
    return t.index if t is not None and t.type == "cuda" else None


def _generic(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    info = _info(func)
    dev: Optional[int] = None
    placed = False  # the call says where its result goes
    device_arg = kwargs.get("device")
    if isinstance(device_arg, torch.device) and device_arg.type == "cuda":
        dev = emu.resolve(device_arg).index
        kwargs = dict(kwargs, device=_CPU)
        placed = True
    elif info.has_device and emu.target() is not None:
        # A device argument saying CPU: with the caller's intent known (the call named a
        # device, or C++ built the tensor with the options of the call's tensors), that.
        dev = _target_index(emu)
        placed = True
    elif isinstance(device_arg, torch.device):
        placed = True  # an explicit CPU device from code the placement mode did not see
    pinned = bool(kwargs.get("pin_memory"))
    if pinned:
        kwargs = dict(kwargs, pin_memory=False)
    reads, writes = _accesses(info, args, kwargs)
    if dev is None and not placed:
        tensors = tensors_in(kwargs, tensors_in(args))
        dev = _device_of_inputs(emu, info, tensors)
        if dev is None and not tensors:
            dev = _target_index(emu)
    if dev is None:
        if pinned:
            emu.unsafe("cudaHostAlloc")
        out = func(*args, **kwargs)
        if pinned:
            for t in tensors_in(out):
                emu.mark_pinned(t)
        return out
    if info.view_only:
        return func(*args, **kwargs)
    stream = emu.current_stream(dev)
    if func in _ACCUMULATE and emu.backward is not None:
        # The engine adding a second gradient into a node's input slot runs the add on the
        # slot's accumulation stream, after InputBuffer::add's waits (_autograd).
        found = emu.backward.accumulation(args)
        if found is not None:
            slot, stream = found
            out = kernel(emu, stream, func, args, kwargs, reads, writes, dev)
            emu.backward.accumulated(slot)
            return out
    return kernel(emu, stream, func, args, kwargs, reads, writes, dev, alloc_only=info.alloc_only, sync=info.sync)


def kernel(
    emu: Emulator,
    stream: _Stream,
    func: Any,
    args: tuple,
    kwargs: dict,
    reads: list[torch.Tensor],
    writes: list[torch.Tensor],
    out_device: Optional[int],
    alloc_stream: Optional[_Stream] = None,
    alloc_only: bool = False,
    sync: bool = False,
    unsafe: Optional[str] = None,
    at_once: bool = False,
) -> Any:
    """Run one kernel launched on ``stream`` and account for it (see the module docstring).
    In the asynchronous mode (``_async``) the kernel is queued unless ``sync`` (the host
    reads its result) or ``at_once`` (a copy CUDA completes before returning)."""
    cap = emu._check_valid(stream)
    if cap is None and stream.device in emu.generators_capturing:
        if runs_at_issue(func) == "random":
            # CUDAGeneratorState::increase: the generator was left in capture mode by a
            # capture that failed after capture_begin; every random kernel now fails.
            raise RuntimeError("Offset increment outside graph capture encountered unexpectedly.")
    if sync:
        emu.unsafe(f"{func} (a copy to the host and a stream synchronisation)", (stream,))
    elif unsafe is not None:
        emu.unsafe(unsafe, (stream,))
    rb = _blocks(emu, reads)
    wb = _blocks(emu, writes)
    if cap is not None:
        emu.snapshot(cap, wb)
    if emu.work is not None and cap is None:
        out = _queued(emu, stream, func, args, kwargs, out_device, alloc_only, sync or at_once)
    else:
        out = func(*args, **kwargs)
    # Simulated time (_timing): only while a timeline records, or for a captured kernel
    # (its replay takes the captured kernels' time).
    duration = 0.0
    if not alloc_only and (cap is not None or emu.clocks.timing):
        duration = kernel_us(func, args, reads, writes, tensors_in(out))
    if _GRAPH_TASK() >= 0 and emu.backward is not None:
        emu.backward.counted(stream)
    with emu.lock:
        new = emu.adopt(out, out_device, alloc_stream or stream) if out_device is not None else []
        if not alloc_only:
            wb = wb + new
        emu.rekey(wb)
        emu.launch(stream, rb, wb, str(func), duration, host_reads=sync)
        if cap is not None and not alloc_only:
            fresh = None
            if new:
                ids = {b.cdata for b in new}
                fresh = {i for i, t in enumerate(tensors_in(out)) if storage_id(t) in ids}
            emu.record_node(cap, stream, func, args, kwargs, out, rb, wb, fresh, duration)
        if sync:
            emu.checker._handle_stream_synchronization(stream.skey)
    return out


def _queued(
    emu: Emulator,
    stream: _Stream,
    func: Any,
    args: tuple,
    kwargs: dict,
    out_device: Optional[int],
    alloc_only: bool,
    host_waits: bool,
) -> Any:
    """The asynchronous mode (``_async``): queue the kernel on ``stream``, or run it now
    where it cannot wait (after the work its stream is ordered after, where it reads)."""
    work = emu.work
    if alloc_only:
        out = func(*args, **kwargs)
        if out_device is not None:
            with quiet():
                for t in tensors_in(out):
                    garbage_fill(t)
        return out
    kind = None if host_waits else runs_at_issue(func)
    if kind == "view":
        return func(*args, **kwargs)
    if kind is None and not host_waits:
        try:
            with emu.lock:
                return defer(emu, stream, func, args, kwargs)
        except Immediate as e:
            if e.view:
                return func(*args, **kwargs)
    if not host_waits:
        name = str(func)
        work.immediate[name] = work.immediate.get(name, 0) + 1
    emu.run_queued(stream)
    return func(*args, **kwargs)


# --- special kernels ------------------------------------------------------------------------


def _record_stream(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    t, s = args
    emu.record_stream(t, emu.stream(s.device_index, s.stream_id))
    return None


def _metadata(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    """``set_``/``resize_``: metadata only (a resize may move the storage)."""
    out = func(*args, **kwargs)
    b = emu.block_of(args[0])
    if b is not None:
        emu.rekey([b])
    return out


def _barrier(emu: Emulator, waiter: _Stream, on: _Stream) -> None:
    eid = next(emu._eids)
    emu.checker._handle_event_creation(eid)
    emu.checker._handle_event_record(eid, on.skey)
    emu.checker._handle_event_wait(eid, waiter.skey)
    emu.checker._handle_event_deletion(eid)
    emu.clocks.wait(waiter.skey, emu.clocks.at(on.skey))
    if emu.work is not None:
        emu.work.wait(waiter, emu.work.marks(on))


def _copy_between(
    emu: Emulator,
    func: Any,
    args: tuple,
    kwargs: dict,
    src: Optional[int],
    dst: Optional[int],
    src_tensor: torch.Tensor,
    dst_tensor: Optional[torch.Tensor],
    non_blocking: bool,
) -> Any:
    """A copy between the host and a device, or between two devices, as PyTorch's copy
    kernel does it (host copies synchronise the stream unless ``non_blocking``; copies
    from pageable host memory cannot be captured; device-to-device copies put a two-way
    barrier between the two devices' current streams)."""
    writes = [dst_tensor] if dst_tensor is not None else []
    if src is None:  # host to device
        stream = emu.current_stream(dst)
        pinned = emu.is_pinned(src_tensor)
        unsafe = None if (non_blocking and pinned) else "a copy from pageable host memory"
        if stream.capture is None and unsafe is not None:
            unsafe = None  # allowed outside capture: only the synchronisation below matters
        return kernel(emu, stream, func, args, kwargs, [], writes, dst, sync=not non_blocking, unsafe=unsafe)
    if dst is None:  # device to host
        stream = emu.current_stream(src)
        unsafe = "a copy to pageable host memory" if stream.capture is not None else None
        # A non-blocking copy into pageable memory returns once it is done (CUDA stages
        # it); into pinned memory (``.to("cpu", non_blocking=True)`` pins its result) it
        # completes when the stream gets to it.
        at_once = dst_tensor is not None and not emu.is_pinned(dst_tensor)
        return kernel(
            emu,
            stream,
            func,
            args,
            kwargs,
            [src_tensor],
            writes,
            None,
            sync=not non_blocking,
            unsafe=unsafe,
            at_once=at_once,
        )
    s_src, s_dst = emu.current_stream(src), emu.current_stream(dst)
    _barrier(emu, s_src, s_dst)
    out = kernel(emu, s_src, func, args, kwargs, [src_tensor], writes, dst, alloc_stream=s_dst)
    _barrier(emu, s_dst, s_src)
    return out


def _to_copy(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    x = args[0]
    src = emu.device_of(x)
    target = emu.target()
    kd = kwargs.get("device")
    if isinstance(kd, torch.device) and kd.type == "cuda":
        target = emu.resolve(kd)
        kwargs = dict(kwargs, device=_CPU)
    if target is None:
        dst = src
    else:
        dst = target.index if target.type == "cuda" else None
    pin = bool(kwargs.get("pin_memory"))
    if pin:
        kwargs = dict(kwargs, pin_memory=False)
    non_blocking = bool(kwargs.get("non_blocking", False))
    if src == dst:
        if src is None:
            out = func(*args, **kwargs)
        else:
            out = kernel(emu, emu.current_stream(src), func, args, kwargs, [x], [], src)
    else:
        out = _copy_between(emu, func, args, kwargs, src, dst, x, None, non_blocking)
    if dst is None and (pin or (non_blocking and src is not None and emu.work is not None)):
        emu.mark_pinned(out)
    return out


def _copy_(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    dst_t, src_t = args[0], args[1]
    non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    dst, src = emu.device_of(dst_t), emu.device_of(src_t)
    if dst == src:
        if dst is None:
            return func(*args, **kwargs)
        return kernel(emu, emu.current_stream(dst), func, args, kwargs, [src_t], [dst_t], dst)
    return _copy_between(emu, func, args, kwargs, src, dst, src_t, dst_t, non_blocking)


def _index(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    """Indexing with a boolean mask needs the number of true elements on the host."""
    indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
    dev = emu.device_of(args[0])
    if dev is not None and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices):
        reads = [args[0]] + [i for i in indices if isinstance(i, torch.Tensor)]
        return kernel(emu, emu.current_stream(dev), func, args, kwargs, reads, [], dev, sync=True)
    return _generic(emu, func, args, kwargs)


_SPECIAL: dict[Any, Callable[..., Any]] = {
    aten.record_stream.default: _record_stream,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.index.Tensor: _index,
}
for _packet in (aten.set_, aten.resize_, aten.resize_as_):
    for _name in _packet.overloads():
        _SPECIAL[getattr(_packet, _name)] = _metadata


# --- the placement mode -----------------------------------------------------------------------


def _as_device(value: Any) -> Optional[torch.device]:
    if isinstance(value, torch.device):
        return value
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return torch.device("cuda", value)
    if isinstance(value, str):
        try:
            return torch.device(value)
        except RuntimeError:
            return None
    return None


def on_device(emu: Emulator, func: Any, args: tuple, kwargs: dict, device: torch.device) -> Any:
    """Call ``func`` (whose device arguments now say CPU) for ``device``."""
    emu.push_target(device)
    try:
        out = func(*args, **kwargs)
    finally:
        emu.pop_target()
    if device.type == "cuda":
        emu.adopt(out, device.index)
    return out


def _fn_to(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    self, rest, kw = args[0], list(args[1:]), dict(kwargs)
    target = None
    if rest and isinstance(rest[0], torch.Tensor):
        other = rest[0]
        target = other.device
        rest[0] = other.dtype
    elif rest and not isinstance(rest[0], torch.dtype) and _as_device(rest[0]) is not None:
        target = _as_device(rest[0])
        rest[0] = _CPU
    elif kw.get("device") is not None:
        target = _as_device(kw["device"])
        kw["device"] = _CPU
    if target is None or target.type not in ("cuda", "cpu"):
        return func(*args, **kwargs)
    target = emu.resolve(target)
    if self.device == target:
        return func(self, *rest, **kw)  # same device: whatever .to() does on one device
    kw["copy"] = True
    return on_device(emu, func, (self, *rest), kw, target)


def _fn_cuda(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    self = args[0]
    device = args[1] if len(args) > 1 else kwargs.get("device")
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    if device is None:
        target = torch.device("cuda")
    elif isinstance(device, int):
        target = torch.device("cuda", device)
    else:
        target = torch.device(device)
    kw = {"non_blocking": non_blocking, "memory_format": kwargs.get("memory_format", torch.preserve_format)}
    return _fn_to(emu, torch.Tensor.to, (self, target), kw)


def _fn_cpu(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    kw = {"memory_format": kwargs.get("memory_format", torch.preserve_format)}
    return _fn_to(emu, torch.Tensor.to, (args[0], _CPU), kw)


def _fn_new(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    """``x.new_*(...)``: on ``x``'s device unless told otherwise."""
    if kwargs.get("device") is None:
        device = args[0].device
        if device.type == "cuda":
            return on_device(emu, func, args, kwargs, device)
        return func(*args, **kwargs)
    return _placed(emu, func, args, kwargs)


def _placed(emu: Emulator, func: Any, args: tuple, kwargs: dict) -> Any:
    device = _as_device(kwargs["device"])
    if device is None or device.type != "cuda":
        return on_device(emu, func, args, kwargs, _CPU)
    return on_device(emu, func, args, dict(kwargs, device=_CPU), emu.resolve(device))


_UNTYPED_STORAGE = torch._C.TensorBase.untyped_storage

_FN: dict[Any, Callable[..., Any]] = {
    torch.Tensor.to: _fn_to,
    torch.Tensor.cuda: _fn_cuda,
    torch.Tensor.cpu: _fn_cpu,
}
for _name in ("new_tensor", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"):
    _FN[getattr(torch.Tensor, _name)] = _fn_new


class PlacementMode(TorchFunctionMode):
    def __init__(self, emu: Emulator):
        super().__init__()
        self.emu = emu

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _UNTYPED_STORAGE or getattr(func, "__name__", None) == "__get__":
            return func(*args, **kwargs)
        for t in types:
            if not issubclass(t, torch.Tensor):
                return func(*args, **kwargs)  # fx proxies and the like: leave their calls alone
        emu = self.emu
        handler = _FN.get(func)
        if handler is not None:
            out = handler(emu, func, args, kwargs)
        elif kwargs.get("device") is not None:
            out = _placed(emu, func, args, kwargs)
        else:
            # Tensors C++ makes for this call "with the options of" an argument say CPU at the
            # kernel level; the call's first emulated-CUDA argument says which device they mean.
            dev = _first_device(emu, args, kwargs)
            emu.push_target(_CPU if dev is None else _CUDA[dev])
            try:
                out = func(*args, **kwargs)
            finally:
                emu.pop_target()
        if _GRAD_ENABLED() and emu.backward is not None:
            # The autograd nodes this call made run their backward on the stream current now.
            emu.backward.tag(out)
        return out


_CUDA = [torch.device("cuda", i) for i in range(64)]


def _first_device(emu: Emulator, args: tuple, kwargs: dict) -> Optional[int]:
    for v in itertools.chain(args, kwargs.values()):
        if isinstance(v, torch.Tensor):
            d = emu.device_of(v)
            if d is not None:
                return d
        elif isinstance(v, (list, tuple)):
            for t in v:
                if isinstance(t, torch.Tensor):
                    d = emu.device_of(t)
                    if d is not None:
                        return d
    return None
