"""Keep a trace free of side effects on the model.

fx runs a forward's Python once, with proxies for the graph's values. Anything in that
forward which acts on *real* state instead (a tensor attribute updated in place, a
module attribute assigned, ``self.calls += 1``) would happen once, while tracing, and
never again: the wrapper would silently differ from eager. While a trace runs, this
guard refuses such an act before it happens, by raising in the forward that does it;
the tracer then makes that module opaque (its calls run as written, every call).

Tensors created during the trace (constants a forward builds) may be written freely:
they are not the model's state.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _generation
from .effects import fresh_outputs, op_accesses, storage_key

__all__ = ["TraceSideEffectGuard", "SideEffectDuringTrace"]


class SideEffectDuringTrace(RuntimeError):
    """A traced forward tried to change real state; raised where it tried."""


class TraceSideEffectGuard(TorchDispatchMode):
    """Active while one thread traces ``model``: refuses in-place writes to tensors that
    existed before the trace, and assignments to attributes of the model's modules."""

    def __init__(self, model: torch.nn.Module, trace_root: torch.nn.Module):
        super().__init__()
        self.fresh: set[int] = set()
        self.modules = {id(m) for m in model.modules()}
        self.trace_root = trace_root
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if threading.get_ident() == self.thread:
            _, writes = op_accesses(func, args, kwargs)
            for t in writes:
                key = storage_key(t)
                if key is not None and key not in self.fresh:
                    raise SideEffectDuringTrace(
                        f"{func._schema.name} would write a real tensor of shape {tuple(t.shape)} in place while "
                        "tracing (a tensor attribute or global, not a graph value): the write would happen once, "
                        "not on every call"
                    )
        out = func(*args, **kwargs)
        if threading.get_ident() == self.thread:
            for t in fresh_outputs(func, out):
                key = storage_key(t)
                if key is not None:
                    self.fresh.add(key)
        return out

    def _on_setattr(self, module: Any, name: str) -> None:
        if module is self.trace_root or id(module) not in self.modules:
            return
        raise SideEffectDuringTrace(
            f"{type(module).__name__}.forward assigns self.{name} while running: a Python side effect a trace "
            "would perform only once"
        )

    def __enter__(self) -> TraceSideEffectGuard:
        _generation._on_setattr[self.thread] = self._on_setattr
        try:
            return super().__enter__()
        except BaseException:
            _generation._on_setattr.pop(self.thread, None)
            raise

    def __exit__(self, *exc: Any) -> Any:
        _generation._on_setattr.pop(self.thread, None)
        return super().__exit__(*exc)
