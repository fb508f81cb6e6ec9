"""What replaces ``torch.cuda`` while the emulated device is active.

``Stream``, ``Event`` and ``CUDAGraph`` are new classes with the interface of PyTorch's;
everything else keeps PyTorch's own Python code (``torch.cuda.stream``, ``set_stream``,
``current_stream``, ``device``, ``synchronize``, ``graph``, ``graph_pool_handle`` ...) and
only the ``torch._C._cuda_*`` functions under it are replaced. On ``torch.Tensor``,
``device``/``is_cuda``/``get_device`` report the emulated device of a tensor's storage,
and the few methods that read memory directly (``tolist``, ``numpy``, ``pin_memory``,
``record_stream``, ``__deepcopy__``) behave as they do for CUDA tensors.
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.cuda._sanitizer
import torch.cuda.graphs as _graphs_mod
import torch.cuda.streams as _streams_mod

from ._core import SANITIZER_TRACEBACK, CudaError, Emulator, quiet

_ACTIVE: Optional[Emulator] = None


def emulator() -> Emulator:
    if _ACTIVE is None:
        raise RuntimeError("the emulated CUDA device is not active")
    return _ACTIVE


def _device_index(device: Any) -> int:
    emu = emulator()
    if device is None:
        return emu.current_device()
    if isinstance(device, int):
        return emu.check_index(device)
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        return emu.current_device() if device.index is None else emu.check_index(device.index)
    if hasattr(device, "idx"):  # torch.cuda.device
        return device.idx
    raise ValueError(f"not a CUDA device: {device!r}")


# --- streams, events, graphs -----------------------------------------------------------------


class Stream(torch.Stream):
    """An emulated ``torch.cuda.Stream``: a queue of work on one emulated device."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> Stream:
        if "stream_id" in kwargs:
            return super().__new__(
                cls,
                stream_id=kwargs["stream_id"],
                device_index=kwargs["device_index"],
                device_type=kwargs.get("device_type", 1),
            )
        state = emulator().new_stream(_device_index(device), priority)
        return super().__new__(cls, stream_id=state.stream_id, device_index=state.device, device_type=1)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _state(self) -> Any:
        return emulator().stream_of(self)

    def wait_event(self, event: Event) -> None:
        event.wait(self)

    def wait_stream(self, stream: Stream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: Optional[Event] = None) -> Event:
        if event is None:
            event = Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return emulator().stream_query(self._state())

    def synchronize(self) -> None:
        emulator().stream_synchronize(self._state())

    @property
    def cuda_stream(self) -> int:
        return self._state().handle

    @property
    def priority(self) -> int:
        return self._state().priority

    def __eq__(self, other: object) -> bool:
        return torch.Stream.__eq__(self, other) if isinstance(other, torch.Stream) else False

    __hash__ = torch.Stream.__hash__

    def __repr__(self) -> str:
        return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.cuda_stream:#x} (emulated)>"


