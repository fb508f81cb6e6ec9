"""Keep a trace free of side effects on the model.

fx runs a forward's Python once, with proxies for the graph's values. Anything in that
forward which acts on *real* state instead (a tensor attribute updated in place, a
module attribute assigned, ``self.calls += 1``) would happen once, while tracing, and
never again: the wrapper would silently differ from eager. While a trace runs, this
guard refuses such an act before it happens, by raising in the forward that does it;
the tracer then makes that module opaque (its calls run as written, every call).

Tensors created during the trace (constants a forward builds) may be written freely:
they are not the model's state.

Grad mode and autocast are thread state that fx does not record either: a forward's
``with torch.no_grad():`` (or ``enable_grad``, ``set_grad_enabled``, a ``@torch.no_grad()``
method) would switch grad mode once, while tracing, and the traced ops would then run in
the caller's mode every call (gradients where eager has none). :class:`GradModeGuard`
refuses any grad-mode switch while a trace runs; :func:`autocast_state` and
``torch.is_inference_mode_enabled`` are compared at every recorded op by the tracer
(``frontend.trace``), which refuses a forward that entered autocast or inference mode.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _generation
from .effects import fresh_outputs, op_accesses, storage_key

__all__ = ["TraceSideEffectGuard", "SideEffectDuringTrace", "GradModeGuard", "autocast_state"]


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
        if name.endswith("()"):
            what = f"the forward registers a hook on a {type(module).__name__} ({name})"
        else:
            what = f"{type(module).__name__}.forward assigns self.{name}"
        raise SideEffectDuringTrace(f"{what} while running: a Python side effect a trace would perform only once")

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


class GradModeGuard(TorchFunctionMode):
    """Active on the tracing thread while a trace runs (mode stacks are per thread):
    refuses ``torch._C._set_grad_enabled``, which ``no_grad``, ``enable_grad`` and
    ``set_grad_enabled`` all call, before the switch happens."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func is torch._C._set_grad_enabled:
            raise SideEffectDuringTrace(
                "switches grad mode (torch.no_grad / enable_grad / set_grad_enabled) while running: a trace "
                "cannot record that, and the traced ops would run in the caller's grad mode"
            )
        return func(*args, **(kwargs or {}))


_any_autocast = getattr(torch._C, "_is_any_autocast_enabled", None)


def autocast_state() -> tuple:
    """The autocast devices and dtypes in force on this thread (``()`` when none)."""
    if _any_autocast is not None and not _any_autocast():
        return ()
    state = []
    for device in ("cuda", "cpu"):
        if torch.is_autocast_enabled(device):
            state.append((device, torch.get_autocast_dtype(device)))
    return tuple(state)
