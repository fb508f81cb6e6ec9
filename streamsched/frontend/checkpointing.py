"""Activation checkpointing (``torch.utils.checkpoint``) inside a traced forward.

``checkpoint(fn, *args)`` runs ``fn`` without keeping its activations and runs it again in
backward. fx would trace through it: the region's operations would become ordinary
nodes of the plan, which keeps every activation they save. The outputs and gradients
would still equal eager's, but the memory the user asked checkpointing to save would
silently be spent again (on a GPU, the difference between a step that fits and one
that runs out of memory).

So while a trace runs, checkpointing is refused on the tracing thread: both of its
ways in (``CheckpointFunction.apply`` for ``use_reentrant=True``, the non-reentrant
generator otherwise) are looked up by ``checkpoint`` in its module's globals at every
call, whatever name the caller imported it under, and are patched for the length of
the trace with stand-ins that raise :class:`CheckpointDuringTrace` there (and call the
original on any other thread). The tracer then takes the ``checkpoint`` call itself as
one opaque function call (``frontend.opaque_functions``, :func:`checkpoint_site`): the
plan runs ``checkpoint(fn, *args, ...)`` as written, with its own arguments, so the
region keeps checkpointing's memory and recomputation exactly. Where the call cannot be
taken (the caller reaches ``checkpoint`` through an object, as transformers'
``self._gradient_checkpointing_func`` partial; ``fn`` a lambda made during the forward),
the module that calls it runs as written instead, as for any untraceable forward.

A wrapper called inside a non-reentrant checkpointed region (the region's forward, or
its recomputation in backward: :func:`in_checkpoint_region`) runs its model as written.
The recomputation must save the same tensors, in the same order and shapes, as the
forward did (checkpoint checks), and a wrapper's calls may take different ways from
call to call (the recording call, a trial, a plan).
"""

from __future__ import annotations

import types
from typing import Any, Optional

import torch
import torch.utils.checkpoint as _ckpt

from .trace_patches import PatchWhileTracing

__all__ = ["CheckpointDuringTrace", "CHECKPOINT_REFUSAL", "checkpoint_site", "in_checkpoint_region", "ENTRY_POINTS"]

# What a forward calls to checkpoint a region (``checkpoint_sequential`` calls
# ``checkpoint`` for each segment).
ENTRY_POINTS = tuple(f for f in (getattr(_ckpt, name, None) for name in ("checkpoint", "checkpoint_sequential")) if f)


class CheckpointDuringTrace(RuntimeError):
    """Activation checkpointing reached while tracing: the ``checkpoint`` call is taken as
    one opaque call instead (or its caller runs as written)."""


_MESSAGE = (
    "runs activation checkpointing (torch.utils.checkpoint) while tracing: traced through, the "
    "checkpointed region would keep every activation it is meant to free"
)

_top_saved_tensors_hooks = torch._C._autograd._top_saved_tensors_default_hooks


def in_checkpoint_region() -> bool:
    """Whether the innermost saved-tensor hooks of this thread are a non-reentrant
    checkpoint's (its forward's, or its recomputation's)."""
    hooks = _top_saved_tensors_hooks(False)
    return hooks is not None and getattr(hooks[0], "__module__", None) == _ckpt.__name__


class _RefusingFunction:
    """Stands for ``CheckpointFunction`` while traces run: ``apply`` raises on a tracing
    thread and is the original's elsewhere; every other attribute is the original's."""

    def __init__(self, original: Any):
        self._original = original

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        if CHECKPOINT_REFUSAL.tracing():
            raise CheckpointDuringTrace(_MESSAGE)
        return self._original.apply(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._original, name)


def _refusing_generator(original: Any) -> Any:
    def generator(*args: Any, **kwargs: Any) -> Any:
        if CHECKPOINT_REFUSAL.tracing():
            raise CheckpointDuringTrace(_MESSAGE)
        return original(*args, **kwargs)

    generator.__wrapped__ = original  # type: ignore[attr-defined]
    return generator


def _install() -> dict[tuple[Any, str], Any]:
    originals: dict[tuple[Any, str], Any] = {}
    function = getattr(_ckpt, "CheckpointFunction", None)
    if function is not None:
        originals[(_ckpt, "CheckpointFunction")] = function
        _ckpt.CheckpointFunction = _RefusingFunction(function)
    # (``_checkpoint_without_reentrant_generator``; ``..._impl`` in later torch.)
    for name, generator in list(vars(_ckpt).items()):
        if name.startswith("_checkpoint_without_reentrant_generator") and callable(generator):
            originals[(_ckpt, name)] = generator
            setattr(_ckpt, name, _refusing_generator(generator))
    return originals


# Begun and ended around every trace (``trace_guard.GradModeGuard``): while any thread
# traces, the module's globals are patched; the stand-ins refuse on tracing threads.
CHECKPOINT_REFUSAL = PatchWhileTracing(_install)


def checkpoint_site(caller_globals: dict) -> Optional[tuple[dict, str, Any]]:
    """How a forward with ``caller_globals`` reaches a checkpoint entry point by name:
    ``(namespace, name, function)``: a global of its own (``from torch.utils.checkpoint
    import checkpoint``) or an attribute of a module it imported
    (``checkpoint_module.checkpoint``, ``torch.utils.checkpoint.checkpoint``). ``None``
    where it reaches none by name."""
    for key, value in caller_globals.items():
        if any(value is f for f in ENTRY_POINTS):
            return caller_globals, key, value
    modules = [v for v in list(caller_globals.values()) if isinstance(v, types.ModuleType)]
    # torch itself: ``torch.utils.checkpoint.checkpoint(...)`` reaches the module's own name.
    modules += [_ckpt] if any(m is _ckpt or getattr(m, "__name__", "") == "torch" for m in modules) else []
    for module in modules:
        namespace = vars(module)
        for key, value in list(namespace.items()):
            if any(value is f for f in ENTRY_POINTS):
                return namespace, key, value
    return None