class Event:
    """An emulated ``torch.cuda.Event``."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, external: bool = False
    ):
        self._emu = emulator()
        self._state = self._emu.new_event(enable_timing)

    def record(self, stream: Optional[Stream] = None) -> None:
        if stream is None:
            stream = torch.cuda.current_stream()
        self._emu.event_record(self._state, self._emu.stream_of(stream))

    def wait(self, stream: Optional[Stream] = None) -> None:
        if stream is None:
            stream = torch.cuda.current_stream()
        self._emu.event_wait(self._state, self._emu.stream_of(stream))

    def query(self) -> bool:
        return self._emu.event_query(self._state)

    def synchronize(self) -> None:
        self._emu.event_synchronize(self._state)

    def elapsed_time(self, end_event: Event) -> float:
        a, b = self._state, end_event._state
        if not (a.timing and b.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if not (a.recorded and b.recorded):
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (b.time - a.time) * 1000.0

    def ipc_handle(self) -> Any:
        raise RuntimeError("interprocess events are not emulated")

    @property
    def cuda_event(self) -> int:
        return 0x7E0000000000 + self._state.eid * 0x40

    @property
    def device(self) -> Optional[torch.device]:
        d = self._state.device
        return None if d is None else torch.device("cuda", d)

    def __del__(self) -> None:
        try:
            self._emu.event_deleted(self._state)
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def __repr__(self) -> str:
        return f"<torch.cuda.Event {self.cuda_event:#x} (emulated)>"


class CUDAGraph:
    """An emulated ``torch.cuda.CUDAGraph``: capture records the kernels issued on the
    capturing streams (checking CUDA's capture rules); replay runs them again."""

    def __new__(cls, keep_graph: bool = False) -> CUDAGraph:
        obj = super().__new__(cls)
        obj._emu = emulator()
        obj._capture = None
        obj._graph = None
        obj._pool_id = None
        obj._emu._graphs.add(obj)
        return obj

    def capture_begin(
        self, pool: Any = None, capture_error_mode: str = "global", check_input_liveness: bool = False
    ) -> None:
        if self._graph is not None:
            raise RuntimeError(
                "This CUDAGraph instance already owns a captured graph. To capture a new graph, create a new instance."
            )
        cap = self._emu.capture_begin(pool, capture_error_mode)
        self._capture = cap
        self._pool_id = cap.pool.pool_id

    def capture_end(self) -> None:
        cap = self._capture
        if cap is None:
            raise RuntimeError("capture_end() called before capture_begin().")
        graph = self._emu.capture_end(cap)
        self._capture = None
        self._graph = graph

    def instantiate(self) -> None:
        pass

    def replay(self) -> None:
        if self._graph is None:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        self._emu.replay(self._graph)

    def reset(self) -> None:
        # As PyTorch's: a graph releases its pool only if its capture ended successfully.
        if self._graph is not None:
            self._emu.release_pool(self._pool_id)
            self._graph = None

    def pool(self) -> Any:
        if self._graph is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._pool_id

    def enable_debug_mode(self) -> None:
        pass

    def debug_dump(self, debug_path: str) -> None:
        pass

    def __del__(self) -> None:
        try:
            self.reset()
        except Exception:  # noqa: BLE001
            pass


class _Properties(types.SimpleNamespace):
    pass


def _properties(device: Any = None) -> _Properties:
    index = _device_index(device)
    return _Properties(
        name="Emulated CUDA device (streamsched)",
        major=9,
        minor=0,
        total_memory=80 * 2**30,
        multi_processor_count=132,
        max_threads_per_multi_processor=2048,
        L2_cache_size=50 * 2**20,
        warp_size=32,
        is_integrated=False,
        is_multi_gpu_board=False,
        uuid=f"emulated-{index}",
        gcnArchName="",
        index=index,
    )


# --- the C functions under torch.cuda ----------------------------------------------------------


def _c_functions(emu: Emulator) -> dict[str, Any]:
    def get_current_stream(device_index: int) -> tuple:
        s = emu.current_stream(device_index if device_index is not None and device_index >= 0 else None)
        return (s.stream_id, s.device, 1)

    def get_default_stream(device_index: int) -> tuple:
        d = emu.current_device() if device_index is None or device_index < 0 else device_index
        return (0, d, 1)

    def set_stream(stream_id: int = 0, device_index: int = 0, device_type: int = 1) -> None:
        emu.set_current_stream(emu.stream(device_index, stream_id))

    def sleep(cycles: int) -> None:
        stream = emu.current_stream()
        emu._check_valid(stream)
        emu.launch(stream, [], [], "cuda_sleep")

    return {
        "_cuda_getDeviceCount": lambda: emu.num_devices,
        "_cuda_getDevice": emu.current_device,
        "_cuda_setDevice": emu.set_device,
        "_cuda_exchangeDevice": emu.exchange_device,
        "_cuda_maybeExchangeDevice": emu.exchange_device,
        "_cuda_getCurrentStream": get_current_stream,
        "_cuda_getDefaultStream": get_default_stream,
        "_cuda_setStream": set_stream,
        "_cuda_synchronize": lambda: emu.device_synchronize(emu.current_device()),
        "_cuda_sleep": sleep,
        "_cuda_init": lambda: None,
        "_cuda_emptyCache": lambda: None,
        "_host_emptyCache": lambda: None,
        "_cuda_isCurrentStreamCapturing": lambda: emu.current_stream().capture is not None,
        "_graph_pool_handle": emu.pool_handle,
        "_cuda_memoryStats": emu.memory_stats,
        "_cuda_resetPeakMemoryStats": emu.reset_peak,
        "_cuda_resetAccumulatedMemoryStats": lambda device: None,
        "_cuda_endAllocateToPool": lambda device, pool: emu.end_allocate_to_pool(pool),
        "_cuda_releasePool": lambda device, pool: emu.release_pool(pool),
    }


# --- torch.Tensor --------------------------------------------------------------------------------

_REAL_DEVICE = torch._C.TensorBase.device.__get__  # type: ignore[attr-defined]
_CUDA = [torch.device("cuda", i) for i in range(64)]

try:
    from torch._C._functorch import get_unwrapped, is_functorch_wrapped_tensor
except ImportError:  # pragma: no cover - older torch
    get_unwrapped = is_functorch_wrapped_tensor = None  # type: ignore[assignment]


def _device(self: torch.Tensor) -> torch.device:
    real = _REAL_DEVICE(self)
    emu = _ACTIVE
    if emu is None or real.type != "cpu":
        return real
    t = self
    if is_functorch_wrapped_tensor is not None:
        while is_functorch_wrapped_tensor(t):
            t = get_unwrapped(t)
    d = emu.device_of(t)
    return real if d is None else _CUDA[d]


def _is_cuda(self: torch.Tensor) -> bool:
    return _device(self).type == "cuda"


def _is_cpu(self: torch.Tensor) -> bool:
    return _device(self).type == "cpu"


def _get_device(self: torch.Tensor) -> int:
    d = _device(self)
    return d.index if d.type == "cuda" else -1


def _tensor_methods(emu: Emulator) -> dict[str, Any]:
    orig_tolist = torch.Tensor.tolist
    orig_numpy = torch.Tensor.numpy
    orig_deepcopy = torch.Tensor.__deepcopy__

    def tolist(self: torch.Tensor) -> Any:
        if emu.device_of(self) is not None:
            return orig_tolist(self.cpu())
        return orig_tolist(self)

    def numpy(self: torch.Tensor, *, force: bool = False) -> Any:
        d = emu.device_of(self)
        if d is not None:
            raise TypeError(
                f"can't convert cuda:{d} device type tensor to numpy. "
                "Use Tensor.cpu() to copy the tensor to host memory first."
            )
        return orig_numpy(self, force=force)

    def deepcopy(self: torch.Tensor, memo: dict) -> torch.Tensor:
        d = emu.device_of(self)
        result = orig_deepcopy(self, memo)
        if d is not None:
            emu.adopt(result, d)
        return result

    def pin_memory(self: torch.Tensor, device: Any = None) -> torch.Tensor:
        d = emu.device_of(self)
        if d is not None or _REAL_DEVICE(self).type != "cpu":
            raise RuntimeError(f"cannot pin '{self.type()}' only dense CPU tensors can be pinned")
        if emu.is_pinned(self):
            return self
        emu.unsafe("cudaHostAlloc (pinned host memory)")
        with quiet():
            out = self.clone()
        out.requires_grad_(self.requires_grad)
        emu.mark_pinned(out)
        return out

    def is_pinned(self: torch.Tensor, device: Any = None) -> bool:
        return emu.is_pinned(self)

    def record_stream(self: torch.Tensor, stream: Any) -> None:
        emu.record_stream(self, emu.stream_of(stream))

    return {
        "device": property(_device),
        "is_cuda": property(_is_cuda),
        "is_cpu": property(_is_cpu),
        "get_device": _get_device,
        "tolist": tolist,
        "numpy": numpy,
        "__deepcopy__": deepcopy,
        "pin_memory": pin_memory,
        "is_pinned": is_pinned,
        "record_stream": record_stream,
    }


# --- autocast ------------------------------------------------------------------------------------


def _autocast_methods() -> dict[str, Any]:
    """``torch.autocast("cuda")`` also casts the emulated device's (CPU) tensors: it enters
    CPU autocast with the same dtype and cache setting, so casts (and the cast cache) happen
    as they would on the GPU."""
    cls = torch.amp.autocast_mode.autocast
    orig_enter, orig_exit = cls.__enter__, cls.__exit__

    def enter(self: Any) -> Any:
        out = orig_enter(self)
        if getattr(self, "device", None) == "cuda" and getattr(self, "_enabled", False):
            inner = cls("cpu", dtype=self.fast_dtype, enabled=True, cache_enabled=self._cache_enabled)
            inner.__enter__()
            self._ss_emulated_inner = inner
        return out

    def exit_(self: Any, *exc: Any) -> Any:
        inner = self.__dict__.pop("_ss_emulated_inner", None)
        if inner is not None:
            inner.__exit__(*exc)
        return orig_exit(self, *exc)

    return {"__enter__": enter, "__exit__": exit_}


def _autograd_functions(backward: Any) -> list[tuple[Any, str, Any]]:
    """Where autograd meets the emulated streams (``_autograd``): the node a custom
    ``autograd.Function`` makes (no mode sees it made) is tagged with the stream current
    when ``apply`` returns; the engine's entry point notes the caller's streams."""
    function = torch.autograd.function.Function
    apply = function.__dict__["apply"]

    def tagged_apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        out = apply.__get__(None, cls)(*args, **kwargs)
        if torch.is_grad_enabled():
            backward.tag(out)
        return out

    run = torch.autograd._engine_run_backward

    def run_backward(*args: Any, **kwargs: Any) -> Any:
        return backward.run_backward(run, *args, **kwargs)

    return [(function, "apply", classmethod(tagged_apply)), (torch.autograd, "_engine_run_backward", run_backward)]


# --- installing and removing ---------------------------------------------------------------------

_MISSING = object()


class Patches:
    """Attribute replacements, undone in reverse order."""

    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, value: Any) -> None:
        if isinstance(owner, type):
            old = owner.__dict__.get(name, _MISSING)
        else:
            old = getattr(owner, name, _MISSING)
        self._undo.append((owner, name, old))
        setattr(owner, name, value)

    def undo(self) -> None:
        while self._undo:
            owner, name, old = self._undo.pop()
            if old is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, old)


