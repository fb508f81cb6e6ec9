"""The forward's in-place writes that could race a launched branch.

:class:`_WriteGuard` sees the forward's torch calls and, before one that writes in place,
hands the written tensors to the call, which first waits for any running branch that
reads their memory. (A launched branch's writes to its own arguments are found by
comparing version counters before and after it runs, in :mod:`.body`.)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.overrides import TorchFunctionMode

from .pending import _IN_PLACE, resolve
from .values import _tensors

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
    thread-local) and, before one that writes in place while some branch of the call was
    launched (``launches``, the call's list, not empty), calls ``before_write`` with the
    tensors it writes, so that the call waits first for the branches that read them, as
    eager order requires."""

    def __init__(self, launches: list, before_write: Callable[[list[torch.Tensor]], None]):
        super().__init__()
        self.launches = launches
        self.before_write = before_write

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if kwargs is None:
            kwargs = {}
        if self.launches and _writes(func, kwargs):
            written = _tensors(resolve(args[:1])) + _tensors(resolve(kwargs.get("out")))
            if written:
                self.before_write(written)
        return func(*args, **kwargs)
