"""In-place writes that could race a launched branch.

The forward's own writes are seen by :class:`_WriteGuard`, which first waits for any
running branch that reads the written memory (:func:`_storage_key` tells which memory a
tensor is); a launched branch's writes to its own arguments are found by comparing
version counters (:func:`_version`) before and after it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from .pending import _IN_PLACE, _tensors, resolve

if TYPE_CHECKING:
    from .call import _EagerCall


def _storage_key(t: torch.Tensor) -> Optional[tuple]:
    try:
        return (t.device, t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
        return None


def _version(t: torch.Tensor) -> Optional[int]:
    if t.is_inference():
        return None  # inference tensors keep no version counter
    return t._version


_INPLACE_DUNDERS = frozenset(f"__{name}__" for name in (*_IN_PLACE, "setitem", "delitem"))


def _writes(func: Any, kwargs: dict) -> bool:
    if kwargs and (kwargs.get("out") is not None or kwargs.get("inplace") is True):
        return True
    name = getattr(func, "__name__", None)
    if not isinstance(name, str):
        return False
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


class _WriteGuard(TorchFunctionMode):
    """Sees every torch call of the forward (in the calling thread only: modes are
    thread-local) and, before one that writes in place to a tensor some running branch
    reads, waits for that branch, as eager order requires."""

    def __init__(self, call: _EagerCall):
        super().__init__()
        self.call = call

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        call = self.call
        if call.launches and _writes(func, kwargs):
            written = _tensors(resolve(args[:1])) + _tensors(resolve(kwargs.get("out")))
            if written:
                call.before_write(written)
        return func(*args, **kwargs)