def install(emu: Emulator) -> Patches:
    global _ACTIVE
    p = Patches()
    for name, fn in _c_functions(emu).items():
        p.set(torch._C, name, fn)
    p.set(torch.cuda._sanitizer, "traceback", SANITIZER_TRACEBACK)
    cuda = torch.cuda
    p.set(cuda, "_initialized", True)
    p.set(cuda, "_cached_device_count", None)
    p.set(cuda, "_exchange_device", emu.exchange_device)
    p.set(cuda, "_maybe_exchange_device", emu.exchange_device)
    for owner in (cuda, _streams_mod):
        p.set(owner, "Stream", Stream)
        p.set(owner, "Event", Event)
    for owner in (cuda, _graphs_mod):
        p.set(owner, "CUDAGraph", CUDAGraph)
    p.set(_graphs_mod, "_graph_pool_handle", emu.pool_handle)
    p.set(_graphs_mod, "_cuda_isCurrentStreamCapturing", lambda: emu.current_stream().capture is not None)
    p.set(cuda.graph, "default_capture_stream", None)
    p.set(cuda, "get_device_properties", _properties)
    for name in ("manual_seed", "manual_seed_all", "seed", "seed_all"):
        p.set(cuda, name, lambda *a, **k: None)
    p.set(cuda, "initial_seed", torch.initial_seed)
    p.set(cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    p.set(cuda, "set_rng_state", lambda state, device="cuda": None)
    for name, fn in _tensor_methods(emu).items():
        p.set(torch.Tensor, name, fn)
    for name, fn in _autocast_methods().items():
        p.set(torch.amp.autocast_mode.autocast, name, fn)
    if emu.backward is not None:
        for owner, name, fn in _autograd_functions(emu.backward):
            p.set(owner, name, fn)
    _ACTIVE = emu
    return p


def uninstall(patches: Patches) -> None:
    global _ACTIVE
    _ACTIVE = None
    patches.undo()


__all__ = ["Stream", "Event", "CUDAGraph", "CudaError", "install", "uninstall", "emulator"]
