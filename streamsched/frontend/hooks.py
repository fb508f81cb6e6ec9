"""Module hooks: which modules have them, and whether PyTorch's global ones are set.

A hook fires inside ``nn.Module.__call__``. The trace cannot keep one on a module it
traces through (the hook would run once, at trace time, on fx proxies), and no fused
kernel can fire one per member; so a hooked module runs as one call of its own
(``frontend.trace``), is never fused (``passes.fusion``), and hooks on the wrapped model
itself or global module hooks make the wrapper run the model as written (``module``).

One kind of hook is the opposite: a *capture* hook, whose only effect is to hand the
module's output to the enclosing forward, which returns it (transformers' output
capturing: ``output_hidden_states=True`` collects each layer's output through forward
hooks into a context the decorated ``forward`` reads back). Run at call time inside an
opaque module, its output would never reach the traced forward that returns it. Such
hooks are traced: they fire at trace time on the proxies, so what they hand over is a
graph value, and run as no-ops at run time (their context is unset there). A module run
as one call (a leaf, an opaque class) cannot have its inner modules' capture hooks fired
on proxies: while outputs are collected (:func:`capture_collecting`), a trace meeting
such a module (:func:`captures_below`) makes its caller run as written instead, where
the hooks fire in the collecting context (``frontend.trace``: ``CaptureInsideLeaf``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from torch import nn
from torch.nn.modules import module as _module

__all__ = [
    "has_hooks",
    "hook_ids",
    "global_hooks",
    "capture_hooks",
    "capture_collecting",
    "captures_below",
    "is_capture_hook",
    "is_counting_hook",
    "COUNTING_HOOK",
]

# Modules whose forward hooks only hand outputs to the enclosing forward (see above).
_CAPTURE_HOOK_MODULES = frozenset({"transformers.utils.output_capturing"})


def is_capture_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is a capture hook (module docstring), traced rather than run."""
    return getattr(hook, "__module__", None) in _CAPTURE_HOOK_MODULES


def capture_hooks(m: nn.Module) -> list[Callable[..., Any]]:
    """The capture hooks among ``m``'s forward hooks, in registration order."""
    return [h for h in m._forward_hooks.values() if is_capture_hook(h)]


def capture_collecting() -> bool:
    """Whether a capture context is set on this thread now (transformers' decorated
    forward is collecting outputs: ``output_hidden_states`` / ``output_attentions``)."""
    for name in _CAPTURE_HOOK_MODULES:
        collector = getattr(sys.modules.get(name), "_active_collector", None)
        if collector is not None and collector.get() is not None:
            return True
    return False


def captures_below(m: nn.Module) -> bool:
    """Whether a module inside ``m`` (not ``m`` itself) has a capture hook. Run as one
    call, ``m`` would run those hooks at call time, where no context collects: what they
    hand over would never reach the traced forward."""
    return any(capture_hooks(sub) for sub in m.modules() if sub is not m)


def is_counting_hook(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is the leaf-call counter's (``frontend.leafcalls``): it sits on
    leaf modules for the length of one recording call, and changes nothing a trace or a
    plan made meanwhile (a nested wrapper's) may depend on."""
    return getattr(hook, COUNTING_HOOK, False)


# Set on the leaf-call counter's forward pre-hooks.
COUNTING_HOOK = "_streamsched_counting_hook"


def has_hooks(m: nn.Module) -> bool:
    """Whether ``m`` has a forward, forward-pre, backward or backward-pre hook that must
    fire at run time (capture hooks and the leaf-call counter's do not count)."""
    # On every call of the wrapper: empty tables (the usual case) cost no generator.
    forward = m._forward_hooks
    pre = m._forward_pre_hooks
    return bool(
        (forward and any(not is_capture_hook(h) for h in forward.values()))
        or (pre and any(not is_counting_hook(h) for h in pre.values()))
        or m._backward_hooks
        or getattr(m, "_backward_pre_hooks", None)
    )


def hook_ids(m: nn.Module) -> tuple:
    """The handle ids of ``m``'s forward, forward-pre, backward and backward-pre hooks
    (the leaf-call counter's left out; ``()`` where none is left): PyTorch never hands
    an id out twice, so equal ids mean the very same hooks."""
    pre = m._forward_pre_hooks
    ids = (
        tuple(m._forward_hooks),
        tuple(k for k, h in pre.items() if not is_counting_hook(h)) if pre else (),
        tuple(m._backward_hooks),
        tuple(getattr(m, "_backward_pre_hooks", None) or ()),
    )
    return ids if any(ids) else ()


def global_hooks() -> bool:
    """Whether a global module hook (``nn.modules.module.register_module_forward_hook``
    and its siblings) is registered: it fires on every module call of every model."""
    return bool(
        _module._global_forward_hooks
        or _module._global_forward_pre_hooks
        or _module._global_backward_hooks
        or getattr(_module, "_global_backward_pre_hooks", None)
    )
