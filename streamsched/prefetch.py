"""Input prefetching: copy batch k+1 to the GPU while the model computes on batch k.

A training loop that reads CPU batches and calls ``batch.to("cuda")`` serialises the
host-to-device copy with the compute: the copy sits on the compute stream, in front of
the forward that needs it. :class:`Prefetcher` moves each batch on a dedicated copy
stream one step ahead, so the copy of the next batch overlaps the current step::

    caller stream:  [wait e0] [step 0 ...........] [wait e1] [step 1 .........]
    copy stream:    [copy 0] e0 [copy 1] e1            [copy 2] e2

CUDA semantics relied on (https://pytorch.org/docs/stable/notes/cuda.html):

- a copy from *pinned* host memory with ``non_blocking=True`` is asynchronous with
  respect to the host, so issuing it costs microseconds; from pageable memory it is not,
  hence CPU tensors are pinned first (``pin_memory=True``);
- ``consumer.wait_event(e)`` orders only *future* work of the consumer stream after the
  copy: the consumer never reads a half-copied batch, and the host never blocks;
- the batch's device memory is allocated on the copy stream; ``record_stream(consumer)``
  tells the caching allocator that the consumer uses it too, so the memory is not handed
  to the next copy until the consumer's work on it has finished.

On a CPU (or any non-CUDA) device the prefetcher is a plain pass-through: each tensor is
moved with ``.to(device)`` if it is elsewhere, no stream, no thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar, Union

import torch
import torch.utils._pytree as pytree

from .errors import ConfigError

__all__ = ["Prefetcher", "CudaCopier", "InFlight", "one_ahead"]

Batch = TypeVar("Batch")


def _resolve_device(device: Union[str, int, torch.device]) -> torch.device:
    """``device`` as a ``torch.device``, or a ConfigError that says what is wrong with it."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise ConfigError(f"Prefetcher: device must be a str, int or torch.device, got {type(device).__name__}")
    if isinstance(device, int):
        # torch.device(0) means the current accelerator, and fails without one: say so ourselves.
        if device < 0:
            raise ConfigError(f"Prefetcher: device index must be >= 0, got {device}")
        device = f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ConfigError(f"Prefetcher: {device!r} is not a device ({exc})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"Prefetcher: device {str(resolved)!r} requested, but CUDA is not available here")
        count = torch.cuda.device_count()
        if resolved.index is not None and resolved.index >= count:
            raise ConfigError(
                f"Prefetcher: device {str(resolved)!r} requested, but only {count} CUDA device(s) are visible"
            )
        if resolved.index is None:
            resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


class _LoaderFailed:
    """An exception raised by the loader while fetching ahead, to re-raise when its turn comes."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


_EXHAUSTED = object()


class InFlight:
    """A batch whose copy was issued on the copy stream, the tensors that copy made, and the
    event recorded after it."""

    __slots__ = ("batch", "copies", "event")

    def __init__(self, batch: Any, copies: list[torch.Tensor], event: Any):
        self.batch = batch
        self.copies = copies
        self.event = event


class CudaCopier:
    """The stream operations of prefetching onto one CUDA device.

    ``issue(batch)`` starts the copies of a batch on the copy stream and records an event
    after them; ``hand_out(in_flight)`` makes the caller's current stream wait on that
    event and marks every copy as used by it. :func:`one_ahead` drives any object with
    these two methods, so the order of operations can be checked without a GPU.
    """

    def __init__(self, device: torch.device, non_blocking: bool, pin_memory: bool):
        self.device = device
        self.non_blocking = non_blocking
        self.pin_memory = pin_memory
        self.stream = torch.cuda.Stream(device=device)

    def issue(self, batch: Any) -> InFlight:
        device, non_blocking, pin = self.device, self.non_blocking, self.pin_memory
        copies: list[torch.Tensor] = []

        def copy(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.device == device:
                return value
            if pin and value.device.type == "cpu" and not value.is_pinned():
                value = value.pin_memory()
            moved = value.to(device, non_blocking=non_blocking)
            copies.append(moved)
            return moved

        with torch.cuda.stream(self.stream):
            moved = pytree.tree_map(copy, batch)
            event = torch.cuda.Event()
            event.record(self.stream)
        return InFlight(moved, copies, event)

    def hand_out(self, pending: InFlight) -> Any:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(pending.event)
        # The copies were allocated on the copy stream: without this the allocator could
        # give their memory to the next copy while the consumer still reads it. Tensors the
        # loader handed out already on the device were not copied and are left alone.
        for tensor in pending.copies:
            tensor.record_stream(consumer)
        return pending.batch


def _fetch_ahead(iterator: Iterator[Any], copier: Any) -> Any:
    """The next batch with its copy under way, ``_EXHAUSTED``, or the loader's exception."""
    try:
        batch = next(iterator)
    except StopIteration:
        return _EXHAUSTED
    except Exception as exc:  # noqa: BLE001 - raised again at its own iteration
        return _LoaderFailed(exc)
    return copier.issue(batch)


def one_ahead(loader: Iterable[Any], copier: Any) -> Iterator[Any]:
    """Yield ``loader``'s batches through ``copier``, the copy of batch k+1 issued before
    batch k is handed out.

    An exception from the loader while fetching ahead is raised only when the caller asks
    for that batch, so the caller sees it at the same iteration as without prefetching.
    """
    iterator = iter(loader)
    pending = _fetch_ahead(iterator, copier)
    while pending is not _EXHAUSTED:
        if isinstance(pending, _LoaderFailed):
            raise pending.exc
        # Issue the next copy first: it runs on the copy stream while the caller computes
        # on the batch handed out now.
        following = _fetch_ahead(iterator, copier)
        yield copier.hand_out(pending)
        pending = following


class Prefetcher(Generic[Batch]):
    """Iterate over ``loader`` with each batch already on ``device``, copied one step ahead.

    Args:
        loader: any iterable of batches (a ``DataLoader``, a list, a generator). A batch
            may be a tensor or any nesting of tuples, lists, dicts and namedtuples holding
            tensors; other values (strings, ints, ``None``) are handed out untouched.
        device: where the tensors go: ``"cuda"``, ``"cuda:1"``, ``1``, ``torch.device``,
            ``"cpu"``. A string that is not a device, or a CUDA device that is not there,
            is a :class:`~streamsched.ConfigError`.
        non_blocking: issue host-to-device copies asynchronously (CUDA only).
        pin_memory: copy CPU tensors that are not pinned yet into pinned memory first, so
            that the copy is truly asynchronous (CUDA only).

    On CUDA, batch k+1 is taken from the loader and its copy issued on a dedicated copy
    stream *before* batch k is handed out; when a batch is handed out, the caller's
    current stream waits on the event recorded after its copy (the host does not block)
    and every tensor of it gets ``record_stream(caller_stream)``. An exception the loader
    raises while fetching ahead is kept and raised at the iteration that would have met
    it without prefetching. ``len(prefetcher)`` is ``len(loader)`` when the loader has one.

    Example::

        >>> import torch
        >>> from streamsched.prefetch import Prefetcher
        >>> loader = [(torch.randn(4, 3), torch.arange(4)) for _ in range(3)]
        >>> device = "cuda" if torch.cuda.is_available() else "cpu"
        >>> for x, y in Prefetcher(loader, device):
        ...     assert x.device.type == torch.device(device).type
        >>> len(Prefetcher(loader, device))
        3
    """

    def __init__(
        self,
        loader: Iterable[Batch],
        device: Union[str, int, torch.device],
        *,
        non_blocking: bool = True,
        pin_memory: bool = True,
    ):
        if not (hasattr(loader, "__iter__") or hasattr(loader, "__getitem__")):
            raise TypeError(f"Prefetcher: the loader must be iterable, got {type(loader).__name__}")
        for name, value in (("non_blocking", non_blocking), ("pin_memory", pin_memory)):
            if not isinstance(value, bool):
                raise ConfigError(f"Prefetcher: {name} must be True or False, got {value!r}")
        self.loader = loader
        self.device = _resolve_device(device)
        self.non_blocking = non_blocking
        self.pin_memory = pin_memory
        self._copier: Any = None

    def __len__(self) -> int:
        try:
            return len(self.loader)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"Prefetcher: the loader ({type(self.loader).__name__}) has no len()") from None

    def __iter__(self) -> Iterator[Batch]:
        if self.device.type == "cuda":
            if self._copier is None:  # one copy stream per prefetcher, made on first use
                self._copier = CudaCopier(self.device, self.non_blocking, self.pin_memory)
            return one_ahead(self.loader, self._copier)
        return self._moved_batches()

    def __repr__(self) -> str:
        return (
            f"Prefetcher({type(self.loader).__name__}, device={str(self.device)!r}, "
            f"non_blocking={self.non_blocking}, pin_memory={self.pin_memory})"
        )

    # --- non-CUDA devices: a pass-through --------------------------------------------

    def _moved_batches(self) -> Iterator[Batch]:
        device = self.device

        def move(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.device != device:
                return value.to(device)
            return value

        for batch in self.loader:
            yield pytree.tree_map(move, batch)
